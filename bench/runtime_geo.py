"""Bench: the multi-process runtime on emulated geo12 links, full pipeline vs. random skipping
vs. the planner, measured side by side in one run, each next to the simulator's prediction.

Setup (defaults): 16 node processes on this machine (one per geo12 node, reference order),
the tiny model cut into 6 stages of one layer (d=64, 64 tokens, 8 samples per micro-batch:
128 KiB of activations per hop), m=3, 6 micro-batches per stage-0 node, k=33% (3 of 5 body
stages), <= 2 swaps.  Emulation (skiptrain.runtime.wan), all in SkipPipe's units scaled by
``--time-scale`` (1/16): every directed link is a FIFO with geo12's latency and bandwidth,
``bytes_scale=256`` turns each 128 KiB hop into SkipPipe's 32 MiB, 0.35 s overhead per hop;
every forward is padded to 4 layers x 8 samples x 0.055 s (1.76 s; backward 1.5x, loss 0.25x).
The simulator gets exactly these numbers (same cost model, same time-scaled topology, link
contention on).  The data-parallel sync is a real gloo all-reduce of the tiny model's
gradients, not link-emulated, and the simulator is run without DP sync.

A fourth phase, ``planner_int8``, is the planner's schedule planned and run with the hops of
links slower than 1 GB/s (in geo12's own units) encoded as int8 with one scale per row
(activations forward, their gradients backward; ``runtime.act_codec``): the iteration it takes
next to the uncompressed planner's, and beside it the floor of any encoding (the planner
re-planned with every hop's bytes free, simulated).

The per-task overhead (start, header, dispatch: what the runtime pays per task on top of the
padded compute) is fitted to the measured micro-batch finishes of the full pipeline, random skip
and planner phases (:func:`skiptrain.schedule.fit.fit_task_overhead`) and printed, in real
seconds and in SkipPipe's units (divided by the time scale, as compute is scaled); the table
sets each measured iteration beside the simulation with the fitted overhead too.

The schedules run as phases of one launch (same processes; each phase restarts
from the same initial weights and data).  Prints a table; ``--json PATH`` writes
``{"methods": {method: {"measured_s": ..., "simulated_s": ...}}, ...}``; ``--gantt PATH`` the
planner's simulated and measured timelines; ``--quick``: 8 nodes, 3 micro-batches per
originator, time scale 1/40, one iteration per method (a reduced check of the machinery).

    .venv/bin/python bench/runtime_geo.py --json runs/bench/runtime_geo.json --gantt docs/img/runtime_geo_planner.png
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.corpus import read_documents  # noqa: E402
from skiptrain.data.dataset import write_dataset  # noqa: E402
from skiptrain.runtime.job import Job, build_cost, build_schedule, build_topology, phase_for, with_runtime  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402
from skiptrain.schedule.fit import done_times, fit_task_overhead  # noqa: E402
from skiptrain.schedule.gantt import draw_side_by_side  # noqa: E402
from skiptrain.schedule.simulator import simulate  # noqa: E402

METHODS = ("full_pipeline", "random_skip", "planner", "planner_int8")
PAPER_S_PER_SAMPLE_LAYER = 0.055 * 4   # SkipPipe: 4 layers x 0.055 s per stage; here 1 layer per stage


def make_data(path: Path) -> Path:
    t = ROOT / "tests" / "data"
    if not (path / "manifest.json").is_file():
        write_dataset(path, read_documents([str(t / "hamlet_excerpt.txt"), str(t / "macbeth_excerpt.txt")]),
                      None, tokenizer="byte", val_fraction=0.1, source="bench excerpts")
    return path


def compression_floor(cfg, topo, cost) -> float:
    """The planner's simulated iteration with every hop's bytes free (infinite bandwidth, no codec
    time; latency and the per-hop overhead stay), re-planned for it: what an encoding could reach
    at best under this planner (a floor of the planner's search, not a proof for any planner)."""
    import numpy as np

    from skiptrain.net.topology import Topology

    free = Topology(topo.nodes, topo.latency_s, np.full((topo.n, topo.n), 1e30), name=f"{topo.name}-free-bytes")
    sched = build_schedule(cfg, "planner", free, cost, contention=True, dp_sync=False)
    return simulate(sched, free, cost, contention=True, dp_sync=False).iteration_s


def fit_overhead(runs, scheds, costs, topo, tau: float):
    """The per-task overhead fitted to the measured finishes (schedule/fit.py), printed; with
    every method simulated again under it."""
    cost = costs["planner"]
    f_s, b_s, rms = fit_task_overhead(runs, topo, cost, limit_s=0.5 * cost.fwd_compute_s(1))
    fitted = {m: simulate(scheds[m], topo, costs[m].with_task_s(f_s, b_s), contention=True, dp_sync=False).iteration_s
              for m in METHODS}
    print(f"\nper-task overhead fitted to the measured finishes: forward {1e3 * f_s:.1f} ms, backward "
          f"{1e3 * b_s:.1f} ms (rms {1e3 * rms:.0f} ms per micro-batch); in SkipPipe's units (/ time scale "
          f"{tau:g}): {f_s / tau:.3f} s / {b_s / tau:.3f} s; the cost model charged {1e3 * cost.fwd_task_s:.1f} / "
          f"{1e3 * cost.bwd_task_s:.1f} ms", flush=True)
    return f_s, b_s, rms, fitted


def table(measured, sims, fitted, scheds, overruns, losses) -> dict:
    """Measured against simulated per method, printed; the JSON's ``methods``."""
    head = (f"{'method':<15}{'measured s':>12}{'simulated s':>13}{'meas/sim':>10}{'sim fitted':>12}{'meas/fit':>10}"
            f"{'x full (meas)':>15}{'x full (sim)':>14}{'overruns':>10}")
    print("\n" + head + "\n" + "-" * len(head))
    fm = statistics.median(measured["full_pipeline"])
    fs = sims["full_pipeline"].iteration_s
    out = {}
    for m in METHODS:
        ms = statistics.median(measured[m])
        ss = sims[m].iteration_s
        out[m] = {"measured_s": round(ms, 4), "simulated_s": round(ss, 4), "measured_iterations_s": measured[m],
                  "losses": losses[m], "overruns": overruns[m], "stage_sizes": [len(p) for p in scheds[m].placement],
                  "simulated_fitted_s": round(fitted[m], 4), "micro_batches": len(scheds[m].micro_batches)}
        print(f"{m:<15}{ms:>12.3f}{ss:>13.3f}{ms / ss:>10.3f}{fitted[m]:>12.3f}{ms / fitted[m]:>10.3f}{ms / fm:>15.3f}"
              f"{ss / fs:>14.3f}{overruns[m]:>10}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gantt", default=None, help="PNG: the planner's simulated vs measured timeline")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=None, help="iterations per method")
    ap.add_argument("--time-scale", type=float, default=None)
    ap.add_argument("--mb-per-originator", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="keep the run directory (timelines, logs) here")
    args = ap.parse_args(argv)
    nodes = args.nodes or (8 if args.quick else 16)
    iters = args.iterations or (1 if args.quick else 2)
    tau = args.time_scale or (1 / 40 if args.quick else 1 / 16)
    mpo = args.mb_per_originator or (3 if args.quick else 6)
    t_all = time.time()
    print(f"machine: {platform.machine()}, Python {platform.python_version()}, {nodes} node processes "
          f"(one torch thread each)", flush=True)
    cfg = build_config("tiny", overrides={
        "model": {"n_stages": 6, "n_layers": 6, "stage0_layers": 1},
        "train": {"skip_ratio": 0.33, "max_swaps": 2, "micro_batch": 8, "seed": 1234, "grad_clip": 1.0},
        "runtime": {"nodes": nodes, "topology": "geo12", "wan": True, "emulate_compute": True,
                    "time_scale": tau, "bytes_scale": 256, "hop_overhead_s": 0.35 * tau,
                    "s_per_sample_layer": PAPER_S_PER_SAMPLE_LAYER * tau, "memory": 3,
                    "mb_per_originator": mpo, "plan_seed": args.seed, "timeout_s": 60.0}})
    topo = build_topology(cfg, nodes)
    cost = build_cost(cfg, dp_mode="none")
    hops = [cost.hop_s(topo, a, b) for a in range(nodes) for b in range(nodes) if a != b]
    print(f"emulation: time scale {tau:g}, {cost.activation_bytes / 2**20:.0f} MiB per hop (emulated), "
          f"forward {cost.fwd_s(1):.3f} s per stage, median hop {statistics.median(hops):.3f} s "
          f"({statistics.median(hops) / cost.fwd_s(1):.2f}x forward)", flush=True)
    t0 = time.time()
    scheds = {"planner": build_schedule(cfg, "planner", topo, cost, contention=True, dp_sync=False)}
    planner_s = time.time() - t0
    scheds["random_skip"] = build_schedule(cfg, "random_skip", topo, cost, placement=scheds["planner"].placement)
    scheds["full_pipeline"] = build_schedule(cfg, "full_pipeline", topo, cost, contention=True, dp_sync=False)
    cfg_q = build_config("tiny", overrides={**cfg.to_dict(), "runtime": {**cfg.to_dict()["runtime"],
                                            "act_codec": "int8", "act_fast_GBps": 1.0 / tau}})
    costs = {m: cost for m in METHODS}
    costs["planner_int8"] = build_cost(cfg_q, dp_mode="none")
    scheds["planner_int8"] = build_schedule(cfg_q, "planner", topo, costs["planner_int8"], contention=True,
                                            dp_sync=False)
    sims = {m: simulate(scheds[m], topo, costs[m], contention=True, dp_sync=False) for m in METHODS}
    floor = compression_floor(cfg, topo, cost) / sims["planner"].iteration_s
    for m in METHODS:
        s = scheds[m]
        print(f"  {m:<14} stages {[len(p) for p in s.placement]}, {len(s.micro_batches)} micro-batches, "
              f"simulated {sims[m].iteration_s:.2f} s", flush=True)
    print(f"planner: {planner_s:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="skiptrain-runtime-geo-") as tmp:
        data = make_data(Path(tmp) / "data")
        job = Job(config=with_runtime(cfg.to_dict(), timeout_s=cfg.runtime.timeout_s, heartbeat_s=0.5),
                  data_path=str(data), run_dir=args.keep or str(Path(tmp) / "run"),
                  phases=[phase_for(cfg, scheds[m], topo, costs[m], m, iters) for m in METHODS])
        res = launch(job, timeout_s=1800)
        measured = {m: [r["iteration_s"] for r in res.phase_iterations(m)] for m in METHODS}
        overruns = {m: max(r["overruns"] for r in res.phase_iterations(m)) for m in METHODS}  # cumulative per phase
        losses = {m: [r["loss"] for r in res.phase_iterations(m)] for m in METHODS}
        timeline = res.timeline("planner", iters - 1)
        runs = [(scheds[m], done_times(res.timeline(m, i))) for m in METHODS[:3] for i in range(iters)]
        if args.gantt:
            Path(args.gantt).parent.mkdir(parents=True, exist_ok=True)
            draw_side_by_side(sims["planner"].timeline, timeline, args.gantt,
                              titles=(f"simulated planner schedule: {sims['planner'].iteration_s:.2f} s",
                                      f"measured, {nodes} processes, emulated geo12: "
                                      f"{measured['planner'][-1]:.2f} s"), dpi=70)
    f_s, b_s, rms, fitted = fit_overhead(runs, scheds, costs, topo, tau)
    out = {"methods": {}, "nodes": nodes, "task_s_fitted": [f_s, b_s], "task_s_fit_rms": rms,
           "task_s_paper_units": [f_s / tau, b_s / tau], "iterations": iters, "time_scale": tau, "bytes_scale": 256,
           "mb_per_originator": mpo, "launch_s": round(res.wall_s, 1), "planner_s": round(planner_s, 2)}
    out["methods"] = table(measured, sims, fitted, scheds, overruns, losses)
    p, f, r = (out["methods"][m]["measured_s"] for m in ("planner", "full_pipeline", "random_skip"))
    out["planner_speedup_vs_full"] = round(f / p, 3)
    out["planner_vs_random"] = round(p / r, 3)
    out["max_abs_error_vs_sim"] = round(max(abs(v["measured_s"] / v["simulated_s"] - 1) for v in out["methods"].values()), 3)
    out["max_abs_error_vs_sim_fitted"] = round(max(abs(v["measured_s"] / v["simulated_fitted_s"] - 1)
                                                   for v in out["methods"].values()), 3)
    print(f"measured vs simulated with the fitted overhead within {100 * out['max_abs_error_vs_sim_fitted']:.1f}% "
          "(target 10%)")
    q = out["methods"]["planner_int8"]["measured_s"]
    out["planner_int8_vs_planner"] = round(q / p, 3)
    out["compression_floor_vs_planner"] = round(floor, 3)
    print(f"\nplanner {f / p:.2f}x faster than the full pipeline (target >= 2; SkipPipe's real deployment 2.7x); "
          f"planner / random skip {p / r:.3f} (target <= 0.8); measured vs simulated within "
          f"{100 * out['max_abs_error_vs_sim']:.1f}% (target 20%); planner with int8 hops on slow links "
          f"{q / p:.3f}x the uncompressed planner (target <= 0.6; simulated floor of any encoding, every hop's "
          f"bytes free and the routes re-planned: {floor:.3f}x)")
    print(f"total {time.time() - t_all:.0f} s (launch {res.wall_s:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
