"""Bench: the flagship race -- every idea of skiptrain at once against the full pipeline with a
dense all-reduce, on emulated geo12 links, raced fairly at equal wall-clock.

One swarm of node processes on this machine (default 16, one per geo12 node in reference order;
one more geo12 slot for the node that joins in the events run) trains the same model on the
same real text (data/shakespeare, BPE 4096) with the same global batch, data order and seeds on
both sides:

* **flagship**: the planner's skip routes (k = 0.33, <= 2 swaps), DeMo (top-32 of 64x64 DCT
  chunks, 1-bit signs, 12-bit indices; its sign step's learning rate tuned), int8 activations
  and gradients on links slower than 1 GB/s, elastic freezing (the freeze rule, its validation
  guard, AutoPipe + AutoDP transitions; activation cache off), recovery on, a job checkpoint
  every ``ckpt_every`` iterations in the timing and events runs.
* **baseline**: the full pipeline (1F1B on fixed lanes), AdamW on a dense fp32 ring all-reduce,
  fp32 activations, no freezing, no checkpoints.

Four phases:

1. **Timing** (links emulated, real processes): each side runs a few iterations with geo12's
   links emulated in the transport (per directed link a FIFO with its latency and bandwidth,
   scaled by the time scale; ``bytes_scale`` emulated bytes per real byte so a hop carries
   SkipPipe's 32 MiB), compute padded to the cost model (a stage's forward of a micro-batch
   takes SkipPipe's 1.76 s x time scale) and every replica group's collectives delayed as a ring
   over its links.  *This machine's clock*: the measured wall seconds between iteration lines
   after one warm-up period (the flagship's period: its checkpoint interval, so checkpoints are
   in the mean).  *Own-compute clock*: the simulator's iteration of the same layout on the same
   emulated links with each node's compute padded as emulated (the flagship's DP payload as
   measured) -- what each node on a machine of its own would see; also the bound the measured
   figures are held against.  The time scale is chosen so that this machine's CPU floor (node
   processes' CPU seconds over the cores) stays below half of the flagship's simulated iteration.
2. **Tuning** (emulation off, same layouts, routes, replica groups, data order): each side's
   learning rate on the same small grid at the side's target length, first seed; a rate that
   wins at an edge of its grid is followed past it (``--follow`` times).  ``--tune-rungs``:
   the flagship's grid at every rung's own length instead (each rung runs its own winner), so
   at equal tokens both sides are tuned at the baseline's length.
3. **Race** (emulation off): the baseline at its length, the flagship on a ladder of lengths
   (the baseline's iterations -- equal tokens -- then fractions of the iterations that fit in
   the baseline's wall-clock on this machine's clock), every run with its own cosine schedule
   over its own length (warm-up 5%), every seed, placed on both clocks.  The time to the
   baseline is the shortest rung whose annealed final validation loss (mean over seeds) is at
   or below the baseline's.
4. **Events** (emulation off, a separate run): the flagship's equal-tokens run, first seed, again
   with kill -9 of a body replica, SIGSTOP of another, a new node joining and the whole job
   SIGKILLed and resumed from its newest checkpoint: samples lost and repeated, its final loss
   against the same run without events, and its cost in seconds on this machine.

Records are kept as they arrive in ``records.jsonl`` of the work folder; ``--keep DIR`` reuses a
folder's records (a run cut short goes on where it stopped); a record is reused only by the code
that trained it, or with ``--any-code`` by any code when it is a learning run (emulation off:
its arithmetic is the sync's and the optimizer's), never when it is a timed run.  ``--quick``: 8 nodes, a tiny
model, short runs, the same code path.  ``--try OVERRIDES`` (repeatable) runs no race: one flagship
learning run per set of overrides in place of the flagship's (first seed, emulation off, at the
tuning length, its records in the same cache), ``--try-timing`` also times each set.

    .venv/bin/python bench/flagship.py --json runs/bench/flagship.json --plot docs/img/flagship_race.png
    .venv/bin/python bench/flagship.py --quick --json runs/bench/flagship_quick.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._events import kill_job, launch_process, spawn_joiner, steps_done  # noqa: E402
from bench._race import (CLOCKS, Runner, Side, lrs, machine_seconds, plot_race, print_baseline,  # noqa: E402
                         print_rungs, print_tuning, rung, rung_steps, time_to_baseline, timing_steps, tune, untuned)
from bench._workdir import work_dir  # noqa: E402
from skiptrain.checkpoint import store as ckstore  # noqa: E402
from skiptrain.checkpoint.reader import CheckpointReader  # noqa: E402
from skiptrain.checkpoint.training import truncate_metrics  # noqa: E402
from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.net.topology import load_topology  # noqa: E402
from skiptrain.runtime.faults import faulty_job  # noqa: E402
from skiptrain.runtime.job import Job, build_cost, build_schedule, phase_for  # noqa: E402
from skiptrain.runtime.job_checkpoint import checkpoint_root, resume_point  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402
from skiptrain.runtime.recovery import trained_samples  # noqa: E402
from skiptrain.runtime.wan import scale_topology  # noqa: E402

STAGE_FWD_S = 1.76        # SkipPipe: a stage's forward of one micro-batch (4 layers x 8 samples x 0.055 s)
HOP_BYTES = 32 * 2 ** 20  # SkipPipe: one hop's activations
BASELINE, FLAGSHIP = "baseline", "flagship"
DP_NAMES = {"demo": "DeMo", "powersgd": "PowerSGD", "sparseloco": "SparseLoCo"}
QUICK_MODEL = {"d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64, "stage0_layers": 1}
#: the `small` preset narrowed to d_model 192 and seq 64 (4.8M parameters): 150 baseline iterations x 3 seeds,
#: the flagship's ladder and the tuning fit in about an hour on 2 cores (the 8.0M `small` at seq 128 does not)
FULL_MODEL = {"d_model": 192, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64}


def settings(args) -> dict:
    """Sizes of the race (``--quick``: the same path, smaller)."""
    if args.quick:
        s = {"nodes": 8, "model": QUICK_MODEL, "baseline_steps": 12, "ckpt_every": 2, "check_every": 2,
             "time_scale": 1 / 16, "ladder": (0.5, 1.0), "tune_at": 0.5, "seeds": 1, "follow": 0, "period": 2}
    else:
        s = {"nodes": 16, "model": FULL_MODEL, "baseline_steps": 150, "ckpt_every": 5, "check_every": 5,
             "time_scale": 1 / 6, "ladder": (0.5, 0.75, 1.0), "tune_at": 0.75, "seeds": 3, "follow": 1, "period": 5}
    s["last_seeds"], s["freeze"] = args.last_rung_seeds, not args.no_freeze
    s["flagship_set"] = args.flagship_set.split() if args.flagship_set else []
    for k in ("nodes", "baseline_steps", "time_scale", "seeds", "follow"):
        if getattr(args, k, None) is not None:
            s[k] = getattr(args, k)
    if args.ladder:
        s["ladder"] = tuple(float(x) for x in args.ladder.split(","))
    return s


def flat(d: dict) -> list[str]:
    """``{section: {key: value}}`` as ``section.key=value`` overrides."""
    fmt = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return [f"{sec}.{k}={fmt(v)}" for sec, kv in d.items() for k, v in kv.items()]


def common(args, s: dict, vocab: int) -> list[str]:
    """The model, data and emulated network both sides share; every run learns with emulation off
    and without checkpoints (the timing and events runs turn them on)."""
    tau = s["time_scale"]
    m = {**s["model"], "vocab_size": vocab, "n_stages": 4}
    probe = build_config(args.preset, overrides={"model": m})
    act = probe.train.micro_batch * probe.model.seq_len * probe.model.d_model * 4
    return flat({
        "model": m,
        "train": {"max_swaps": 2, "grad_clip": 1.0, "eval_batches": 16, "progress": False},
        "runtime": {"nodes": s["nodes"], "topology": "geo12", "wan": False, "emulate_compute": False,
                    "time_scale": tau, "bytes_scale": max(1, round(HOP_BYTES / act)), "hop_overhead_s": 0.35 * tau,
                    "s_per_sample_layer": STAGE_FWD_S * tau / (probe.train.micro_batch * probe.model.n_layers / 4),
                    "memory": 3, "mb_per_originator": 2, "plan_seed": 0, "timeout_s": 30.0, "heartbeat_s": 0.25},
        "checkpoint": {"every": 0, "final": False}})


def sides(s: dict) -> dict[str, Side]:
    tau, ck = s["time_scale"], s["ckpt_every"]
    flag = flat({
        "train": {"skip_ratio": 0.33},
        "dp": {"strategy": "demo", "topk": 32, "chunk": 64, "values": "sign1", "indices": "u12"},
        "runtime": {"act_codec": "int8", "act_fast_GBps": 1.0 / tau, "recover": True, "heartbeat_deadline_s": 3.0,
                    "ckpt_max_age": 2 * ck},
        "elastic": {"enabled": True, "check_every": s["check_every"], "cache": "off", "start_window": 2,
                    "guard_batches": 4, "min_active": 2} if s["freeze"] else {"enabled": False}})
    flag = with_overrides(flag, s.get("flagship_set", []))
    dp = next(o.split("=", 1)[1] for o in flag if o.startswith("dp.strategy="))
    return {BASELINE: Side("full pipeline, AdamW + fp32 all-reduce", ["train.skip_ratio=0", "dp.strategy=allreduce"],
                           {"lr": lrs(1e-3, 2e-3, 4e-3)}, start={"lr": 1}),
            FLAGSHIP: Side(f"skip routes, {DP_NAMES.get(dp, dp)}, int8, freezing, checkpoints, recovery", flag,
                           {"lr": lrs(1e-3, 2e-3, 4e-3)}, ladder=s["ladder"], tune_at=s["tune_at"], start={"lr": 1})}


def timing_overrides(s: dict, flagship: bool) -> list[str]:
    """Links, compute and sync emulated; the flagship checkpoints as it would in use; the
    baseline's dense sum is named by its shape (the runtime's default, auto: per stage the faster
    of one ring and rings within and across regions), so no timing of another shape is reused."""
    ck = [f"checkpoint.every={s['ckpt_every']}", "checkpoint.keep=2"] if flagship else ["runtime.dp_topology=auto"]
    return ["runtime.wan=true", "runtime.emulate_compute=true", "train.eval_every=0"] + ck


def run_config(args, base: list[str], overrides: list[str], steps: int, seed: int):
    """A run's config: the shared base, validation every tenth of the run (quick: quarter),
    warm-up 5%, then the run's own overrides, length and seed."""
    every = max(1, steps // (4 if args.quick else 10))
    return build_config(args.preset, overrides=base + [
        f"train.eval_every={every}", f"train.warmup_steps={max(1, round(0.05 * steps))}"] + overrides + [
        f"train.steps={steps}", f"train.seed={1234 + seed}"])


# ---- layouts and launches ---------------------------------------------------------------------

def network(cfg):
    """geo12 for the swarm + 1 nodes (the last: the joining node's slot), time-scaled."""
    return scale_topology(load_topology("geo12", cfg.runtime.nodes + 1), cfg.runtime.time_scale)


LAYOUTS: dict[str, tuple] = {}


def layout(cfg):
    """(topology, cost model, schedule) of a run: the same for every run of a side, emulated or
    not (learning rate, length, seed and emulation do not change them)."""
    d = cfg.to_dict()
    key = json.dumps({"model": d["model"], "train": {k: d["train"][k] for k in ("skip_ratio", "max_swaps", "micro_batch")},
                      "runtime": {k: v for k, v in d["runtime"].items() if k not in ("wan", "emulate_compute")},
                      "dp": d["dp"]["strategy"]}, sort_keys=True, default=str)
    if key not in LAYOUTS:
        flagship = cfg.train.skip_ratio > 0
        topo = network(cfg)
        cost = build_cost(cfg, dp_mode="compressed" if flagship else "dense")
        sched = build_schedule(cfg, "planner" if flagship else "full_pipeline", topo.subset(range(cfg.runtime.nodes)),
                               cost, contention=True, dp_sync=not flagship)
        LAYOUTS[key] = (topo, cost, sched)
    return LAYOUTS[key]


def phase_of(cfg, name: str, **kw):
    """A phase of the run ``cfg`` on its side's layout; emulated when ``runtime.wan`` is on."""
    topo, cost, sched = layout(cfg)
    em = cfg.runtime.wan
    ph = phase_for(cfg, sched, topo, cost, name, cfg.train.steps, wan=em, emulate_compute=em, emulate_sync=em, **kw)
    ph.config = cfg.to_dict()
    return ph


def race_launch(args, cfgs: list, run_dir: Path) -> list[dict]:
    """The runs ``cfgs`` (one side) as phases of one launch; their records."""
    phases = [phase_of(c, f"m{i}") for i, c in enumerate(cfgs)]
    job = Job(config=cfgs[0].to_dict(), data_path=str(args.data), run_dir=str(run_dir), phases=phases)
    res = launch(job, timeout_s=6 * 3600, echo=False)
    frozen = frozen_by_phase(run_dir, len(phases))
    return [dict(pipeline_record(res.phase_metrics(ph.name)), frozen=f) for ph, f in zip(phases, frozen)]


def pipeline_record(rows: list[dict]) -> dict:
    """One run's record: its iteration lines (wall time, measured iteration, CPU seconds, DP
    payload, overruns of the padded compute) and its validation points."""
    it = [r for r in rows if "loss" in r]
    return {"time": [r["time"] for r in it], "iteration_s": [r["iteration_s"] for r in it],
            "cpu_s": [r["cpu_s"] for r in it], "loss": [r["loss"] for r in it],
            "payload_bytes": [r["payload_bytes"] for r in it], "overruns": sum(r.get("overruns", 0) for r in it),
            "val": [[r["step"], r["val_loss"]] for r in rows if "val_loss" in r]}


def frozen_by_phase(run_dir: Path, n: int) -> list[int | None]:
    """The deepest frozen prefix each phase reached (freezing's log: the phases in order, each
    one's steps rising; None where the log cannot be split that way)."""
    path = run_dir / "elastic.jsonl"
    if not path.exists():
        return [None] * n
    segs, last = [], None
    for row in (json.loads(x) for x in path.read_text().splitlines() if x.strip()):
        if last is None or row.get("step", 0) < last:
            segs.append(0)
        segs[-1] = max(segs[-1], int(row.get("frozen_after") or 0))
        last = row.get("step", 0)
    return segs if len(segs) == n else [None] * n


# ---- phase 1: timing --------------------------------------------------------------------------

def simulated_s(cfg, payload_bytes: float) -> float:
    """The simulator's iteration of ``cfg``'s layout on the emulated links (the flagship's DP
    payload as measured, in emulated bytes)."""
    from skiptrain.schedule.simulator import simulate

    topo, cost, sched = layout(cfg)
    if cfg.train.skip_ratio > 0:
        cost = dataclasses.replace(cost, compressed_payload_bytes=int(payload_bytes * cfg.runtime.bytes_scale))
    return simulate(sched, topo.subset(range(cfg.runtime.nodes)), cost, contention=True, dp_sync=True).iteration_s


def pipeline_clock(rec: dict, period: int, nodes: int, cores: int, sim_s: float) -> dict:
    """Both clocks of one emulated timing run over its whole periods after the first: this
    machine's (wall seconds between iteration lines) and own compute (the simulator's iteration);
    one node's CPU seconds per iteration and this machine's CPU floor beside them."""
    cpu = statistics.fmean(rec["cpu_s"][period:])
    return {"machine": machine_seconds(rec, period), "own": sim_s, "simulated_s": sim_s,
            "node_cpu_s": cpu / nodes, "host_floor_s": cpu / cores, "overruns": rec["overruns"],
            "payload_bytes": statistics.median(rec["payload_bytes"]), "steps": len(rec["time"])}


def time_side(args, s: dict, runner: Runner, settings: list[str], flagship: bool) -> dict:
    """One side's clocks: its settings with links, compute and sync emulated (the flagship over
    whole checkpoint periods after the first)."""
    period = s["period"] if flagship else 1
    ov = settings + timing_overrides(s, flagship)
    steps = timing_steps(period, args.quick)
    rec = runner.train([(ov, steps, 0)])[0]
    cfg = runner.config(ov, steps, 0)
    out = pipeline_clock(rec, period, s["nodes"], len(os.sched_getaffinity(0)),
                         simulated_s(cfg, statistics.median(rec["payload_bytes"])))
    out["stage_sizes"] = [len(p) for p in layout(cfg)[2].placement]
    return out


def timing(args, s: dict, runner: Runner, side_of: dict[str, Side]) -> dict[str, dict]:
    """Phase 1: each side at its starting settings with links, compute and sync emulated."""
    out = {n: time_side(args, s, runner, side.settings(side.start), n == FLAGSHIP) for n, side in side_of.items()}
    f = out[FLAGSHIP]
    f["floor_below_half"] = f["host_floor_s"] < 0.5 * f["simulated_s"]
    if not f["floor_below_half"]:
        print(f"warning: this machine's CPU floor {f['host_floor_s']:.2f} s is above half the flagship's simulated "
              f"iteration {f['simulated_s']:.2f} s: raise --time-scale", flush=True)
    return out


# ---- phases 2 and 3: tuning and the race ------------------------------------------------------

def ladder(side: Side, base_steps: int, base_s: float, s_per_step: float, period: int) -> list[tuple[float, int]]:
    """(fraction, steps) of every rung: the baseline's iterations (equal tokens) first, then the
    side's fractions of the iterations that fit in the baseline's wall-clock (whole periods, the
    nearest, but never more than fit: a rung is never longer than the baseline's wall-clock)."""
    rungs = {base_steps: base_steps * s_per_step / base_s}
    for f in side.ladder:
        rungs.setdefault(rung_steps(f, base_s, s_per_step, period), f)
    return [(f, st) for st, f in sorted(rungs.items())]


def race(args, s: dict, runner: Runner) -> dict:
    side_of = sides(s)
    clocks = timing(args, s, runner, side_of)
    B = s["baseline_steps"]
    base_s = B * clocks[BASELINE]["machine"]
    out = {"baseline_steps": B, "baseline_machine_s": base_s, "sides": {}}
    for n, side in side_of.items():
        clock = clocks[n]
        lengths = [(None, B)] if n == BASELINE else ladder(side, B, base_s, clock["machine"], s["period"])
        seeds = [s["seeds"]] * (len(lengths) - 1) + [s["last_seeds"] or s["seeds"]] if n == FLAGSHIP else [s["seeds"]]
        # tuned once at the target length (the baseline's own), or (--tune-rungs) every rung at its own length
        at = [st for _, st in lengths] if n == FLAGSHIP and args.tune_rungs else \
            [B if n == BASELINE else rung_steps(side.tune_at, base_s, clock["machine"], s["period"])]
        tuned = {st: untuned(side) if args.no_tune else tune(runner, side, st, follow=s["follow"]) for st in at}
        rungs = []
        for (f, st), k in zip(lengths, seeds):
            settings = side.base + tuned.get(st, tuned[at[0]])["winner"]
            r = rung(runner, settings, st, k, clock, f)
            r.update(settings=settings, frozen=[runner.recs[runner.key(settings, st, sd)].get("frozen") for sd in range(k)])
            rungs.append(r)
        tuning = tuned[at[0]] if len(at) == 1 else {"per_rung": list(tuned.values())}
        out["sides"][n] = {"label": side.label, "settings": next(r["settings"] for r in rungs if r["steps"] == B)
                           if any(r["steps"] == B for r in rungs) else rungs[-1]["settings"], "clock": clock, "tuning": tuning,
                           "rungs": rungs}
    return out


# ---- exploration: single flagship runs (--try) -------------------------------------------------

def with_overrides(settings: list[str], extra: list[str]) -> list[str]:
    """``settings`` with each of ``extra`` (``section.key=value``) in place of the override of the
    same key; a fractional number is spelled as the grid spells it (``1e-3`` -> ``0.001``), so a
    run the race would train has the same records key."""
    out = list(settings)
    for o in extra:
        k, v = o.split("=", 1)
        try:
            int(v)
        except ValueError:
            try:
                v = f"{float(v):g}"
            except ValueError:
                pass
        out = [x for x in out if x.split("=", 1)[0] != k] + [f"{k}={v}"]
    return out


def explore(args, s: dict, runner: Runner) -> dict:
    """``--try``: one flagship learning run per overrides set (first seed, emulation off, the
    race's learning path and records) at ``--try-steps`` (default: the tuning length on the
    flagship's clock); with ``--try-timing`` each set is also timed with links emulated, and its
    tuning length is read off its own clock.  The DP payload is the learning run's median."""
    side_of = sides(s)
    flag = side_of[FLAGSHIP]
    clocks = timing(args, s, runner, side_of)
    base = clocks[BASELINE]
    base_s = s["baseline_steps"] * base["machine"]
    rows = []
    for extra in args.try_:
        settings = with_overrides(flag.settings(flag.start), extra.split())
        clock = time_side(args, s, runner, settings, True) if args.try_timing else None
        steps = args.try_steps or rung_steps(flag.tune_at, base_s, (clock or clocks[FLAGSHIP])["machine"], s["period"])
        rec = runner.train([(settings, steps, 0)])[0]
        payload = statistics.median(rec["payload_bytes"])
        row = {"overrides": extra, "settings": settings, "steps": steps, "seed": 1234, "val": rec["val"][-1][1],
               "val_curve": rec["val"], "payload_bytes": payload, "bytes_ratio": base["payload_bytes"] / payload,
               "wall_s_per_iteration": (rec["time"][-1] - rec["time"][0]) / max(1, len(rec["time"]) - 1)}
        if clock:
            row.update(clock=clock, iteration_speedup={c: base[c] / clock[c] for c in CLOCKS})
        rows.append(row)
        speed = " ".join(f"{c} {v:.2f}x" for c, v in row.get("iteration_speedup", {}).items())
        print(f"try {extra!r}: {steps} iterations, val {row['val']:.4f}, DP {payload:,.0f} B/it "
              f"({row['bytes_ratio']:.0f}x fewer than fp32) {speed}", flush=True)
    return {"baseline_clock": base, "flagship_clock": clocks[FLAGSHIP], "tries": rows}


def equal_time_ratio(rungs: list[dict], seconds: float, clock: str, target: float) -> float | None:
    """The final loss over ``target`` of the longest rung that fits in ``seconds`` on ``clock``."""
    fit = [r for r in rungs if r["time_s"][clock] <= seconds * 1.001]
    return max(fit, key=lambda r: r["steps"])["val_mean"] / target if fit else None


def score(out: dict) -> dict:
    """The race's figures, per clock: the iteration speedup, how many times sooner the flagship
    reaches the baseline's final loss, its loss at the baseline's wall-clock and at the baseline's
    tokens (both annealed) over the baseline's."""
    time_to_baseline(out, BASELINE)
    b, f = out["sides"][BASELINE], out["sides"][FLAGSHIP]
    target, base_t = out["baseline_final_val"], b["rungs"][0]["time_s"]
    out["iteration_speedup"] = {c: b["clock"][c] / f["clock"][c] for c in CLOCKS}
    out["speedup_to_baseline_loss"] = out["sooner_than_baseline"][FLAGSHIP]
    out["equal_time_loss_ratio"] = {c: equal_time_ratio(f["rungs"], base_t[c], c, target) for c in CLOCKS}
    eq = [r for r in f["rungs"] if r["steps"] == out["baseline_steps"]]
    out["equal_tokens_loss_ratio"] = eq[0]["val_mean"] / target if eq else None
    return out


# ---- phase 4: the events run ------------------------------------------------------------------

def event_script(steps: int, placement: list[list[int]]) -> tuple[list[dict], dict]:
    """Faults by node and iteration; when the node joins and when the whole job is killed."""
    kill_it, stop_it = max(2, round(0.15 * steps)), max(3, round(0.25 * steps))
    join_after = max(stop_it + 2, round(0.35 * steps))
    faults = [{"node": placement[1][-1], "kind": "kill", "iteration": kill_it, "delay_s": 0.3},
              {"node": placement[2][-1], "kind": "hang", "iteration": stop_it}]
    return faults, {"join_after": join_after, "whole_kill_after": max(join_after + 2, round(0.55 * steps))}


def first_launch(job: Job, run: Path, plan: dict) -> tuple[list[dict], int]:
    """The events run up to the whole-job kill: its joiner and the kill; (events, iterations done)."""
    events = [{"kind": "kill -9 body replica", "node": f["node"], "iteration": f["iteration"]} if f["kind"] == "kill"
              else {"kind": "SIGSTOP body replica", "node": f["node"], "iteration": f["iteration"]}
              for f in job.meta.get("faults", [])]
    t0, joiner, root = time.time(), None, checkpoint_root(job, "train")
    proc = launch_process(job.save(run.parent / "events-job.json"), run.parent / "events-launch1.log")
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"events run ended before the whole-job kill (exit {proc.returncode}); "
                             f"see {run.parent / 'events-launch1.log'} and {run / 'logs'}")
        done = steps_done(run)
        if joiner is None and done >= plan["join_after"] and (run / "join_secret").exists():
            joiner = spawn_joiner(run, (run / "join_secret").read_text(), "joiner")
            events.append({"kind": "new node joins", "after_iteration": done, "t": time.time() - t0})
        latest = ckstore.latest(root, warn=False)
        if joiner is not None and done >= plan["whole_kill_after"] and latest is not None \
                and CheckpointReader(latest).step >= plan["join_after"]:
            break
        time.sleep(0.05)
    kill_job(proc, run, [joiner])
    shutil.copytree(run, run.parent / "events-before-kill", ignore=shutil.ignore_patterns("checkpoints"))
    return events, done


def events_run(args, s: dict, runner: Runner, settings: list[str], folder: Path) -> dict:
    """Phase 4: the flagship's equal-tokens run (first seed) with every event, against the same
    run without them (kept as ``events.json`` in the work folder)."""
    saved = folder / "events.json"
    if saved.exists():
        return json.loads(saved.read_text())
    steps = s["baseline_steps"]
    ref = runner.train([(settings, steps, 0)])[0]
    cfg = runner.config(settings + [f"checkpoint.every={s['ckpt_every']}", "checkpoint.keep=3",
                                    "checkpoint.final=true"], steps, 0)
    sched = layout(cfg)[2]
    faults, plan = event_script(steps, sched.placement)
    run = folder / f"events-{time.strftime('%H%M%S')}" / "run"
    job = Job(config=cfg.to_dict(), data_path=str(args.data), run_dir=str(run), phases=[phase_of(cfg, "train")],
              **faulty_job(faults))
    events, done = first_launch(job, run, plan)
    rp = resume_point(checkpoint_root(job, "train"))
    events.append({"kind": "whole job SIGKILLed", "after_iteration": done, "resumed_from_iteration": rp["iteration"],
                   "iterations_redone": done - rp["iteration"]})
    truncate_metrics(run / "metrics.jsonl", rp["iteration"])
    job.resume, job.node_module, job.meta = rp, "skiptrain.runtime.node", {}
    log = run.parent / "events-launch2.log"
    proc = launch_process(job.save(run.parent / "events-job-resume.json"), log)
    if proc.wait() != 0:
        raise SystemExit(f"resumed events run failed (exit {proc.returncode}); see {log} and {run / 'logs'}")
    out = events_figures(run, steps, len(sched.micro_batches) * cfg.train.micro_batch, ref, events)
    saved.write_text(json.dumps(out, indent=1))
    return out


def sample_check(run: Path, iterations: int, gb: int) -> tuple[int, int]:
    """(samples lost, samples repeated) over every committed iteration of the job."""
    per_it = trained_samples(run / "phases" / "train")
    flat_ids = [i for it in range(iterations) for i in per_it.get(it, [])]
    return len(set(range(iterations * gb)) - set(flat_ids)), len(flat_ids) - len(set(flat_ids))


def event_details(run: Path, events: list[dict]) -> list[dict]:
    """Each event with the coordinator's record of it (detection, recovery) from the first launch."""
    path = run.parent / "events-before-kill" / "recoveries.jsonl"
    rec = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    out = []
    for ev in events:
        row = dict(ev)
        if "node" in ev:
            mine = [r for r in rec if r.get("node") == ev["node"] and not r.get("join")]
            row.update(detected=bool(mine), detect_s=mine[0].get("detect_s") if mine else None,
                       recover_s=mine[0].get("recover_s") if mine else None)
        elif ev["kind"] == "new node joins":
            j = [r for r in rec if r.get("join") and not r.get("refused")]
            row.update(admitted=bool(j), node=j[0]["node"] if j else None,
                       stage=(j[0].get("choice") or {}).get("stage") if j else None,
                       detect_s=j[0].get("detect_s") if j else None, recover_s=j[0].get("recover_s") if j else None)
        out.append(row)
    return out


def events_figures(run: Path, steps: int, gb: int, ref: dict, events: list[dict]) -> dict:
    """Samples lost and repeated, the final loss against the run without events, and the cost:
    the seconds from the first to the last iteration line, with events less without."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    it = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r and r["step"] == steps]
    lost, rep = sample_check(run, steps, gb)
    span = it[-1]["time"] - it[0]["time"]
    ref_span = ref["time"][-1] - ref["time"][0]
    ref_val = ref["val"][-1][1]
    return {"steps": steps, "samples_lost": lost, "samples_repeated": rep, "val": val[-1] if val else None,
            "val_without_events": ref_val, "loss_ratio": val[-1] / ref_val if val else None,
            "seconds": span, "seconds_without_events": ref_span, "cost_s": span - ref_span,
            "cost_iterations": (span - ref_span) / (ref_span / max(1, len(ref["time"]) - 1)),
            "events": event_details(run, events)}


# ---- output -----------------------------------------------------------------------------------

TARGETS = (("iteration_speedup", "iteration speedup (x)", ">= 2.8", lambda v: v >= 2.8),
           ("speedup_to_baseline_loss", "sooner to the baseline's final loss (x)", ">= 1.5", lambda v: v >= 1.5),
           ("equal_time_loss_ratio", "loss at the baseline's wall-clock / its loss", "<= 1", lambda v: v <= 1.0),
           ("equal_tokens_loss_ratio", "loss at the baseline's tokens / its loss", "<= 1.05", lambda v: v <= 1.05))


def figures(out: dict) -> list[dict]:
    """Each target figure on this machine's clock (measured) and the own-compute clock (the
    simulator's bound for the same setup), and whether the measured one meets it."""
    rows = []
    for key, name, target, ok in TARGETS:
        v = out[key] if isinstance(out[key], dict) else {c: out[key] for c in CLOCKS}
        rows.append({"figure": key, "name": name, "target": target, "machine": v["machine"], "own": v["own"],
                     "met": v["machine"] is not None and ok(v["machine"])})
    return rows


def print_tables(out: dict) -> None:
    print_baseline(out, BASELINE, "iterations")
    print(f"\n{'side':10s} {'stages':>12s} {'s/it here':>9s} {'s/it own':>8s} {'CPU floor':>9s} {'node CPU':>8s} "
          f"{'overruns':>8s} {'DP B/it':>10s}")
    for n, s in out["sides"].items():
        c = s["clock"]
        print(f"{n:10s} {'/'.join(map(str, c['stage_sizes'])):>12s} {c['machine']:9.3f} {c['own']:8.3f} "
              f"{c['host_floor_s']:9.3f} {c['node_cpu_s']:8.3f} {c['overruns']:8d} {c['payload_bytes']:10,.0f}")
    print_rungs(out)
    fmt = lambda v: "not reached" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\n{'figure':46s} {'this machine':>12s} {'own (bound)':>12s} {'target':>8s}  met")
    for r in out["figures"]:
        print(f"{r['name']:46s} {fmt(r['machine']):>12s} {fmt(r['own']):>12s} {r['target']:>8s}  "
              f"{'yes' if r['met'] else 'NO'}")
    print_tuning(out)
    ev = out.get("events_run")
    if ev:
        print(f"\nevents run ({ev['steps']} iterations, first seed): samples lost {ev['samples_lost']}, repeated "
              f"{ev['samples_repeated']}; final val {ev['val']:.4f} vs {ev['val_without_events']:.4f} without events "
              f"({ev['loss_ratio']:.4f}x, target <= 1.005x); cost {ev['cost_s']:.1f} s on this machine "
              f"({ev['seconds']:.1f} s vs {ev['seconds_without_events']:.1f} s, {ev['cost_iterations']:.1f} iterations)")
        for e in ev["events"]:
            extra = {k: (round(e[k], 2) if isinstance(e[k], float) else e[k]) for k in (
                "node", "iteration", "after_iteration", "detect_s", "recover_s", "stage", "resumed_from_iteration",
                "iterations_redone", "admitted") if e.get(k) is not None}
            print(f"  {e['kind']:<24} {extra}")


def plot(out: dict, path: str) -> None:
    """Validation loss against seconds on both clocks: the baseline and every rung of the flagship."""
    n = out["nodes"]
    plot_race(out, path, (f"this machine's clock ({n} node processes on {out['cores']} cores, links emulated)",
                          "own-compute clock (each node its own machine: the simulator)"),
              "seconds on emulated geo12 links")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "shakespeare"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--quick", action="store_true", help="8 nodes, a tiny model: the same path in minutes")
    ap.add_argument("--nodes", type=int, default=None, help="node processes (default 16; quick 8)")
    ap.add_argument("--baseline-steps", type=int, default=None, help="the baseline's iterations (default 150; quick 12)")
    ap.add_argument("--ladder", default=None, help="the flagship's fractions, e.g. 0.5,0.75,1 (default; quick 0.5,1)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds of every rung (default 3; quick 1)")
    ap.add_argument("--last-rung-seeds", type=int, default=None, help="fewer seeds for the flagship's longest rung")
    ap.add_argument("--follow", type=int, default=None, help="edge-of-grid learning-rate steps (default 1; quick 0)")
    ap.add_argument("--time-scale", type=float, default=None, help="emulated / geo12 seconds (default 1/6; quick 1/16)")
    ap.add_argument("--no-tune", action="store_true", help="race at each side's starting settings")
    ap.add_argument("--tune-rungs", action="store_true",
                    help="tune the flagship's grid at every rung's own length (default: once, at the target length)")
    ap.add_argument("--no-freeze", action="store_true", help="the flagship without elastic freezing")
    ap.add_argument("--no-events", action="store_true", help="skip the events run")
    ap.add_argument("--keep", default=None, help="work folder (its records are reused); default a new runs/bench folder")
    ap.add_argument("--any-code", action="store_true",
                    help="reuse the work folder's learning records whatever code trained them (default: only this "
                         "code's; a timed run is always this code's)")
    ap.add_argument("--flagship-set", default=None, metavar="OVERRIDES",
                    help="replace the flagship's own settings, e.g. 'dp.strategy=powersgd' (space-separated)")
    ap.add_argument("--try", dest="try_", action="append", default=None, metavar="OVERRIDES",
                    help="no race: one flagship run (first seed, emulation off) with these space-separated overrides "
                         "in place of the flagship's, e.g. 'train.lr=1e-3 dp.topk=16'; repeatable")
    ap.add_argument("--try-steps", type=int, default=None, help="length of --try runs (default: the tuning length)")
    ap.add_argument("--try-timing", action="store_true", help="also time each --try set with links emulated")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="loss-vs-seconds PNG (default: next to --json)")
    return ap.parse_args(argv)


def write_json(args, out: dict) -> int:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    s = settings(args)
    data = Path(args.data)
    if not (data / "manifest.json").is_file():
        raise SystemExit(f"no prepared data set at {data}: run `skiptrain prepare` (or `make demo`) first")
    base = common(args, s, TokenDataset.open(data).vocab_size)
    t0 = time.time()
    with work_dir(args.keep, "flagship_race") as folder:
        print(f"work folder {folder}; {platform.machine()}, Python {platform.python_version()}; {s['nodes']} node "
              f"processes, baseline {s['baseline_steps']} iterations, ladder {s['ladder']}, freezing "
              f"{'on' if s['freeze'] else 'off'}", flush=True)
        runner = Runner(folder, functools.partial(run_config, args, base), functools.partial(race_launch, args),
                        any_code=args.any_code, any_code_ok=lambda key: "runtime.wan=true" not in key)
        if args.try_:
            return write_json(args, explore(args, s, runner))
        out = score(race(args, s, runner))
        if not args.no_events:
            out["events_run"] = events_run(args, s, runner, out["sides"][FLAGSHIP]["settings"], folder)
    ev = out.get("events_run") or {}
    cfg = runner.config(out["sides"][FLAGSHIP]["settings"], s["baseline_steps"], 0)
    out.update(figures=None, events=ev.get("events"), samples_lost=ev.get("samples_lost"),
               samples_repeated=ev.get("samples_repeated"), nodes=s["nodes"], cores=len(os.sched_getaffinity(0)),
               quick=args.quick, seeds=s["seeds"], freezing=s["freeze"], time_scale=s["time_scale"], wall_s=time.time() - t0,
               model={k: getattr(cfg.model, k) for k in ("d_model", "n_layers", "seq_len", "vocab_size")},
               tokens_per_iteration=len(layout(cfg)[2].micro_batches) * cfg.train.micro_batch * cfg.model.seq_len)
    out["figures"] = figures(out)
    print_tables(out)
    write_json(args, out)
    if args.plot or args.json:
        plot(out, args.plot or str(Path(args.json).with_suffix(".png")))
    print(f"\ntotal {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
