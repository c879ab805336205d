"""Bench: the planner from 64 to 4,096 nodes: planning time against ``--time-limit``, the plan
against the full pipeline, and re-planning after 5% of the nodes fail.

Per topology (``cluster``, and ``geo12`` scaled: its 12 locations repeated) and node count: the
planner with the time limit of that size (60 s up to 1,024 nodes, 150 s at 2,048, 300 s at
4,096; CPU seconds of this process, every phase included), the full pipeline on the same global
batch, both simulated with ``skiptrain simulate``'s default model and cost (link contention,
dense DP sync, 6 stages x 4 layers, 8 x 1024 tokens per micro-batch, 0.35 s per hop, the
default per-task overhead), k=33%, m=3, 6 micro-batches per stage-0 node.  Then 5% of the nodes
(a seeded draw) fail: the planner re-plans from the plan in force with the same limit
(:func:`~skiptrain.schedule.planner.replan`) and, for comparison, plans the survivors
afresh; both simulated on the survivors.

Columns (``--json`` rows carry the same keys): ``planner_s`` wall-clock and ``planner_cpu_s``;
``ratio_vs_full`` planner / full pipeline (full model) and ``ratio_vs_full_no_sync`` the same
without the DP sync (the pipelines alone); ``replan_s`` (wall) / ``replan_cpu_s``;
``replan_ratio_vs_fresh`` the re-plan's iteration / the fresh plan's; ``search_evaluations``
(simulations of cells, summed).  ``--quick``: 64, 256 and 1,024 nodes, the same code path.
``--plot PATH``: planning time and plan quality against node count, log-log; ``--merge JSON``
puts an earlier run's rows in the table and the plot (a long sweep run in parts).

    .venv/bin/python bench/schedule_scale.py --json runs/bench/schedule_scale.json --plot docs/img/schedule_scale.png
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.net.topology import load_topology  # noqa: E402
from skiptrain.schedule.baselines import full_pipeline  # noqa: E402
from skiptrain.schedule.cost import DEFAULT_TASK_S, reference_cost  # noqa: E402
from skiptrain.schedule.placement import stage_sizes  # noqa: E402
from skiptrain.schedule.planner import PlanConfig, plan, replan  # noqa: E402
from skiptrain.schedule.schedule import SKIP_CLAIMS  # noqa: E402
from skiptrain.schedule.simulator import simulate  # noqa: E402

SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SIZES = (64, 256, 1024)
FAIL_SHARE = 0.05
KW = dict(n_stages=6, skip_ratio=0.33, max_swaps=2, memory=3, mb_per_originator=6, seed=0)


def limit_for(n: int) -> float:
    """The time limit of the targets: 60 s up to 1,024 nodes, 150 s at 2,048, 300 s at 4,096."""
    return 60.0 if n <= 1024 else 150.0 if n <= 2048 else 300.0


def timed_plan(fn, *args):
    """``fn(*args)`` with its wall-clock and CPU seconds."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - w, time.process_time() - c


def both_models(sched, topo, cost) -> tuple[float, float]:
    """Iteration seconds with the full model and without the DP sync."""
    return (simulate(sched, topo, cost, record=False).iteration_s,
            simulate(sched, topo, cost, dp_sync=False, record=False).iteration_s)


def row(name: str, n: int, cost, with_replan: bool = True) -> dict:
    topo = load_topology(name, n)
    limit = limit_for(n)
    sched, wall, cpu = timed_plan(plan, topo, cost, PlanConfig(**KW, time_limit_s=limit))
    sched.validate(SKIP_CLAIMS, n_nodes=n)
    meta = sched.meta["planner"]
    full = full_pipeline(topo, cost, stage_sizes(n, 6, 0.0, cost), len(sched.micro_batches), 3)
    p, p_ns = both_models(sched, topo, cost)
    f, f_ns = both_models(full, topo, cost)
    out = {"topology": name, "nodes": n, "limit_s": limit, "planner_s": wall, "planner_cpu_s": cpu,
           "iteration_s": p, "full_pipeline_s": f, "ratio_vs_full": p / f, "ratio_vs_full_no_sync": p_ns / f_ns,
           "search_evaluations": meta.get("evals", 0), "cells": meta.get("n_cells", 1),
           "distinct_cells": meta.get("distinct_cells", 1), "micro_batches": len(sched.micro_batches)}
    if not with_replan:
        return out
    rng = random.Random(n)
    alive = sorted(rng.sample(range(n), n - round(FAIL_SHARE * n)))
    re, rwall, rcpu = timed_plan(replan, topo, cost, PlanConfig(**KW, time_limit_s=limit), sched, alive)
    re.validate(SKIP_CLAIMS, n_nodes=n)
    sub = topo.subset(alive)
    fresh, fwall, fcpu = timed_plan(plan, sub, cost, PlanConfig(**KW, time_limit_s=limit))
    r_it = simulate(re, topo, cost, record=False).iteration_s
    f_it = simulate(fresh, sub, cost, record=False).iteration_s
    out.update({"replan_s": rwall, "replan_cpu_s": rcpu, "replan_iteration_s": r_it, "fresh_iteration_s": f_it,
                "fresh_s": fwall, "replan_ratio_vs_fresh": r_it / f_it,
                "replanned_cells": re.meta["planner"]["replanned_cells"],
                "replan_micro_batches": len(re.micro_batches), "fresh_micro_batches": len(fresh.micro_batches)})
    return out


def print_row(r: dict) -> None:
    rep = (f"{r['replan_s']:>9.1f}{r['replan_cpu_s']:>9.1f}{r['replan_ratio_vs_fresh']:>10.3f}"
           if "replan_s" in r else f"{'-':>9}{'-':>9}{'-':>10}")
    print(f"{r['topology']:<9}{r['nodes']:>6}{r['limit_s']:>7.0f}{r['planner_s']:>9.1f}{r['planner_cpu_s']:>9.1f}"
          f"{r['iteration_s']:>9.1f}{r['full_pipeline_s']:>9.1f}{r['ratio_vs_full']:>8.3f}"
          f"{r['ratio_vs_full_no_sync']:>9.3f}{rep}{r['search_evaluations']:>9}{r['cells']:>6}{r['distinct_cells']:>6}",
          flush=True)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in sorted({r["topology"] for r in rows}):
        rs = [r for r in rows if r["topology"] == name]
        n = [r["nodes"] for r in rs]
        a.plot(n, [r["planner_s"] for r in rs], "o-", label=f"{name}: planning (wall)")
        a.plot(n, [r["limit_s"] for r in rs], "k:", label=None)
        b.plot(n, [r["ratio_vs_full"] for r in rs], "o-", label=f"{name}: x full pipeline")
        b.plot(n, [r["ratio_vs_full_no_sync"] for r in rs], "s--", label=f"{name}: x full, no DP sync")
    for ax, title in ((a, "planning seconds (dotted: time limit)"), (b, "planner / full pipeline")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes")
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG: planning time and plan quality against nodes, log-log")
    ap.add_argument("--quick", action="store_true", help="64, 256 and 1,024 nodes")
    ap.add_argument("--sizes", default=None, help="comma-separated node counts (default: 64 to 4,096)")
    ap.add_argument("--topologies", default="cluster,geo12")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="rows of an earlier run's --json put first in the table and the plot (not measured again)")
    ap.add_argument("--replan-max-nodes", type=int, default=4096, help="re-plan (and plan afresh) up to this size")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x] if args.sizes is not None else (QUICK_SIZES if args.quick else SIZES)
    cost = reference_cost(task_s=DEFAULT_TASK_S)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}, one process; per-task overhead "
          f"{cost.fwd_task_s:.3f} / {cost.bwd_task_s:.3f} s")
    print(f"{'topology':<9}{'nodes':>6}{'limit':>7}{'plan s':>9}{'cpu s':>9}{'iter s':>9}{'full s':>9}{'x full':>8}"
          f"{'no sync':>9}{'replan s':>9}{'cpu s':>9}{'x fresh':>10}{'evals':>9}{'cells':>6}{'dist':>6}")
    rows = [r for path in args.merge for r in json.loads(Path(path).read_text())["rows"]]
    for r in rows:
        print_row(r)
    for n in sizes:
        for name in args.topologies.split(","):
            rows.append(row(name, n, cost, with_replan=n <= args.replan_max_nodes))
            print_row(rows[-1])
            if args.json:           # written after every row: a long run keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"rows": rows, "task_s": [cost.fwd_task_s, cost.bwd_task_s]},
                                                      indent=1))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
