"""The swarm half of ``bench/elastic.py``: the best static configuration of the sweep against
elastic freezing, on 16 real node processes (``skiptrain.runtime.launcher.launch``).

One launch per seed, two phases on the same processes (each restarts from the same initial
weights and data, so both train the same samples in the same order): ``static`` (the best
static layout: S stages x R replicas, M micro-batches per replica) and ``elastic`` (the same
start, ``elastic.enabled``: the freeze rule decides for the whole swarm, AutoPipe/AutoDP
transitions move state between the processes by name; with ``--swarm-cache on`` (the default)
the stage-0 nodes serve the frozen prefix from activation caches -- one per machine of the
topology, shared by its originators (``--swarm-cache-share location``, the default) or one per
node -- prefilled, data parallel, once a frozen depth has held ``--swarm-prefill-hold`` windows
(recomputed until then) and when the simulated iteration time the cached prefix saves until the
end of the phase is at least ``--swarm-prefill-min-gain`` times the prefill's; ``off``: they
recompute it, forward only, each micro-batch).

Compute is padded to the cost model (``runtime.emulate_compute``: every forward/backward task
sleeps up to ``s_per_sample_layer`` x samples x its stage's layers, a frozen layer costing its
forward only), so the iteration time follows the cost model and not this 2-core machine.  The
network is PipeTransformer's 2 machines x 8 (``costs.sim_topology``), not link-emulated (the
hops are local sockets; the simulator sees 25 Gbit/s between machines); the data-parallel sync
is a real gloo all-reduce, not in the simulator's prediction.

Figures (per seed): the whole run at equal tokens (wall clock of each phase, every overhead in
it: start barriers, stats gathers, guard validation, transitions; not the in-loop validation
passes, which measure and do not train), the final training loss (mean of the last window) of
elastic / static, time to the target validation loss (static's final x 1.01, as the real half
sets it: the first of the in-loop validation points, one per window, through the layout in
force, at or below it), time to a training-loss target (static's final window mean x 1.01, from
the first iteration it stays there), the transitions' fraction of the elastic wall clock (the
cache prefills apart: they are the prefix's forward work of the rest of the run, done at once), and the measured
iteration times next to the simulator's for the same layouts (``simulate`` of each layout's
schedule and cost model, summed over the iterations it was in force; the transitions' wire time
by ``topo.transfer_s`` of their messages), whole and their pipeline part alone (metrics
``pipeline_s``: to the end of the last forward/backward task, before the data-parallel sync and
the optimizer step, which the simulator runs without), next to this host's CPU floor
(``bench/_host.host_floor_s``: the node processes' CPU seconds over the cores they share, the
fewest seconds this machine can run an iteration in) and the measured time over the larger of
the simulated time and that floor (how far the runtime is from what the machine allows).  And
how far the unfrozen run strays above the guard's kind of projection
(``guard_projection_error``): static's validation curve against the fit through its own points
at the elastic guard's reference steps, at the next check and the largest over the run; above
``--guard-tol``, the guard can undo a freeze for its projection's error alone.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from skiptrain.config import build_config
from skiptrain.elastic.costs import N_DEV, sim_topology
from skiptrain.elastic.freeze import log_fit
from skiptrain.optim import lr_clock
from skiptrain.runtime.job import EmulationSpec, Job, Phase, build_cost, with_runtime
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.transition import layout_cost
from skiptrain.schedule.baselines import full_pipeline
from skiptrain.schedule.schedule import Schedule
from skiptrain.schedule.simulator import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host import host_floor_s  # noqa: E402
from _workdir import work_dir  # noqa: E402

GLOBAL_BATCH = 16
GUARD_WINDOWS = 16      # the real half's guard: 4 validation micro-batches of 4 windows
GUARD_REF = 4           # unfrozen validation points the guard's projection fits (the last of them)


def swarm_config(args, best: dict, seed: int, iterations: int, data: str):
    """The job's config: the real half's model, the best static layout's micro-batching."""
    S, R, M = best["stages"], best["replicas"], best["n_micro"]
    mb = max(1, GLOBAL_BATCH // (R * M))
    return build_config(overrides={
        "data": {"path": data},
        "model": {"d_model": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64,
                  "n_stages": S, "stage0_layers": -1},
        "train": {"steps": iterations, "micro_batch": mb, "lr": args.lr, "warmup_steps": args.swarm_warmup,
                  "eval_every": args.swarm_check_every, "eval_batches": max(1, 4 * args.eval_batches // mb),
                  "seed": seed, "grad_clip": 1.0, "skip_ratio": 0.0},
        "runtime": {"nodes": N_DEV, "emulate_compute": True, "wan": False, "mb_per_originator": M,
                    "s_per_sample_layer": args.swarm_spl, "hop_overhead_s": 0.0, "memory": S,
                    "timeout_s": 120.0},
        "checkpoint": {"every": 0, "final": False}})


def elastic_settings(args, micro_batch: int) -> dict:
    """The real half's rule and guard; the guard validates ``--swarm-guard-windows`` windows
    (default the real half's 16: 4 micro-batches of 4 there), in micro-batches of this layout's size."""
    return {"enabled": True, "alpha": args.alpha, "check_every": args.swarm_check_every, "tol": args.tol,
            "min_active": 2, "start_window": args.start_window, "stable_windows": args.stable_windows,
            "guard": True, "guard_tol": args.guard_tol, "guard_confirm": args.guard_confirm, "guard_ref": GUARD_REF,
            "guard_min_ref": args.guard_min_ref, "guard_batches": max(1, args.swarm_guard_windows // micro_batch),
            "cache": args.swarm_cache,
            "cache_share": args.swarm_cache_share, "prefill_min_gain": args.swarm_prefill_min_gain,
            "prefill_hold": args.swarm_prefill_hold}


def run_seed(args, best: dict, seed: int, iterations: int, data: str, init: str | None = None) -> dict:
    """One launch (static, then elastic) at ``seed``; the figures of that seed."""
    cfg = swarm_config(args, best, seed, iterations, data)
    from skiptrain.data.dataset import TokenDataset
    cfg.model.vocab_size = TokenDataset.open(data).vocab_size
    S, R, M = best["stages"], best["replicas"], best["n_micro"]
    topo = sim_topology()
    cost = build_cost(cfg, dp_mode="none")
    placement = [[s * R + i for i in range(R)] for s in range(S)]
    sched = full_pipeline(topo, cost, [R] * S, R * M, S, dp_sync=False, placement=placement)
    common = dict(schedule=sched.to_dict(), iterations=iterations, cost=cost.to_dict(), topology=topo.to_dict(),
                  emulation=EmulationSpec(compute=True))
    phases = [Phase(name="static", dump=True, **common),
              Phase(name="elastic", config={"elastic": elastic_settings(args, cfg.train.micro_batch)}, dump=True,
                    **common)]
    with work_dir(None, "elastic-swarm") as tmp:
        run = Path(args.swarm_keep) / f"seed{seed}" if args.swarm_keep else Path(tmp) / "run"
        job = Job(config=with_runtime(cfg.to_dict(), heartbeat_s=0.5), data_path=data, run_dir=str(run),
                  phases=phases, meta={"init_weights": init} if init else {})
        t0 = time.time()
        res = launch(job, timeout_s=args.swarm_timeout)
        launch_s = time.time() - t0
        walls = {p: phase_clock(run, p) for p in ("static", "elastic")}
        log = [json.loads(x) for x in (run / "elastic.jsonl").read_text().splitlines()] \
            if (run / "elastic.jsonl").is_file() else []
        val = {p: final_val_loss(cfg, data, run / "phases" / p, args.eval_batches) for p in ("static", "elastic")}
    rows = {p: res.phase_iterations(p) for p in ("static", "elastic")}
    evals = {p: [r for r in res.phase_metrics(p) if "val_loss" in r] for p in ("static", "elastic")}
    out = figures(cfg, cost, topo, sched, rows, walls, evals, log, launch_s, args.swarm_check_every)
    out["final_val_loss"] = {p: round(v, 5) for p, v in val.items()}
    out["final_val_loss_ratio"] = round(val["elastic"] / val["static"], 5)
    return out


def final_val_loss(cfg, data: str, phase_dir: Path, eval_batches: int) -> float:
    """Validation loss of a phase's final model (every node's dumped parameters by global name,
    replicas identical) on ``eval_batches`` fixed micro-batches of 4 windows, as the real half
    validates."""
    import dataclasses

    import torch

    from bench._events import validation_loss

    tensors: dict = {}
    for f in sorted(phase_dir.glob("params_node*.pt")):
        tensors.update(torch.load(f, weights_only=True))
    ev = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=4, eval_batches=eval_batches))
    return validation_loss(ev, Path(data), tensors)


def phase_clock(run: Path, phase: str) -> list[tuple[float, float]]:
    """Per iteration (start, end) on the wall clock (the lowest node's record: every node shares
    the start of an iteration; its end is the latest task's end, the gathered ``iteration_s``)."""
    rec = json.loads(min((run / "phases" / phase).glob("node*.json"),
                         key=lambda f: int(f.stem.removeprefix("node"))).read_text())
    return [(it["t0"], it["t0"] + it["t_end"]) for it in rec["iterations"]]


def window_mean(losses: list[float], w: int) -> list[float]:
    return [statistics.fmean(losses[max(0, i + 1 - w):i + 1]) for i in range(len(losses))]


def layouts_in_force(cfg, cost, sched, log: list[dict], n_it: int) -> list[tuple]:
    """Per iteration: (frozen, counts, placement, prefix cached, schedule, cost model) of the layout
    in force (the schedule each transition logged: the one that ran)."""
    transitions = {t["step"]: t for t in log if t.get("action") == "transition"}
    from skiptrain.model.partition import partition_layers
    cur = (0, partition_layers(cfg.model).to_list(), sched.placement, False, sched, cost)
    out = []
    for it in range(n_it):
        t = transitions.get(it)
        if t is not None:
            c = layout_cost(cost, cfg.model, t["counts"], t["frozen_after"], hit=1.0 if t.get("prefix_cached") else 0.0)
            s = Schedule.from_dict(t["schedule"])
            cur = (t["frozen_after"], t["counts"], t["placement"], bool(t.get("prefix_cached")), s, c)
        out.append(cur)
    return out


def training_clock(walls: dict, evals: dict) -> tuple[dict, dict]:
    """(wall seconds, elapsed seconds at each iteration's end) per phase, without the in-loop
    validation passes (a measurement, not training: each runs after an iteration, in the gap
    before the next one starts)."""
    wall, elapsed = {}, {}
    for p, w in walls.items():
        spent = [0.0] * (len(w) + 1)       # validation seconds after iterations 1..i
        for v in evals.get(p, []):
            if v["step"] <= len(w):
                spent[v["step"]] += v.get("seconds", 0.0)
        for i in range(1, len(spent)):
            spent[i] += spent[i - 1]
        elapsed[p] = [e - w[0][0] - spent[i] for i, (_, e) in enumerate(w)]
        wall[p] = w[-1][1] - w[0][0] - spent[len(w) - 1]
    return wall, elapsed


def val_target(evals: dict, elapsed: dict) -> dict:
    """Time to the target validation loss (static's final x 1.01, as the real half sets it): the
    first in-loop validation point at or below it, on the training clock."""
    target = evals["static"][-1]["val_loss"] * 1.01
    hit = {p: next((v["step"] for v in evals[p] if v["val_loss"] <= target), None) for p in evals}
    ttt = {p: (elapsed[p][k - 1] if k is not None else None) for p, k in hit.items()}
    return {"target_val_loss": round(target, 5), "steps_to_target": hit,
            "time_to_target_s": {p: None if v is None else round(v, 4) for p, v in ttt.items()},
            "time_to_target_speedup": round(ttt["static"] / ttt["elastic"], 4) if ttt["elastic"] else None,
            "val_curve": {p: [[v["step"], v["val_loss"], v.get("seconds")] for v in evals[p]] for p in evals},
            "validation_s": {p: round(sum(v.get("seconds", 0.0) for v in evals[p]), 3) for p in evals}}


def guard_projection_error(cfg, evals: dict, log: list[dict], guard_ref: int) -> dict | None:
    """How far the unfrozen run itself strays above the guard's kind of projection: the fit
    ``FreezeRule.projected`` makes (``v = a + b ln(clock)``, the learning-rate clock), through the
    static phase's in-loop validation points at the elastic guard's reference steps before its
    first freeze (its last ``guard_ref``), against static's later points.  A largest excess above
    ``guard_tol`` means the guard can undo a freeze for its projection's error alone; None when
    the elastic run never froze."""
    first = next((d for d in log if d.get("action") == "freeze"), None)
    if first is None:
        return None
    refs = [d["step"] for d in log if d.get("frozen_before") == 0 and d.get("val_loss") is not None
            and d["step"] <= first["step"] and d.get("action") not in ("undo", "transition")][-guard_ref:]
    curve = {v["step"]: v["val_loss"] for v in evals["static"]}
    if len(refs) < 2 or any(s not in curve for s in refs):
        return None
    a, b = log_fit([(lr_clock(s, cfg.train), curve[s]) for s in refs])
    excess = {s: v / (a + b * math.log(lr_clock(s, cfg.train))) - 1 for s, v in curve.items() if s > refs[-1]}
    worst = max(excess, key=excess.get) if excess else None
    first_check = min(excess) if excess else None
    return {"ref_steps": refs, "first_check": None if first_check is None else round(excess[first_check], 5),
            "max_excess": None if worst is None else round(excess[worst], 5), "at_step": worst,
            "excess_by_step": {str(s): round(e, 5) for s, e in excess.items()}}


def figures(cfg, cost, topo, sched, rows: dict, walls: dict, evals: dict, log: list[dict], launch_s: float,
            w: int) -> dict:
    """The seed's figures from the two phases' metrics, clocks, validation points and the
    elastic decision log."""
    n_it = len(rows["static"])
    loss = {p: window_mean([r["loss"] for r in rows[p]], w) for p in rows}
    wall, elapsed = training_clock(walls, evals)
    target = loss["static"][-1] * 1.01
    # the first iteration from which the window mean stays at or below the target (fine-tuning
    # losses start near it: the first crossing alone is noise)
    hit = {p: next((i for i in range(len(v)) if max(v[i:]) <= target), None) for p, v in loss.items()}
    ttt = {p: (elapsed[p][hit[p]] if hit[p] is not None else None) for p in loss}
    trans = [t for t in log if t.get("action") == "transition"]
    trans_s = sum(t["seconds"] for t in trans)
    pre = [t for t in log if t.get("action") == "prefill"]
    prefill_s = sum(t["seconds"] for t in pre)
    sim_cache: dict[int, float] = {}

    def sim(s, c) -> float:
        k = id(s)
        if k not in sim_cache:
            sim_cache[k] = simulate(s, topo, c, contention=True, dp_sync=False, record=False).iteration_s
        return sim_cache[k]

    static_sim = sim(sched, cost)
    el = layouts_in_force(cfg, cost, sched, log, n_it)
    per_layout: dict[str, dict] = {}
    for i, (F, counts, pl, cached, s, c) in enumerate(el):
        key = f"F={F} {len(counts)}x{min(len(p) for p in pl)}" + (" cached" if cached else "")
        d = per_layout.setdefault(key, {"frozen": F, "counts": counts, "iterations": 0, "measured_s": [],
                                        "pipeline_s": [], "host_floor_s": [], "simulated_s": sim(s, c)})
        row = rows["elastic"][i]
        d["iterations"] += 1
        d["measured_s"].append(row["iteration_s"])
        d["pipeline_s"].append(row["pipeline_s"])
        d["host_floor_s"].append(host_floor_s(row))
    for d in per_layout.values():
        for k in ("measured_s", "pipeline_s", "host_floor_s"):
            d[k] = round(statistics.median(d[k]), 4)
        d["ratio"] = round(d["measured_s"] / d["simulated_s"], 3)
        d["pipeline_ratio"] = round(d["pipeline_s"] / d["simulated_s"], 3)
    sims = {"static": [static_sim] * n_it, "elastic": [sim(s, c) for *_, s, c in el]}
    meas_it = {p: sum(r["iteration_s"] for r in rows[p]) for p in rows}
    pipe_it = {p: sum(r["pipeline_s"] for r in rows[p]) for p in rows}
    sim_it = {p: sum(v) for p, v in sims.items()}
    floor = {p: [host_floor_s(r) for r in rows[p]] for p in rows}
    wire = sum(transfer_wire_s(t, topo) for t in trans)
    r = lambda x: round(x, 4) if x is not None else None  # noqa: E731
    return {
        "iterations": n_it, "launch_s": round(launch_s, 1),
        "wall_s": {p: r(v) for p, v in wall.items()},
        "whole_run_speedup": r(wall["static"] / wall["elastic"]),
        "final_train_loss": {p: r(v[-1]) for p, v in loss.items()},
        "final_loss_ratio": r(loss["elastic"][-1] / loss["static"][-1]),
        **val_target(evals, elapsed),
        "target_train_loss": r(target), "iterations_to_train_target": hit,
        "time_to_train_target_s": {p: r(v) for p, v in ttt.items()},
        "time_to_train_target_speedup": r(ttt["static"] / ttt["elastic"]) if ttt["elastic"] else None,
        "transitions": [{k: t[k] for k in ("step", "frozen_before", "frozen_after", "counts", "placement",
                                           "transfer_bytes", "transfer_messages", "move_s", "seconds")} for t in trans],
        "transition_s": r(trans_s), "transition_fraction": r(trans_s / wall["elastic"]),
        "transition_wire_sim_s": r(wire),
        "prefills": [{k: t.get(k) for k in ("step", "frozen", "rows", "layer_rows", "received_rows", "seconds")}
                     for t in pre],
        "prefill_s": r(prefill_s), "prefill_fraction": r(prefill_s / wall["elastic"]),
        "iteration_s_measured": {p: r(v) for p, v in meas_it.items()},
        "iteration_s_simulated": {p: r(v) for p, v in sim_it.items()},
        "measured_vs_sim": {p: r(meas_it[p] / sim_it[p]) for p in rows},
        "iteration_s_pipeline": {p: r(v) for p, v in pipe_it.items()},
        "pipeline_vs_sim": {p: r(pipe_it[p] / sim_it[p]) for p in rows},
        "host_floor_vs_sim": {p: r(sum(floor[p]) / sim_it[p]) for p in rows},
        "measured_vs_attainable": {p: r(meas_it[p] / sum(map(max, sims[p], floor[p]))) for p in rows},
        "elastic_measured_vs_sim_with_transitions": r((meas_it["elastic"] + trans_s) / (sim_it["elastic"] + wire)),
        "static_iteration_s": {"measured_median": r(statistics.median(x["iteration_s"] for x in rows["static"])),
                               "simulated": r(static_sim)},
        "elastic_layouts": per_layout,
        "guard_projection_error": guard_projection_error(cfg, evals, log, GUARD_REF),
        "decisions": [{k: d.get(k) for k in ("step", "action", "frozen_before", "frozen_after", "val_loss",
                                             "projected", "above", "reason")}
                      for d in log if d.get("action") not in (None, "transition")],
        "overruns": {p: rows[p][-1]["overruns"] for p in rows},
        "elapsed_s": {p: [r(x) for x in v] for p, v in elapsed.items()},
        "losses": {p: [x["loss"] for x in rows[p]] for p in rows},
    }


def transfer_wire_s(t: dict, topo) -> float:
    """The simulator's wire time of a transition: its bytes over the slowest link it can use
    (receivers in parallel; a lower bound close to the truth at these sizes)."""
    return max((topo.transfer_s(0, n, t["transfer_bytes"] / max(1, t["transfer_messages"]))
                for p in t["placement"] for n in p if n), default=0.0)


MEAN_KEYS = ("whole_run_speedup", "final_loss_ratio", "final_val_loss_ratio", "time_to_target_speedup",
             "time_to_train_target_speedup", "transition_fraction", "prefill_fraction")


def swarm_half(args, best: dict, seeds: list[int], iterations: int, data: str,
               init_state: dict | None = None) -> dict:
    """The swarm runs at ``seeds`` on the prepared data set at ``data`` (the real half's
    fine-tuning windows) from ``init_state`` (the real half's pre-trained weights; None: from
    scratch); per seed and mean."""
    import torch
    with work_dir(None, "elastic-init") as tmp:
        init = None
        if init_state is not None:
            init = str(Path(tmp) / "init.pt")
            torch.save(init_state, init)
        return seeds_and_mean(args, best, seeds, iterations, data, init)


def seeds_and_mean(args, best: dict, seeds: list[int], iterations: int, data: str, init: str | None) -> dict:
    """Every seed's figures (from the pre-trained state at ``init``, if any) and their mean."""
    out = {"pretrained": init is not None, "best_static": {k: best[k] for k in ("stages", "replicas", "n_micro")}, "iterations": iterations,
           "s_per_sample_layer": args.swarm_spl, "check_every": args.swarm_check_every, "cache": args.swarm_cache,
           "cache_share": args.swarm_cache_share, "prefill_min_gain": args.swarm_prefill_min_gain,
           "prefill_hold": args.swarm_prefill_hold, "guard_windows": args.swarm_guard_windows, "seeds": {}}
    for seed in seeds:
        print(f"  swarm seed {seed}: 16 node processes, {iterations} iterations x 2 phases ...", flush=True)
        out["seeds"][str(seed)] = run_seed(args, best, seed, iterations, data, init)
    per = list(out["seeds"].values())
    mean = {}
    for k in MEAN_KEYS:
        vals = [p[k] for p in per if p[k] is not None]
        mean[k] = round(statistics.fmean(vals), 4) if vals else None
    errs = [x["guard_projection_error"]["max_excess"] for x in per if x.get("guard_projection_error")]
    mean["guard_projection_error"] = round(statistics.fmean(errs), 5) if errs else None
    for p in ("static", "elastic"):
        mean[f"measured_vs_sim_{p}"] = round(statistics.fmean(x["measured_vs_sim"][p] for x in per), 4)
        mean[f"pipeline_vs_sim_{p}"] = round(statistics.fmean(x["pipeline_vs_sim"][p] for x in per), 4)
        for k in ("host_floor_vs_sim", "measured_vs_attainable"):
            mean[f"{k}_{p}"] = round(statistics.fmean(x[k][p] for x in per), 4)
    out["mean"] = mean
    return out


def print_swarm(sw: dict) -> None:
    b = sw["best_static"]
    print(f"\nSWARM, 16 node processes (this machine; compute padded to the cost model, "
          f"{sw['s_per_sample_layer']:g} s per sample-layer; best static S={b['stages']} R={b['replicas']} "
          f"M={b['n_micro']}; {sw['iterations']} iterations per phase, windows of {sw['check_every']}; "
          f"activation cache {sw['cache']}"
          f"{', one per ' + sw.get('cache_share', 'node') if sw['cache'] == 'on' else ''}"
          f"{', prefilled at a gain >= %g' % sw['prefill_min_gain'] if 'prefill_min_gain' in sw and sw['cache'] == 'on' else ''}"
          f"{', once a depth held %d window(s)' % sw['prefill_hold'] if sw.get('prefill_hold') and sw['cache'] == 'on' else ''}"
          f"; guard on {sw.get('guard_windows', 4)} validation windows)")
    seeds = list(sw["seeds"])
    head = f"{'figure':<44}" + "".join(f"{'seed ' + s:>12}" for s in seeds) + f"{'mean':>10}"
    print(head + "\n" + "-" * len(head))

    def row(name, fn, mean=None, fmt="{:.3f}"):
        vals = [fn(sw["seeds"][s]) for s in seeds]
        cells = "".join(f"{(fmt.format(v) if v is not None else '-'):>12}" for v in vals)
        m = sw["mean"].get(mean) if mean else None
        print(f"{name:<44}{cells}{(fmt.format(m) if m is not None else ''):>10}")

    row("whole run at equal tokens (x static)", lambda x: x["whole_run_speedup"], "whole_run_speedup", "{:.2f}x")
    row("wall s static / elastic", lambda x: f"{x['wall_s']['static']:.1f}/{x['wall_s']['elastic']:.1f}", fmt="{}")
    row("final val loss (elastic / static)", lambda x: x["final_val_loss_ratio"], "final_val_loss_ratio", "{:.4f}")
    row("final train loss (elastic / static)", lambda x: x["final_loss_ratio"], "final_loss_ratio", "{:.4f}")
    row("time to target, val loss (x static)", lambda x: x["time_to_target_speedup"], "time_to_target_speedup",
        "{:.2f}x")
    row("  steps to it, static / elastic", lambda x: "/".join(str(x["steps_to_target"][p] or "-")
                                                             for p in ("static", "elastic")), fmt="{}")
    row("time to target, train loss (x static)", lambda x: x["time_to_train_target_speedup"],
        "time_to_train_target_speedup", "{:.2f}x")
    row("static above the guard's projection: next", lambda x: (x.get("guard_projection_error") or {}).get("first_check"),
        fmt="{:+.2%}")
    row("  largest, over the run", lambda x: (x.get("guard_projection_error") or {}).get("max_excess"),
        "guard_projection_error", "{:+.2%}")
    row("transitions / elastic wall", lambda x: x["transition_fraction"], "transition_fraction", "{:.4f}")
    row("cache prefills / elastic wall", lambda x: x["prefill_fraction"], "prefill_fraction", "{:.4f}")
    row("iterations measured / simulated: static", lambda x: x["measured_vs_sim"]["static"],
        "measured_vs_sim_static")
    row("iterations measured / simulated: elastic", lambda x: x["measured_vs_sim"]["elastic"],
        "measured_vs_sim_elastic")
    row("  their pipeline part / simulated: static", lambda x: x["pipeline_vs_sim"]["static"],
        "pipeline_vs_sim_static")
    row("  their pipeline part / simulated: elastic", lambda x: x["pipeline_vs_sim"]["elastic"],
        "pipeline_vs_sim_elastic")
    for p in ("static", "elastic"):
        row(f"  host CPU floor / simulated: {p}", lambda x, p=p: x["host_floor_vs_sim"][p], f"host_floor_vs_sim_{p}")
    for p in ("static", "elastic"):
        row(f"  measured / max(simulated, floor): {p}", lambda x, p=p: x["measured_vs_attainable"][p],
            f"measured_vs_attainable_{p}")
    row("transitions (iteration: F; c = cache-in)", lambda x: ",".join(
        f"{t['step']}:{t['frozen_after']}" + ("c" if t["frozen_before"] == t["frozen_after"] else "")
        for t in x["transitions"]) or "none", fmt="{}")
    for s in seeds:
        layouts = sw["seeds"][s]["elastic_layouts"].items()
        print(f"  seed {s} layouts (median s per iteration, measured (its pipeline part) / simulated, host floor): "
              + "; ".join(f"{k} x{v['iterations']}: {v['measured_s']:.3f} ({v['pipeline_s']:.3f})/"
                          f"{v['simulated_s']:.3f}, {v['host_floor_s']:.3f}" for k, v in layouts))
