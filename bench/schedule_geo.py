"""Bench: SkipPipe's scheduling experiment, the planner vs. every baseline, at two compute costs.

Reference setup (schedule/data/skippipe_reference.json): 20 nodes over geo12 in the reference
order, 6 stages sized 5/3/3/3/3/3, m=3, 6 micro-batches per stage-0 node, d=1024 fp32, 4 layers
per stage, hop = latency + 32 MiB / bandwidth + 0.35 s, k=33%, <= 2 swaps.  Two costs:

* published cost: forward 0.44 s per stage (2 samples x 4096 tokens, 0.055 s per sample-layer),
  the setting behind SkipPipe's published schedule.json and its 79.9 s / 33.3 s;
* bench cost: forward 1.76 s per stage (8 samples x 1024 tokens), the reference description's
  numbers: the same 32 MiB hops with 4x the compute per stage.

Each cost is taken twice: without per-task overhead and with SkipPipe's 0.13 s per forward (and
loss) / 0.09 s per backward task (the ``+task`` columns); the reference tables, the seed sweep
and the unequal-compute rows report both, the compression and scale sweeps overhead 0.

Every method is simulated at both costs with the simplified model (no link contention, no DP
sync; SkipPipe's simulator's model): the planner, the planner without collision awareness, the
full pipeline on fixed lanes (30 micro-batches, the same global batch), SWARM-style greedy
wiring, random skip routes on the planner's placement (mean over --random-seeds seeds), and
SkipPipe's published schedules on their own placement: the collision-aware schedule (6
micro-batches per originator), their paths without collision awareness, their random paths,
and their 27-micro-batch lanes.  SkipPipe's own simulator times are printed beside them.

--seed-sweep N re-plans the reference setup with seeds 0..N-1 at both costs (the targets are on
the mean) and judges the plans made at one overhead under the other.  Unless
--quick: the full model (per-link FIFO contention + dense ring all-reduce per stage) at
both costs; activation compression (int8 / int4 on links slower than 1 GB/s) at both costs,
without and with the encode + decode time measured on this machine;
unequal compute (5 random 20-node topologies, 6 regions, speeds 0.5-2); 64 nodes; and the
18-node sweep over 4k/8k/16k tokens per micro-batch (bench cost).  Planner times are wall-clock
and CPU seconds (the limit is 10 s for 20 nodes on one core; on a shared machine wall-clock
includes other jobs).  --json PATH writes ``{"published_cost": {method: s}, "bench_cost": {...},
"planner_s": ..., "targets": {...}, ...}``; --gantt PATH the planner's Gantt chart (reference
setup, bench cost, full model).

    .venv/bin/python bench/schedule_geo.py --quick --json runs/bench/schedule_geo.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.net.topology import Topology, geo12, random_topology  # noqa: E402
from skiptrain.schedule.actcodec import measure_codec_s  # noqa: E402
from skiptrain.schedule.compare import METHODS, PUBLISHED_METHODS, compare, format_table  # noqa: E402
from skiptrain.schedule.cost import SKIPPIPE_TASK_S, CostModel, published_cost, reference_cost  # noqa: E402
from skiptrain.schedule.gantt import draw_gantt  # noqa: E402
from skiptrain.schedule.planner import PlanConfig  # noqa: E402
from skiptrain.schedule.published import published_times  # noqa: E402
from skiptrain.schedule.simulator import simulate  # noqa: E402

BASE_COSTS = {"published_cost": published_cost, "bench_cost": reference_cost}
#: every reference row at per-task overhead 0 and at SkipPipe's 0.13 s / 0.09 s (``+task``)
COSTS = {**BASE_COSTS, **{f"{k}+task": functools.partial(mk, task_s=SKIPPIPE_TASK_S) for k, mk in BASE_COSTS.items()}}
REF_KW = dict(n_stages=6, stage_sizes=[5, 3, 3, 3, 3, 3], skip_ratio=0.33, max_swaps=2, memory=3,
              mb_per_originator=6)
PAPER_TOKENS = {4096: (30.0, 15.6), 8192: (45.8, 25.8), 16384: (92.0, 55.7)}
#: (numerator, denominator, limit) per cost
TARGETS = {"published_cost": [("planner", "skippipe_published", 0.82), ("planner", "full_pipeline", 0.40),
                              ("planner_no_ca", "skippipe_published_no_ca", 1.0)],
           "bench_cost": [("planner", "skippipe_published", 0.96), ("planner", "full_pipeline", 0.40),
                          ("planner_no_ca", "skippipe_published_no_ca", 1.0)],
           "published_cost+task": [("planner", "skippipe_published", 0.82)],
           "bench_cost+task": [("planner", "skippipe_published", 0.97)]}


def reference(seed: int, random_seeds: int, full_model: bool, record: bool = False) -> dict:
    """Every method at both costs on the reference setup; the model flags say which model."""
    topo = geo12(20)
    out = {}
    for key, mk in COSTS.items():
        cmp = compare(topo, mk(), PlanConfig(**REF_KW, seed=seed), contention=full_model, dp_sync=full_model,
                      methods=METHODS + PUBLISHED_METHODS, random_seeds=random_seeds, record=record)
        out[key] = cmp
    return out


def print_reference(ref: dict, title: str) -> dict:
    times = {k: c.iteration_s() for k, c in ref.items()}
    print(f"\n== {title}")
    print(format_table(times))
    skp = published_times()
    print("SkipPipe's own simulator (published cost): " + ", ".join(f"{m} {v:.1f}" for m, v in skp.items()))
    for k, c in ref.items():
        rs = c.random_skip_s
        meta = c.info["planner_meta"]
        print(f"  {k}: random_skip over {len(rs)} seeds: mean {sum(rs) / len(rs):.1f}, "
              f"min {min(rs):.1f}, max {max(rs):.1f}; planner {c.planner_s:.2f} s wall / "
              f"{meta.get('planner_cpu_s', 0):.2f} s CPU")
    return times


def check_targets(times: dict) -> dict:
    """Ratios against the targets, printed, as a dict ``{name: {ratio, limit, met}}``."""
    out = {}
    print("\n== figures (simplified model)")
    for key, rows in TARGETS.items():
        for num, den, lim in rows:
            r = times[key][num] / times[key][den]
            name = f"{key}: {num} / {den}"
            out[name] = {"ratio": r, "limit": lim, "met": r <= lim}
            print(f"  {name:<58} {r:6.3f}  (<= {lim:.2f}: {'met' if r <= lim else 'NOT met'})")
        r = times[key]["planner"] / times[key]["skippipe_lanes"]
        print(f"  {key + ': planner / skippipe_lanes (27 micro-batches)':<58} {r:6.3f}")
        out[f"{key}: planner / skippipe_lanes"] = {"ratio": r}
    return out


def seed_sweep(n: int, times: dict) -> dict:
    """The planner on the reference setup with seeds 0..n-1 (simplified model), both costs."""
    out = {}
    print(f"\n== seed sweep: the planner with seeds 0..{n - 1}, simplified model")
    for key, mk in COSTS.items():
        runs = [compare(geo12(20), mk(), PlanConfig(**REF_KW, seed=sd), contention=False, dp_sync=False,
                        methods=("planner",)) for sd in range(n)]
        v = [c.iteration_s()["planner"] for c in runs]
        mean = sum(v) / n
        sk, fp = times[key]["skippipe_published"], times[key]["full_pipeline"]
        out[key] = {"planner": v, "mean": mean, "planner_s_max": max(c.planner_s for c in runs),
                    "mean_x_skippipe_published": mean / sk, "mean_x_full_pipeline": mean / fp,
                    "max_x_skippipe_published": max(v) / sk, "max_x_full_pipeline": max(v) / fp}
        lim = TARGETS[key][0][2]
        out[key]["limit_x_skippipe_published"] = lim
        out[key]["met"] = mean / sk <= lim
        print(f"  {key:<20} " + " ".join(f"{x:.1f}" for x in v) + f"  mean {mean:.1f} (x skippipe_published "
              f"{mean / sk:.3f}, <= {lim:.2f}: {'met' if mean / sk <= lim else 'NOT met'}; x full_pipeline "
              f"{mean / fp:.3f}); worst x {max(v) / sk:.3f} / {max(v) / fp:.3f}; "
              f"planner time max {out[key]['planner_s_max']:.2f} s wall")
    return out


def cross_models(n: int, times: dict) -> dict:
    """Plans made at one per-task overhead judged at the other (simplified model, seeds 0..n-1):
    x SkipPipe's published schedule judged at the same overhead as the plan."""
    out = {}
    topo = geo12(20)
    print(f"\n== plans judged under the other cost model (seeds 0..{n - 1}, simplified model)")
    for base in BASE_COSTS:
        for plan_key, judge_key in ((base, base + "+task"), (base + "+task", base)):
            judge = COSTS[judge_key]()
            v = [simulate(compare(topo, COSTS[plan_key](), PlanConfig(**REF_KW, seed=sd), contention=False,
                                  dp_sync=False, methods=("planner",)).schedules["planner"],
                          topo, judge, contention=False, dp_sync=False).iteration_s for sd in range(n)]
            r = sum(v) / n / times[judge_key]["skippipe_published"]
            out[f"planned {plan_key}, judged {judge_key}"] = {"planner": v, "mean_x_skippipe_published": r}
            print(f"  planned at {plan_key:<20} judged at {judge_key:<20} mean x skippipe_published {r:.3f}")
    return out


def compression(seed: int) -> dict:
    """Planner and full pipeline with int8 / int4 on slow links (simplified model), without
    encoding time and with the encode + decode time measured on this machine."""
    topo = geo12(20)
    out: dict = {}
    ref = reference_cost()
    rows = ref.samples * ref.tokens_per_sample
    codec_s = {c: measure_codec_s(c, rows, ref.d_model) for c in ("int8", "int4")}
    print("\n== activation compression on links slower than 1 GB/s (simplified model); encode + decode of "
          "one 32 MiB hop on this machine: " + ", ".join(f"{c} {v:.3f} s" for c, v in codec_s.items()))
    for key, mk in BASE_COSTS.items():
        out[key] = {}
        for codec, cs in (("fp32", 0.0), ("int8", 0.0), ("int8", codec_s["int8"]), ("int4", 0.0),
                          ("int4", codec_s["int4"])):
            cost = dataclasses.replace(mk(), act_codec=codec, act_codec_s=cs)
            cmp = compare(topo, cost, PlanConfig(**REF_KW, seed=seed), contention=False, dp_sync=False,
                          methods=("full_pipeline", "planner"))
            t = cmp.iteration_s()
            slow = cost.hop_bytes(topo, 0, 1)
            name = codec if codec == "fp32" else f"{codec}, codec {cs:.2f} s"
            out[key][name] = {**t, "act_codec_s": cs, "hop_bytes_slow_link": slow,
                              "planner_bytes_on_wire": cmp.results["planner"].bytes_pipeline}
            print(f"  {key:<15} {name:<20} full_pipeline {t['full_pipeline']:6.1f}  planner {t['planner']:6.1f}  "
                  f"x fp32 bytes/hop {cost.activation_bytes / slow:5.2f}  planner bytes "
                  f"{cmp.results['planner'].bytes_pipeline / 2 ** 30:6.2f} GiB")
        # the floor of any activation encoding: every hop's bytes free (latency and the per-hop
        # overhead stay), the planner re-planned for it
        free = Topology(topo.nodes, topo.latency_s, np.full((topo.n, topo.n), 1e30), name=f"{topo.name}-free-bytes")
        t = compare(free, mk(), PlanConfig(**REF_KW, seed=seed), contention=False, dp_sync=False,
                    methods=("full_pipeline", "planner")).iteration_s()
        fp = out[key]["fp32"]["planner"]
        out[key]["free_bytes"] = {**t, "planner_x_fp32": t["planner"] / fp}
        print(f"  {key:<15} {'bytes free (floor)':<20} full_pipeline {t['full_pipeline']:6.1f}  planner "
              f"{t['planner']:6.1f}  planner {t['planner'] / fp:.3f}x the fp32 planner (what this planner reaches with free bytes)")
    out["codec_s_measured"] = codec_s
    return out


def unequal_speeds(seed: int, n_topos: int = 5) -> list:
    """Planner vs. full pipeline on random topologies with unequal node speeds."""
    rows = []
    print(f"\n== unequal compute: {n_topos} random topologies, 20 nodes, 6 regions, speeds 0.5-2 (simplified model)")
    for key, mk in COSTS.items():
        for ts in range(n_topos):
            topo = random_topology(20, seed=ts, n_regions=6)
            cfg = PlanConfig(n_stages=6, skip_ratio=0.33, max_swaps=2, memory=3, mb_per_originator=6, seed=seed)
            t = compare(topo, mk(), cfg, contention=False, dp_sync=False,
                        methods=("full_pipeline", "planner_no_ca", "planner")).iteration_s()
            sp = [nd.speed for nd in topo.nodes]
            r = t["planner"] / t["full_pipeline"]
            rows.append({"cost": key, "topology": topo.name, "speeds": [min(sp), max(sp)], **t, "ratio": r})
            print(f"  {key:<15} {topo.name:<10} speeds {min(sp):.2f}-{max(sp):.2f}  full_pipeline "
                  f"{t['full_pipeline']:6.1f}  planner_no_ca {t['planner_no_ca']:6.1f}  planner {t['planner']:6.1f}"
                  f"  planner/full {r:.3f} (<= 0.65: {'met' if r <= 0.65 else 'NOT met'})")
    return rows


def sweeps(seed: int) -> dict:
    """64 nodes and the 18-node tokens sweep (bench cost family), simplified and full model."""
    out: dict = {}
    cost64 = CostModel(d_model=1024, tokens_per_sample=1024, samples=8, layers_per_stage=[3] * 8,
                       s_per_sample_per_layer=0.055, hop_overhead_s=0.35)
    kw64 = dict(n_stages=8, skip_ratio=0.33, max_swaps=2, memory=3, mb_per_originator=6, seed=seed)
    r64 = {m: compare(geo12(64), cost64, PlanConfig(**kw64), contention=f, dp_sync=f)
           for m, f in (("simplified", False), ("full", True))}
    print(f"\n== 64 nodes over geo12, 8 stages x 3 layers (sizes {r64['full'].info['stage_sizes']}), "
          f"{r64['full'].info['micro_batches']} micro-batches of 8x1024 tokens, k=33%, m=3")
    print(format_table({m: r.iteration_s() for m, r in r64.items()}))
    print("  planner time: " + ", ".join(f"{m} {r.planner_s:.2f} s wall / "
                                         f"{r.info['planner_meta'].get('planner_cpu_s', 0):.2f} s CPU"
                                         for m, r in r64.items()) + " (limit 60 s)")
    out["nodes64"] = {m: r.iteration_s() for m, r in r64.items()}
    out["nodes64"]["planner_s"] = {m: r.planner_s for m, r in r64.items()}
    tok = {}
    print("\n== 18 nodes over geo12, k=25%, m=3, 6 micro-batches per stage-0 node; tokens per micro-batch")
    print(f"{'tokens':<8}{'model':<12}{'full_pipe':>11}{'random':>9}{'swarm_skip':>11}{'planner':>9}{'pl/full':>9}"
          f"{'paper':>14}")
    for tokens in (4096, 8192, 16384):
        kw18 = dict(n_stages=6, skip_ratio=0.25, max_swaps=2, memory=3, mb_per_originator=6, seed=seed)
        tok[tokens] = {}
        for model, f in (("simplified", False), ("full", True)):
            d = compare(geo12(18), reference_cost(tokens), PlanConfig(**kw18), contention=f, dp_sync=f,
                        methods=("full_pipeline", "random_skip", "swarm_skip", "planner")).iteration_s()
            tok[tokens][model] = d
            pf, ps = PAPER_TOKENS[tokens]
            paper = f"{pf}->{ps}" if model == "simplified" else ""
            print(f"{tokens // 1024}k{'':<6}{model:<12}{d['full_pipeline']:>11.1f}{d['random_skip']:>9.1f}"
                  f"{d['swarm_skip']:>11.1f}{d['planner']:>9.1f}{d['planner'] / d['full_pipeline']:>9.3f}{paper:>14}")
    out["tokens18"] = {str(k): v for k, v in tok.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="reference setup, simplified model, both costs only")
    ap.add_argument("--gantt", default=None, help="PNG of the planner's timeline (bench cost, full model)")
    ap.add_argument("--seed", type=int, default=0, help="planner seed")
    ap.add_argument("--random-seeds", type=int, default=10, help="seeds of the random skip baseline")
    ap.add_argument("--seed-sweep", type=int, default=0, metavar="N",
                    help="also plan the reference setup with seeds 0..N-1 (simplified model, both costs): "
                         "the search is a local search, results vary by seed")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    print(f"machine: {platform.machine()} {platform.python_version()}, one process")
    ref = reference(args.seed, args.random_seeds, full_model=False)
    times = print_reference(ref, "reference setup: geo12, 20 nodes, 5/3/3/3/3/3, m=3, k=33%, simplified model "
                                 "(no contention, no DP sync)")
    out = {**times, "random_skip_by_seed": {k: c.random_skip_s for k, c in ref.items()},
           "planner_s": max(c.planner_s for c in ref.values()),
           "planner_cpu_s": max(c.info["planner_meta"].get("planner_cpu_s", 0.0) for c in ref.values()),
           "skippipe_own_simulator_published_cost": published_times()}
    out["targets"] = check_targets(times)
    lim = out["planner_s"] <= 10.0
    print(f"  planner time, 20 nodes: {out['planner_s']:.2f} s wall / {out['planner_cpu_s']:.2f} s CPU "
          f"(<= 10 s: {'met' if lim else 'NOT met'})")
    out["targets"]["planner_s"] = {"seconds": out["planner_s"], "limit": 10.0, "met": lim}
    if args.seed_sweep:
        out["seed_sweep"] = seed_sweep(args.seed_sweep, times)
        out["cross_models"] = cross_models(args.seed_sweep, times)
    if not args.quick:
        full = reference(args.seed, args.random_seeds, full_model=True, record=args.gantt is not None)
        out["full_model"] = print_reference(full, "reference setup, full model (link contention + dense DP sync)")
        out["compression"] = compression(args.seed)
        out["unequal_speeds"] = unequal_speeds(args.seed)
        out["targets"]["unequal_speeds"] = {"max_ratio": max(r["ratio"] for r in out["unequal_speeds"]),
                                            "limit": 0.65,
                                            "met": all(r["ratio"] <= 0.65 for r in out["unequal_speeds"])}
        out["sweeps"] = sweeps(args.seed)
        if args.gantt:
            res = full["bench_cost"].results["planner"]
            pl = full["bench_cost"].schedules["planner"].placement
            topo = geo12(20)
            labels = {n: f"{n} {topo.nodes[n].location} s{s}" for s, p in enumerate(pl) for n in p}
            draw_gantt(res.timeline, args.gantt, node_labels=labels,
                       title=f"planner, geo12 20 nodes, bench cost, full model: {res.iteration_s:.1f} s/iteration")
            print(f"wrote {args.gantt}")
    out["bench_s"] = time.perf_counter() - t_all
    print(f"\nbench time {out['bench_s']:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
