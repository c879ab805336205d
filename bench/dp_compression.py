"""Bench: time to AdamW's loss on consumer links, raced fairly by compressed data parallelism.

N=8 node processes of the runtime (one stage holding the whole model, N replicas, gloo on
127.0.0.1, one torch thread each) train the same model on the same real text (data/shakespeare,
BPE 4096) with the same tokens per step, data order and seeds on every side; only the sync
strategy and its settings differ.  The baseline is AdamW + a dense fp32 all-reduce.

Three phases:

1. **Timing** (links emulated, real processes): every side runs a few whole sync periods with
   ``dp.link=consumer`` (10 Mbit/s up, 100 Mbit/s down, 25 ms per node; the transport sleeps for
   the ring collective's time computed from the real bytes).  Two clocks per step come out of it:
   *this machine's* (the measured wall seconds between iterations, every node process sharing
   this machine's cores) and *own compute* (the emulated link seconds plus one node's CPU
   seconds: each replica on a machine of its own).
2. **Tuning** (emulation off): every side's learning rate (and SparseLoCo's H and outer momentum)
   on the same small grid, at the side's target length, first seed, one coordinate at a time.
3. **Race** (emulation off): the baseline at its length, each compressed side on a ladder of
   lengths (fractions of the steps that fit in the baseline's wall-clock on this machine's
   clock), every run with its own cosine schedule over its own length (warm-up 2.5%), every
   seed.  Each run is placed on both clocks (steps x seconds per step).  A side's time to the
   baseline is the shortest rung whose annealed final validation loss (mean over seeds) is at or
   below the baseline's (mean over seeds), in seconds on each clock.

The model is the ``small`` preset narrowed to d_model 128 and 4 layers (1.8M parameters).
Records are kept as they arrive in ``records.jsonl`` of the work folder; ``--keep DIR`` reuses a
folder's records (a run cut short goes on where it stopped).

    .venv/bin/python bench/dp_compression.py --json runs/bench/dp_race.json --plot docs/img/dp_race.png
    .venv/bin/python bench/dp_compression.py --quick --json runs/bench/dp_race_quick.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.dp import LINK_PRESETS  # noqa: E402
from skiptrain.runtime.job import Job, data_parallel_phase, with_runtime  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402
from bench._race import (CLOCKS, Runner, Side, lrs, plot_race, print_baseline, print_rungs, print_tuning, rung,  # noqa: E402
                        rung_steps, seconds_per_step, time_to_baseline, timing_steps, tune, untuned)

NARROW = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2"]
QUICK = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=64",
         "train.eval_batches=4"]


SIDES = {
    "adamw": Side("AdamW + fp32 all-reduce", ["dp.strategy=allreduce"], {"lr": lrs(1e-3, 2e-3, 4e-3)},
                  start={"lr": 1}),
    "sparseloco": Side("SparseLoCo (2-bit values, 12-bit indices)",
                       ["dp.strategy=sparseloco", "dp.indices=u12", "dp.values=sign2", "dp.outer_lr=1"],
                       {"lr": lrs(1e-3, 2e-3, 4e-3),
                        "H": [["dp.sync_every=5", "dp.topk=40"], ["dp.sync_every=10", "dp.topk=80"]],
                        "outer_momentum": [["dp.outer_momentum=0.5"], ["dp.outer_momentum=0"]]},
                       ladder=(0.1, 0.15, 0.2), tune_at=0.15, start={"lr": 1, "H": 0, "outer_momentum": 0}),
    "demo": Side("DeMo (k=8, 1-bit signs, 12-bit indices)",
                 ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign1"],
                 {"lr": lrs(2e-3, 4e-3, 8e-3)}, ladder=(0.1, 0.2, 0.3), tune_at=0.2, start={"lr": 0}),
}
BASELINE = "adamw"


# ---- running ----------------------------------------------------------------------------------

def dp_config(args, base: list[str], overrides: list[str], steps: int, seed: int):
    """A run's config: the bench's base, validation every tenth of the run (quick: quarter),
    warm-up 2.5%, then the run's own overrides, length and seed."""
    every = max(1, steps // (4 if args.quick else 10))
    return build_config("small", overrides=base + [
        f"train.eval_every={every}", f"train.warmup_steps={max(1, round(0.025 * steps))}"] + overrides + [
        f"train.steps={steps}", f"train.seed={1234 + seed}"])


def dp_launch(args, cfgs: list, run_dir: Path) -> list[dict]:
    """The runs ``cfgs`` as phases of one launch of ``args.nodes`` replicas; their records."""
    n = args.nodes
    phases = [data_parallel_phase(c, f"m{i}", n) for i, c in enumerate(cfgs)]
    job = Job(config=with_runtime(cfgs[0].to_dict(), timeout_s=max(c.dp.timeout_s for c in cfgs)),
              data_path=str(args.data), run_dir=str(run_dir), phases=phases)
    res = launch(job, timeout_s=6 * 3600, echo=False)
    return [phase_record(res, run_dir, ph.name, n) for ph in phases]


def phase_record(res, run_dir: Path, phase: str, nodes: int) -> dict:
    """One phase's record: iteration times (row clock and measured), CPU seconds, validation
    points, the byte summary.  A phase whose replicas differ at the end is an error."""
    rows = res.phase_metrics(phase)
    summ = [json.loads((run_dir / "phases" / phase / f"node{r}.json").read_text())["sync_summary"] for r in range(nodes)]
    if len({tuple(s["param_hashes"]) for s in summ}) != 1:
        raise SystemExit(f"{run_dir}: phase {phase}: replicas are not identical at the end")
    it = [r for r in rows if "loss" in r]
    return {"time": [r["time"] for r in it], "iteration_s": [r["iteration_s"] for r in it],
            "cpu_s": [r["cpu_s"] for r in it], "loss": [r["loss"] for r in it],
            "val": [[r["step"], r["val_loss"]] for r in rows if "val_loss" in r],
            "summary": {k: summ[0][k] for k in ("payload_bytes_per_step", "payload_bytes_per_sync",
                                                  "ratio_payload_vs_fp32", "emulated_link_s", "n_params")}}


# ---- phase 1: timing --------------------------------------------------------------------------

def sync_period(overrides: list[str]) -> int:
    cfg = build_config("small", overrides=overrides)
    return cfg.dp.sync_every if cfg.dp.strategy in ("diloco", "sparseloco", "demo") else 1


def timing(args, runner: Runner, overrides_by_name: dict[str, list[str]], link: str) -> dict[str, dict]:
    """Phase 1 for every distinct timing setting (``name -> overrides``); one launch."""
    runs, periods = [], {}
    for name, ov in overrides_by_name.items():
        periods[name] = sync_period(ov)
        k = timing_steps(periods[name], args.quick)
        runs.append((ov + [f"dp.link={link}", "train.eval_every=0", "train.eval_batches=1"], k, 0))
    cores = len(os.sched_getaffinity(0))
    return {name: seconds_per_step(rec, periods[name], args.nodes, cores)
            for name, rec in zip(overrides_by_name, runner.train(runs))}


def timing_key(side: Side, choice: dict[str, int]) -> str:
    """Only H changes a side's time per step; lr and momentum do not."""
    return f"{side.label}|{side.grid['H'][choice['H']] if 'H' in side.grid else ''}"


def timed_choices(side: Side) -> list[dict[str, int]]:
    """The side's starting choice with each value of H (the one axis that changes its time)."""
    return [{**side.start, "H": i} for i in range(len(side.grid["H"]))] if "H" in side.grid else [dict(side.start)]


# ---- phases 2 and 3: the race ------------------------------------------------------------------------

def race(args, runner: Runner, sides: list[str]) -> dict:
    ref = SIDES[BASELINE]
    choices = {n: dict(SIDES[n].start) for n in sides}
    # 1. timing: every setting of every side that changes its time per step (H), in one launch
    clocks = timing(args, runner, {timing_key(SIDES[n], c): SIDES[n].settings(c) for n in sides
                                   for c in timed_choices(SIDES[n])}, args.link)
    base_s = args.baseline_steps * clocks[timing_key(ref, choices[BASELINE])]["machine"]
    out = {"baseline_steps": args.baseline_steps, "baseline_machine_s": base_s, "sides": {}}
    for n in sides:
        side = SIDES[n]
        period = sync_period(side.settings(choices[n]))
        c0 = clocks[timing_key(side, choices[n])]
        steps = args.baseline_steps if n == BASELINE else min(
            args.max_steps, rung_steps(side.tune_at, base_s, c0["machine"], period))
        tuning = tune(runner, side, steps) if not args.no_tune else untuned(side)
        choices[n] = tuning["choice"]
        clock, settings = clocks[timing_key(side, choices[n])], side.base + tuning["winner"]
        period = sync_period(settings)
        if n == BASELINE:
            rungs = [rung(runner, settings, args.baseline_steps, args.seeds, clock, None)]
        else:
            seeds = args.seeds_of.get(n, args.seeds)
            rungs = [rung(runner, settings, min(args.max_steps, rung_steps(f, base_s, clock["machine"], period)),
                          seeds, clock, f) for f in side.ladder]
        out["sides"][n] = {"label": side.label, "settings": settings, "clock": clock, "tuning": tuning, "rungs": rungs,
                           "bytes": runner.recs[runner.key(settings, rungs[0]["steps"], 0)]["summary"]}
    return out


def score(out: dict) -> dict:
    """The race's figures: per side and clock the time to the baseline's final loss, and how
    many times sooner than the baseline."""
    time_to_baseline(out, BASELINE)
    out["ratio_vs_fp32"] = {n: s["bytes"]["ratio_payload_vs_fp32"] for n, s in out["sides"].items()}
    return out


# ---- output -----------------------------------------------------------------------------------

def print_tables(out: dict) -> None:
    print_baseline(out, BASELINE, "steps")
    print(f"\n{'side':12s} {'B/step':>9s} {'x fp32':>7s} {'s/step here':>11s} {'s/step own':>10s} {'link s':>7s} "
          f"{'CPU floor':>9s}")
    for n, s in out["sides"].items():
        c, b = s["clock"], s["bytes"]
        print(f"{n:12s} {b['payload_bytes_per_step']:9,.0f} {b['ratio_payload_vs_fp32']:7.1f} {c['machine']:11.3f} "
              f"{c['own']:10.3f} {c['link_s']:7.3f} {c['host_floor_s']:9.3f}")
    print_rungs(out)
    print(f"\n{'side':12s} {'to baseline here':>18s} {'sooner':>7s} {'to baseline own':>16s} {'sooner':>7s}  winner")
    for n in out["sides"]:
        t, x = out["time_to_baseline_s"][n], out["sooner_than_baseline"][n]
        cells = [(f"{t[c]:.0f} s" if t[c] else "not reached", f"{x[c]:.1f}x" if x[c] else "-") for c in CLOCKS]
        print(f"{n:12s} {cells[0][0]:>18s} {cells[0][1]:>7s} {cells[1][0]:>16s} {cells[1][1]:>7s}  "
              f"{' '.join(out['tuning'][n]['winner'])}")
    print_tuning(out)


def plot(out: dict, path: str) -> None:
    """Validation loss against seconds on both clocks: every rung of every side, first seed."""
    plot_race(out, path, ("this machine's clock (8 replicas on 2 cores)",
                          "own-compute clock (each replica its own machine)"), "seconds on consumer links")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/shakespeare")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny model and lengths (a few minutes)")
    ap.add_argument("--sides", default="adamw,sparseloco,demo", help=f"comma list of {list(SIDES)} (the baseline first)")
    ap.add_argument("--baseline-steps", type=int, default=None, help="steps of the baseline (default 240; quick 16)")
    ap.add_argument("--max-steps", type=int, default=None, help="cap on any run's steps (default none; quick 48)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds of every rung (default 3; quick 1)")
    ap.add_argument("--seeds-of", default="", help="fewer seeds for a compressed side's ladder, e.g. demo=1")
    ap.add_argument("--no-tune", action="store_true", help="race at each side's starting settings")
    ap.add_argument("--link", default="consumer", choices=sorted(LINK_PRESETS), help="dp.link preset of the timing")
    ap.add_argument("--keep", default=None, help="work folder (its records are reused); default a new runs/bench folder")
    ap.add_argument("--any-code", action="store_true",
                    help="reuse the work folder's records whatever code trained them (default: only this code's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="loss-vs-seconds PNG (default: next to --json)")
    args = ap.parse_args(argv)
    args.baseline_steps = args.baseline_steps or (16 if args.quick else 240)
    args.max_steps = args.max_steps or (48 if args.quick else 10**9)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.seeds_of = {k: int(v) for k, v in (x.split("=") for x in args.seeds_of.split(",") if x)}
    return args


def main(argv=None) -> int:
    from _workdir import work_dir

    args = parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    if sides[:1] != [BASELINE] or any(s not in SIDES for s in sides):
        raise SystemExit(f"--sides: {BASELINE} first, then any of {list(SIDES)}; got {args.sides!r}")
    ds = TokenDataset.open(args.data)
    base = (QUICK if args.quick else NARROW + ["train.eval_batches=32"]) + [
        f"model.vocab_size={ds.vocab_size}", "model.n_stages=1", f"train.n_micro={args.nodes}",
        f"train.micro_batch={max(1, 16 // args.nodes)}", "dp.check_every=25", "train.progress=false"]
    t0 = time.time()
    with work_dir(args.keep, "dp_race") as folder:
        print(f"work folder {folder}", flush=True)
        out = score(race(args, Runner(folder, functools.partial(dp_config, args, base),
                                             functools.partial(dp_launch, args), any_code=args.any_code), sides))
    cfg = build_config("small", overrides=base)
    link = LINK_PRESETS[args.link]
    out.update(nodes=args.nodes, quick=args.quick, seeds=args.seeds, wall_s=time.time() - t0,
               params=out["sides"][BASELINE]["bytes"]["n_params"], seq_len=cfg.model.seq_len,
               global_batch_samples=cfg.train.micro_batch * cfg.train.n_micro,
               links={"preset": args.link, "up_mbps": link.up_mbps, "down_mbps": link.down_mbps,
                      "latency_ms": link.latency_ms, "per": "node"})
    print_tables(out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot or args.json:
        plot(out, args.plot or str(Path(args.json).with_suffix(".png")))
    print(f"\ntotal {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
