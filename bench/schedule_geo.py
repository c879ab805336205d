"""Bench: SkipPipe's scheduling experiment, planner vs. every baseline, in one run.

Reference setup (skippipe_reference.json): 20 nodes over geo12 in the reference order, 6 stages
sized 5/3/3/3/3/3, m=3, 6 micro-batches of 8x1024 tokens per stage-0 node, d=1024 fp32,
4 layers per stage, 0.055 s per sample per layer, hop overhead 0.35 s, k=33%, <=2 swaps.
Simulated twice: the reference's simplified model (no link contention, no DP sync) and the
full model (per-link FIFO contention + dense ring all-reduce per stage).  ``--seed-sweep N``
re-plans the reference setup (simplified) with seeds 0..N-1 and reports the spread.  Then,
unless ``--quick``: 64 nodes (8 stages, sizes by work) and the 18-node, k=25% sweep over
4k/8k/16k tokens per micro-batch.  Planner times are printed as wall-clock and CPU seconds
(the limits are for one core; on a shared machine wall-clock includes other jobs).  Prints tables; ``--json PATH`` writes
``{"simplified": {method: iteration_s}, "full": {...}, "planner_s": ..., "sweeps": {...}}``;
``--gantt PATH`` the planner's Gantt chart for the reference setup (full model).

    .venv/bin/python bench/schedule_geo.py --json runs/bench/schedule_geo.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.net.topology import geo12  # noqa: E402
from skiptrain.schedule.compare import compare, format_table  # noqa: E402
from skiptrain.schedule.cost import CostModel, reference_cost  # noqa: E402
from skiptrain.schedule.gantt import draw_gantt  # noqa: E402
from skiptrain.schedule.planner import PlanConfig  # noqa: E402

REFERENCE = {"full_pipeline": 79.94, "random_skip": 48.92, "planner_no_ca": 35.43, "planner": 33.31}
PAPER_TOKENS = {4096: (30.0, 15.6), 8192: (45.8, 25.8), 16384: (92.0, 55.7)}


def run_pair(topo, cost, cfg_kw, record=False):
    out = {}
    for name, flag in (("simplified", False), ("full", True)):
        cmp = compare(topo, cost, PlanConfig(**cfg_kw), contention=flag, dp_sync=flag, record=record and flag)
        out[name] = cmp
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="reference setup only (about a minute)")
    ap.add_argument("--gantt", default=None, help="PNG of the planner's timeline (reference setup, full model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seed-sweep", type=int, default=0, metavar="N",
                    help="also plan the reference setup (simplified model) with seeds 0..N-1 and report "
                         "the spread of planner/full_pipeline (the search is a local search: results vary by seed)")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    print(f"machine: {platform.machine()} {platform.python_version()}, one process")

    # ---- reference setup
    topo = geo12(20)
    cost = reference_cost(8 * 1024)
    kw = dict(n_stages=6, stage_sizes=[5, 3, 3, 3, 3, 3], skip_ratio=0.33, max_swaps=2, memory=3,
              mb_per_originator=6, seed=args.seed)
    ref = run_pair(topo, cost, kw, record=args.gantt is not None)
    simp, full = ref["simplified"].iteration_s(), ref["full"].iteration_s()
    print("\n== reference setup: geo12, 20 nodes, 5/3/3/3/3/3, m=3, 30 micro-batches of 8x1024 tokens, k=33%")
    print(format_table({"simplified_s": simp, "full_s": full}))
    print(f"{'reference (paper sim)':<22}" + "".join(f"  {m}={v}" for m, v in REFERENCE.items()))
    r = {"planner/full_pipeline (simplified)": simp["planner"] / simp["full_pipeline"],
         "planner/random_skip (simplified)": simp["planner"] / simp["random_skip"],
         "planner/full_pipeline (full)": full["planner"] / full["full_pipeline"],
         "planner/random_skip (full)": full["planner"] / full["random_skip"],
         "reference skippipe/full": REFERENCE["planner"] / REFERENCE["full_pipeline"],
         "reference skippipe/random": REFERENCE["planner"] / REFERENCE["random_skip"]}
    for k, v in r.items():
        print(f"  {k:<40} {v:.3f}")
    planner_s = {"simplified": ref["simplified"].planner_s, "full": ref["full"].planner_s}
    planner_cpu = {m: ref[m].info["planner_meta"].get("planner_cpu_s") for m in ("simplified", "full")}
    print(f"  planner time (20 nodes): simplified {planner_s['simplified']:.2f} s wall / "
          f"{planner_cpu['simplified']:.2f} s CPU, full {planner_s['full']:.2f} s wall / {planner_cpu['full']:.2f} s CPU"
          f" (limit 10 s on one core)")
    full_sync = {m: res.sync_s for m, res in ref["full"].results.items()}
    out = {"simplified": simp, "full": full, "planner_s": max(planner_s.values()),
           "planner_s_by_model": planner_s, "planner_cpu_s_by_model": planner_cpu,
           "planner_meta": {m: ref[m].info["planner_meta"] for m in ("simplified", "full")},
           "ratios": r, "reference_paper_s": REFERENCE,
           "bytes_on_wire_full": {m: res.bytes_on_wire for m, res in ref["full"].results.items()},
           "pipeline_s_full": {m: res.pipeline_s for m, res in ref["full"].results.items()},
           "sync_span_full_planner": full_sync["planner"], "sweeps": {}}
    if args.gantt:
        res = ref["full"].results["planner"]
        labels = {n: f"{n} {topo.nodes[n].location} s{s}"
                  for s, p in enumerate(ref["full"].schedules["planner"].placement) for n in p}
        draw_gantt(res.timeline, args.gantt, node_labels=labels,
                   title=f"planner, geo12 20 nodes, full model: {res.iteration_s:.1f} s/iteration")
        print(f"wrote {args.gantt}")

    if args.seed_sweep:
        # ---- the same reference problem planned with other seeds (simplified model)
        sweep = {}
        full_pipe = simp["full_pipeline"]
        for sd in range(args.seed_sweep):
            c = compare(topo, cost, PlanConfig(**{**kw, "seed": sd}), contention=False, dp_sync=False,
                        methods=("planner",))
            sweep[sd] = {"planner": c.iteration_s()["planner"], "planner_s": c.planner_s,
                         "planner_cpu_s": c.info["planner_meta"].get("planner_cpu_s")}
        ratios = sorted(v["planner"] / full_pipe for v in sweep.values())
        met = sum(x <= 0.42 for x in ratios)
        print(f"\n== seed sweep, reference setup, simplified model, seeds 0..{args.seed_sweep - 1} "
              f"(full pipeline {full_pipe:.1f} s)")
        print("  planner s: " + " ".join(f"{sweep[sd]['planner']:.1f}" for sd in sorted(sweep)))
        print(f"  planner/full_pipeline: min {ratios[0]:.3f}, median {ratios[len(ratios) // 2]:.3f}, "
              f"mean {sum(ratios) / len(ratios):.3f}, max {ratios[-1]:.3f}; <= 0.42 for {met} of {len(ratios)} seeds")
        print(f"  planner time: max {max(v['planner_s'] for v in sweep.values()):.2f} s wall, "
              f"{max(v['planner_cpu_s'] for v in sweep.values()):.2f} s CPU")
        out["seed_sweep"] = {"full_pipeline": full_pipe, "by_seed": sweep,
                             "ratio_min": ratios[0], "ratio_mean": sum(ratios) / len(ratios),
                             "ratio_max": ratios[-1], "met": met}

    if not args.quick:
        # ---- 64 nodes
        topo64 = geo12(64)
        cost64 = CostModel(d_model=1024, tokens_per_sample=1024, samples=8, layers_per_stage=[3] * 8,
                           s_per_sample_per_layer=0.055, hop_overhead_s=0.35)
        kw64 = dict(n_stages=8, skip_ratio=0.33, max_swaps=2, memory=3, mb_per_originator=6, seed=args.seed)
        r64 = run_pair(topo64, cost64, kw64)
        print(f"\n== 64 nodes over geo12, 8 stages x 3 layers (sizes {r64['full'].info['stage_sizes']}), "
              f"{r64['full'].info['micro_batches']} micro-batches of 8x1024 tokens, k=33%, m=3")
        print(format_table({"simplified_s": r64["simplified"].iteration_s(), "full_s": r64["full"].iteration_s()}))
        p64 = {"simplified": r64["simplified"].planner_s, "full": r64["full"].planner_s}
        c64 = {m: r64[m].info["planner_meta"].get("planner_cpu_s") for m in ("simplified", "full")}
        print(f"  planner time (64 nodes): simplified {p64['simplified']:.2f} s wall / {c64['simplified']:.2f} s CPU, "
              f"full {p64['full']:.2f} s wall / {c64['full']:.2f} s CPU (limit 60 s on one core)")
        out["sweeps"]["nodes64"] = {"simplified": r64["simplified"].iteration_s(), "full": r64["full"].iteration_s(),
                                    "planner_s": p64, "planner_cpu_s": c64,
                                    "stage_sizes": r64["full"].info["stage_sizes"]}
        # ---- tokens per micro-batch, 18 nodes, k=25%
        topo18 = geo12(18)
        rows_s, rows_f, tok = {}, {}, {}
        for tokens in (4096, 8192, 16384):
            c = reference_cost(tokens)
            kw18 = dict(n_stages=6, skip_ratio=0.25, max_swaps=2, memory=3, mb_per_originator=6, seed=args.seed)
            rr = run_pair(topo18, c, kw18)
            s_, f_ = rr["simplified"].iteration_s(), rr["full"].iteration_s()
            tok[tokens] = {"simplified": s_, "full": f_, "planner_s": rr["full"].planner_s,
                           "planner_cpu_s": rr["full"].info["planner_meta"].get("planner_cpu_s"),
                           "stage_sizes": rr["full"].info["stage_sizes"], "paper_full_vs_skippipe": PAPER_TOKENS[tokens]}
            rows_s[f"{tokens // 1024}k"] = s_
            rows_f[f"{tokens // 1024}k"] = f_
        print(f"\n== 18 nodes over geo12, 6 stages (sizes {tok[4096]['stage_sizes']}), k=25%, m=3, 6 micro-batches "
              "per stage-0 node; tokens per micro-batch sweep")
        head = f"{'tokens':<8}{'model':<12}{'full_pipe':>11}{'random':>9}{'swarm_skip':>11}{'planner':>9}{'pl/full':>9}{'paper':>14}"
        print(head)
        print("-" * len(head))
        for tokens in (4096, 8192, 16384):
            for model in ("simplified", "full"):
                d = tok[tokens][model]
                pf, ps = PAPER_TOKENS[tokens]
                paper = f"{pf}->{ps}" if model == "simplified" else ""
                print(f"{tokens // 1024}k{'':<6}{model:<12}{d['full_pipeline']:>11.1f}{d['random_skip']:>9.1f}"
                      f"{d['swarm_skip']:>11.1f}{d['planner']:>9.1f}{d['planner'] / d['full_pipeline']:>9.3f}{paper:>14}")
        out["sweeps"]["tokens18"] = {str(k): v for k, v in tok.items()}
    out["bench_s"] = time.perf_counter() - t_all
    print(f"\nbench time {out['bench_s']:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
