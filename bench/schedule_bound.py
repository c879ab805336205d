"""Bench: the planner's iteration on the reference setup against two per-originator figures.

* **bound** (a true lower bound, simplified model): a micro-batch holds one of its
  originator's ``memory`` credits from its stage-0 forward to its stage-0 backward, at least
  ``RT`` = the cheapest isolated round trip (stage-0 forward, hops and body compute there and
  back, loss, stage-0 backward).  With ``M`` micro-batches a multiple of ``m`` credits, either
  a credit serves more than ``M / m`` of them or the credit whose first micro-batch starts last
  (at >= ``(m - 1)`` stage-0 forwards, the originator runs them one at a time) serves ``M / m``:
  the originator's last backward ends at >= ``(m - 1) f0 + (M / m) RT``.
* **alone** (an estimate, not a bound): the time its micro-batches need when nothing else runs,
  every one on the same cheapest route (no queueing on body nodes or links) and the originator
  running its forwards, losses and backwards by the simulator's rules (one task at a time,
  backward first, first come first served, ``memory`` credits); the minimum over the Pareto
  front of (forward delay, backward delay) of all routes.  Mixed routes can beat it (SkipPipe's
  published schedule does, by 0.4 s at its Australian originator at the published cost).

Printed per planner seed (simplified model): each originator's last finish, alone estimate and
bound; the iteration time against the placement's largest bound and alone estimate.  The same
for SkipPipe's published placement.

    .venv/bin/python bench/schedule_bound.py --seeds 8 --cost bench
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.net.topology import geo12  # noqa: E402
from skiptrain.schedule.cost import CostModel, published_cost, reference_cost  # noqa: E402
from skiptrain.schedule.construction import route_orders  # noqa: E402
from skiptrain.schedule.planner import PlanConfig, plan  # noqa: E402
from skiptrain.schedule.published import skippipe_ca  # noqa: E402
from skiptrain.schedule.routes import visits_per_route  # noqa: E402
from skiptrain.schedule.simulator import simulate  # noqa: E402

REF_KW = dict(n_stages=6, stage_sizes=[5, 3, 3, 3, 3, 3], skip_ratio=0.33, max_swaps=2, memory=3,
              mb_per_originator=6, contention=False, dp_sync=False)


def route_delays(topo, cost: CostModel, o: int, placement: list[list[int]], max_swaps: int,
                 visits: int) -> list[tuple[float, float]]:
    """Pareto front of (forward delay, backward delay) over every route from originator ``o``:
    forward delay = hops out and back to ``o`` + body forwards (forward end to loss ready),
    backward delay = the hops in reverse + body backwards (loss end to backward ready)."""
    S = len(placement)
    pts = set()
    for order in route_orders(S, visits, max_swaps):
        for nodes in itertools.product(*[placement[s] for s in order]):
            p = [o, *nodes, o]
            fw = sum(cost.hop_s(topo, p[i], p[i + 1]) + (cost.fwd_s(order[i], topo.nodes[p[i + 1]].speed)
                                                         if i < len(order) else 0.0) for i in range(len(p) - 1))
            bw = sum(cost.hop_s(topo, p[i + 1], p[i]) + (cost.bwd_s(order[i], topo.nodes[p[i + 1]].speed)
                                                         if i < len(order) else 0.0) for i in range(len(p) - 1))
            pts.add((round(fw, 9), round(bw, 9)))
    front = []
    for fw, bw in sorted(pts):
        if not front or bw < front[-1][1]:
            front.append((fw, bw))
    return front


def originator_alone(cost: CostModel, speed: float, fwd_delay: float, bwd_delay: float, n_mb: int,
                     memory: int) -> float:
    """Last backward end on an originator whose micro-batches all see these delays (module doc)."""
    f0, l0, b0 = cost.fwd_s(0, speed), cost.loss_s(speed), cost.bwd_s(0, speed)
    t, credits, nxt, ready, done = 0.0, memory, 0, [], 0.0
    finished = 0
    while finished < n_mb:
        now_ready = [x for x in ready if x[0] <= t + 1e-12]
        if now_ready:                           # backward class first, first come first served
            x = min(now_ready)
            ready.remove(x)
            if x[2] == "loss":
                t += l0
                ready.append((t + bwd_delay, x[1], "bwd"))
            else:
                t += b0
                credits += 1
                finished += 1
                done = t
        elif nxt < n_mb and credits > 0:
            credits -= 1
            t += f0
            ready.append((t + fwd_delay, nxt, "loss"))
            nxt += 1
        else:
            t = min(x[0] for x in ready)
    return done


def bounds(topo, cost: CostModel, placement: list[list[int]]) -> dict[int, tuple[float, float]]:
    """Per originator of ``placement``: (alone estimate, lower bound), see the module doc."""
    v = visits_per_route(REF_KW["skip_ratio"], len(placement))
    M, m = REF_KW["mb_per_originator"], REF_KW["memory"]
    out = {}
    for o in placement[0]:
        sp = topo.nodes[o].speed
        front = route_delays(topo, cost, o, placement, REF_KW["max_swaps"], v)
        alone = min(originator_alone(cost, sp, fw, bw, M, m) for fw, bw in front)
        rt = cost.fwd_s(0, sp) + cost.loss_s(sp) + cost.bwd_s(0, sp) + min(fw + bw for fw, bw in front)
        lb = (m - 1) * cost.fwd_s(0, sp) + (M // m) * rt if M % m == 0 else -(-M // m) * rt
        out[o] = (alone, lb)
    return out


def report(topo, cost: CostModel, sched, name: str) -> tuple[float, float, float]:
    """Print one schedule's row; (iteration s, largest alone estimate, largest bound)."""
    res = simulate(sched, topo, cost, contention=False, dp_sync=False, record=False)
    b = bounds(topo, cost, sched.placement)
    fin: dict[int, float] = {}
    for mb in sched.micro_batches:
        fin[mb.originator] = max(fin.get(mb.originator, 0.0), res.mb_done_s[mb.id])
    alone, lb = max(x for x, _ in b.values()), max(y for _, y in b.values())
    print(f"  {name:<20} {res.iteration_s:5.1f} s, alone {alone:4.1f}, bound {lb:4.1f} | per originator, last finish"
          " / alone / bound: " + ", ".join(f"{topo.nodes[o].location} {fin[o]:.1f}/{b[o][0]:.1f}/{b[o][1]:.1f}"
                                             for o in sched.placement[0]))
    return res.iteration_s, alone, lb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=None, help="planner seeds 0..N-1 (default 8; --quick 2)")
    ap.add_argument("--cost", choices=("bench", "published", "both"), default="both")
    ap.add_argument("--quick", action="store_true", help="two planner seeds")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = ap.parse_args(argv)
    n = args.seeds or (2 if args.quick else 8)
    topo = geo12(20)
    costs = {"bench": reference_cost, "published": published_cost}
    out: dict = {"seeds": n}
    for key in (("bench", "published") if args.cost == "both" else (args.cost,)):
        cost = costs[key]()
        print(f"== {key} cost, simplified model")
        pub = report(topo, cost, skippipe_ca(), "skippipe_published")
        rows = [report(topo, cost, plan(topo, cost, PlanConfig(**REF_KW, seed=sd)), f"planner seed {sd}")
                for sd in range(n)]
        print(f"  planner over {n} seeds: mean {sum(r[0] for r in rows) / len(rows):.1f} s; above the "
              f"alone estimate by {min(r[0] - r[1] for r in rows):.1f}-{max(r[0] - r[1] for r in rows):.1f} s, "
              f"above the bound by {min(r[0] - r[2] for r in rows):.1f}-{max(r[0] - r[2] for r in rows):.1f} s")
        keys = ("iteration_s", "alone_s", "bound_s")
        out[f"{key}_cost"] = {"skippipe_published": dict(zip(keys, pub)),
                              "planner": [dict(zip(keys, r)) for r in rows]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
