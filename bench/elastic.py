"""Elastic pipelining by freezing: real runs on this machine + the simulator at 16 devices.

Both halves compute *time to a target validation loss* (the baseline's final loss x 1.01) at an
equal token budget for (a) the best static configuration of a sweep (stages x replicas x
micro-batches that fit the device memory), (b) plain data parallelism (when it fits), (c) the
elastic run, plus the paper's ablation (freeze only, +AutoPipe, +AutoPipe+AutoCache,
+AutoPipe+AutoDP, all).

Real half (this machine, real text, data/shakespeare, 1 thread):
  * optionally a shared pre-training phase (``--pretrain`` steps on the training text beyond the
    fine-tuning set, untimed): PipeTransformer's regime is fine-tuning a pre-trained model;
    ``--pretrain 0`` trains from scratch;
  * three trainers from one config and one initial state, stepped *interleaved* (the noisy,
    shared CPU slows them alike): baseline (the plain trainer: every static configuration and
    plain DP compute exactly this), freeze only (elastic, cache off), elastic (cache auto).
    Losses, steps to the target, the freeze schedule, layouts, transitions, guard time and
    every step's CPU seconds are measured;
  * per-node compute is *emulated*: 16 nodes do not fit on 2 cores, so a layout's iteration time
    is the event simulator (skiptrain.schedule, 1F1B lanes, ring all-reduce of the active
    parameters) run with per-layer costs **measured here** (forward, backward, head, cache read,
    optimizer per parameter; profiled every ``--profile-every`` steps, each cost the least of the
    profiles).  The emulation is checked against the measured single-process
    step times (same costs, one node) -- the overlap between the two halves.
Simulated half (paper scale): a 32-layer d=2048 LM on 16 devices (2 machines x 8), analytic
  costs (FLOPs at 40% of an RTX 5000), the real run's freeze schedule and cache hit rate mapped
  by layer fraction, steps to the target from the real runs.

Memory: the static sweep keeps configurations whose largest stage fits a device (paper scale:
24 GiB under the model of ``sim_memory``; small scale: the largest stage of the 4-stage start,
in AutoPipe's units), the same budget AutoPipe shrinks the elastic pipeline under.

    .venv/bin/python bench/elastic.py --json runs/bench/elastic.json
    .venv/bin/python bench/elastic.py --quick --json runs/bench/elastic_quick.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workdir import work_dir  # noqa: E402

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset, write_splits  # noqa: E402
from skiptrain.elastic.costs import (N_DEV, Scale, elastic_times, iteration, paper_scale, prefill_seconds,  # noqa: E402
                                     sim_topology, small_scale, sweep)
from _elastic_trainer import ElasticTrainer  # noqa: E402
from skiptrain.optim import build_adamw  # noqa: E402
from skiptrain.train.trainer import Trainer  # noqa: E402
from bench.elastic_swarm import GUARD_REF, GUARD_WINDOWS, print_swarm, swarm_half  # noqa: E402


# ---------------------------------------------------------------------------------------------
# real half


def subset(path: str, first: int, count: int | None, seq_len: int, source: str = "train") -> TokenDataset:
    """The dataset with the training split cut to windows ``first .. first+count`` (all when None).

    ``source="ood"``: a domain shift -- training windows come from the out-of-distribution text
    (Milton) and validation from its last ``OOD_VAL`` fraction, which training never reads."""
    ds = TokenDataset.open(path)
    full = ds.tokens
    a = first * seq_len
    b = None if count is None else a + count * seq_len + 1
    if source == "train":
        ds.tokens = lambda split: full(split)[a:b] if split == "train" else full(split)  # type: ignore[method-assign]
        return ds
    if not ds.has_split(source):
        raise SystemExit(f"--finetune {source}: the data set at {path} has no {source!r} split; "
                         f"re-run `skiptrain prepare --out {path}`")
    src = full(source)
    cut = int(len(src) * (1 - OOD_VAL))
    if b is not None and b > cut:
        raise SystemExit(f"--windows {count}: the {source!r} text has only {(cut - a - 1) // seq_len} training "
                         f"windows of {seq_len} tokens; lower --windows")
    ds.tokens = lambda split: src[a:min(b or cut, cut)] if split == "train" else src[cut:]  # type: ignore[method-assign]
    return ds


OOD_VAL = 0.05
REAL_MICRO_BATCH = 4      # windows per micro-batch of the real half


def real_config(args, steps: int, elastic: dict | None):
    base = {"data": {"path": args.data},
            "model": {"d_model": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64,
                      "n_stages": 4, "stage0_layers": -1},
            "train": {"steps": steps, "micro_batch": REAL_MICRO_BATCH, "n_micro": 4, "lr": args.lr, "warmup_steps": args.warmup,
                      "eval_every": 0, "eval_batches": args.eval_batches, "progress": False, "seed": args.seed},
            "checkpoint": {"every": 0, "final": False}}
    return build_config(overrides={**base, **({"elastic": elastic} if elastic else {})})


def real_runs(args) -> dict:
    """The baseline, freeze-only and elastic trainers side by side, in a temporary directory."""
    torch.set_num_threads(1)
    with work_dir(None, "elastic") as tmp:
        return real_runs_in(args, Path(tmp))


def real_runs_in(args, tmp: Path) -> dict:
    steps = args.steps
    init = None
    pre_s = 0.0
    if args.pretrain:
        init, pre_s = pretrain(args, tmp)
    el = {"enabled": True, "alpha": args.alpha, "check_every": args.check_every, "tol": args.tol,
          "min_active": 2, "start_window": args.start_window, "stable_windows": args.stable_windows,
          "guard": True, "guard_tol": args.guard_tol, "guard_confirm": args.guard_confirm,
          "guard_ref": GUARD_REF, "guard_min_ref": args.guard_min_ref,
          "guard_batches": GUARD_WINDOWS // REAL_MICRO_BATCH}
    trainers = {}
    for name, e in [("baseline", None), ("freeze_only", {**el, "cache": "off"}),
                    ("elastic", {**el, "cache": "auto", "cache_dir": str(tmp / "cache")})]:
        cfg = real_config(args, steps, e)
        ds = subset(args.data, 0, args.windows, cfg.model.seq_len, args.finetune)
        trainers[name] = (ElasticTrainer(cfg, tmp / name, dataset=ds, n_nodes=N_DEV) if e
                          else Trainer(cfg, tmp / name, dataset=ds))
        if init is not None:
            trainers[name].model.load_state_dict(init)
    first = trainers["baseline"]
    spent = {n: 0.0 for n in trainers}      # CPU seconds of the training thread
    curves = {n: [] for n in trainers}
    losses = {n: [] for n in trainers}
    step_s = {n: [] for n in trainers}
    frozen = {n: [] for n in trainers}
    hits = []  # per step of the elastic run: (frozen, cache hit fraction, cache on)
    samples = []  # per-node cost profiles taken through the run (least_loaded picks from them)
    el_tr = trainers["elastic"]
    prev = (0, 0, 0)
    for step in range(1, steps + 1):
        for n, tr in trainers.items():
            frozen[n].append(tr.frozen)
            if n == "elastic":
                cached_now = el_tr.runner.enabled
            c0 = time.thread_time()
            r = tr.train_step()
            dt = time.thread_time() - c0
            spent[n] += dt
            step_s[n].append(dt)
            losses[n].append(r.loss)
        c = el_tr.cache.stats() if el_tr.cache is not None else {"hits": 0, "misses": 0, "extended": 0}
        cur = (c["hits"], c["misses"], c["extended"])
        d = [a - b for a, b in zip(cur, prev)]
        prev = cur
        hits.append((frozen["elastic"][-1], d[0] / sum(d) if sum(d) else 0.0, cached_now))
        if step % args.eval_every == 0 or step == steps:
            for n, tr in trainers.items():
                curves[n].append({"step": step, "train_s": round(spent[n], 3), "val_loss": round(tr.validate(), 5)})
        if step % 100 == 0:
            print(f"  step {step}/{steps}: " + ", ".join(f"{n} {curves[n][-1]['val_loss'] if curves[n] else 0:.3f}"
                                                         f" {spent[n]:.1f}s F={frozen[n][-1]}" for n in trainers), flush=True)
        if args.profile_every and step % args.profile_every == 0 and step < steps:
            samples.append(profile_costs(first, tmp / "probe", reps=5))
    samples.append(profile_costs(first, tmp / "probe"))
    costs = least_loaded(samples)
    return {"steps": steps, "windows": first.train_src.n, "epochs": round(steps * 16 / first.train_src.n, 2),
            "pretrain_steps": args.pretrain, "pretrain_s": round(pre_s, 1),
            "params": first.model.num_parameters(), "curves": curves, "train_s": {n: round(v, 3) for n, v in spent.items()},
            "bit_identical_freeze_vs_cache": losses["freeze_only"] == losses["elastic"],
            "layouts": [l.to_dict() for l in el_tr.layouts], "transitions": el_tr.transitions,
            "decisions": el_tr.rule.history, "guard_s": round(el_tr.guard_cpu_s, 4),
            "guard_s_freeze_only": round(trainers["freeze_only"].guard_cpu_s, 4),
            "transition_s": round(sum(t["cpu_s"] for t in el_tr.transitions), 4),
            "prefill_s": round(sum(t.get("prefill", {}).get("cpu_s", 0.0) for t in el_tr.transitions), 4),
            "cache": el_tr.cache.stats() if el_tr.cache else None, "prefix_hits": hits,
            "step_s": step_s, "frozen": frozen, "costs": costs, "model": first.cfg.model, "init": init}


def pretrain(args, tmp: Path) -> tuple[dict, float]:
    """The shared, untimed pre-training (lr 3e-3, 20 warm-up steps) -> (model state, seconds).

    On the Shakespeare training text beyond the fine-tuning windows (``--finetune train``) or all
    of it (``--finetune ood``: the fine-tuning text is Milton).  Deterministic, so the state is
    kept under ``--pretrain-cache`` keyed by everything that determines it and reused."""
    cfg = real_config(args, args.pretrain, None)
    cfg.train.lr, cfg.train.warmup_steps = 3e-3, 20
    first = args.windows if args.finetune == "train" else 0
    mf = json.loads((Path(args.data) / "manifest.json").read_text())
    key = hashlib.sha256(json.dumps([args.pretrain, first, cfg.model.__dict__, [d["sha256"] for d in mf["documents"]],
                                     torch.__version__, args.seed], sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(args.pretrain_cache) / f"pretrain-{key}.pt" if args.pretrain_cache else None
    if path is not None and path.is_file():
        blob = torch.load(path, weights_only=True)
        print(f"  pre-trained {args.pretrain} steps: reused {path} (val loss {blob['val_loss']:.4f}, "
              f"{blob['seconds']:.0f}s when made)", flush=True)
        return blob["state"], blob["seconds"]
    t0 = time.perf_counter()
    pre = Trainer(cfg, tmp / "pretrain", dataset=subset(args.data, first, None, cfg.model.seq_len))
    for _ in range(args.pretrain):
        pre.train_step()
    state = {k: v.detach().clone() for k, v in pre.model.state_dict().items()}
    secs, val = time.perf_counter() - t0, pre.validate()
    print(f"  pre-trained {args.pretrain} steps in {secs:.0f}s, val loss {val:.4f}", flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state": state, "seconds": secs, "val_loss": val}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return state, secs


def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        c0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - c0)
    return statistics.median(ts)


def profile_costs(tr, probe_dir: Path, reps: int = 15) -> dict:
    """Per-sample seconds on this machine, 1 thread: a layer's forward (no autograd), its forward +
    backward, the head (norm, logits, loss) forward + backward, reading a cached row, and the
    optimizer per parameter.  These are the emulated nodes' compute costs."""
    m, t = tr.model, tr.cfg.train
    b = t.micro_batch
    x, y = tr.train_src.batch(list(range(b)))
    with torch.no_grad():
        h0 = m.tok_emb(x)
    layer = m.layers["3"]

    def fwd():
        with torch.no_grad():
            layer(h0, m.rope_cos, m.rope_sin)

    def fwd_bwd():
        h = h0.clone().requires_grad_(True)
        layer(h, m.rope_cos, m.rope_sin).sum().backward()

    def head():
        h = h0.clone().requires_grad_(True)
        m.loss(m.logits(h), y).backward()

    rows = np.lib.format.open_memmap(probe_dir.with_suffix(".npy"), mode="w+", dtype=np.float32,
                                     shape=(64,) + tuple(h0.shape[1:]))
    rows[:] = 1.0
    rows.flush()
    ids = [3, 17, 40, 9]

    def read():
        torch.from_numpy(np.ascontiguousarray(rows[ids]))

    import copy
    mc = copy.deepcopy(m)
    oc = build_adamw(list(mc.named_parameters()), tr.cfg.train)
    n_params = sum(p.numel() for p in mc.parameters())
    for p in mc.parameters():
        p.grad = torch.zeros_like(p)

    f = _median_time(fwd, reps) / b
    fb = _median_time(fwd_bwd, reps) / b
    hd = _median_time(head, reps) / b
    rd = _median_time(read, reps) / len(ids)
    op = _median_time(oc.step, 5) / n_params
    for p in m.parameters():
        p.grad = None
    return {"fwd_s": f, "fwd_bwd_s": fb, "backward_factor": max(fb - f, 0.0) / f, "head_s": hd, "read_s": rd,
            "opt_s_per_param": op}


def least_loaded(samples: list[dict]) -> dict:
    """Per-node costs from profiles taken through the run: each cost's minimum over them.

    An emulated node is a device of its own, but the profiles run on a shared, loaded machine
    (other benchmarks, the other trainers' memory traffic); load only ever adds time, so the
    least of several samples is the closest to a dedicated node's cost.  One profile at the end,
    as before, made a layer's forward 1.3-2.3 ms and the backward factor 1.5-2.5 between runs of
    the same decisions, and the emulated speed-up moved by +-0.15 with them.  The backward
    factor is recomputed from the two minima."""
    keys = ("fwd_s", "fwd_bwd_s", "head_s", "read_s", "opt_s_per_param")
    out = {k: min(s[k] for s in samples) for k in keys}
    out["backward_factor"] = max(out["fwd_bwd_s"] - out["fwd_s"], 0.0) / out["fwd_s"]
    out["profiles"] = len(samples)
    return out


def time_to(curve: list[dict], target: float) -> int | None:
    for p in curve:
        if p["val_loss"] <= target:
            return p["step"]
    return None


# ---------------------------------------------------------------------------------------------

VARIANTS = {"freeze_only": dict(repartition=False, replicas=False, cache=False),
            "+autopipe": dict(repartition=True, replicas=False, cache=False),
            "+autopipe+autocache": dict(repartition=True, replicas=False, cache=True),
            "+autopipe+autodp": dict(repartition=True, replicas=True, cache=False),
            "all": dict(repartition=True, replicas=True, cache=True)}


def half(sc: Scale, real: dict, steps_b: int | None, steps_e: int | None, topo, overhead,
         other_targets: dict[str, tuple[int | None, int | None]] | None = None) -> dict:
    """Sweep, best static, plain DP and the elastic variants of one half; times to the target.

    ``other_targets`` (name -> steps to it of the baseline and the elastic run): the full
    elastic run's speed-up at other target levels, the sensitivity of the headline figure."""
    sw = sweep(sc, topo)
    feasible = [r for r in sw if r["iteration_s"] is not None]
    if not feasible:
        raise SystemExit(f"{sc.name} scale: no static configuration fits the device memory; "
                         "raise DEV memory or shrink the model in bench/elastic.py")
    best = min(feasible, key=lambda r: r["iteration_s"])
    dp = min((r for r in feasible if r["stages"] == 1), key=lambda r: r["iteration_s"], default=None)
    static_tt = best["iteration_s"] * steps_b if steps_b else None
    static_total = best["iteration_s"] * len(real["prefix_hits"])
    dp_tt = dp["iteration_s"] * steps_b if (dp and steps_b) else None
    out = {"sweep": sw, "best_static": best, "plain_dp": dp, "variants": {}, "static_total_s": static_total,
           "time_to_target_s": {"best_static": static_tt, "plain_dp": dp_tt}}
    expected = {t["step"]: t.get("expected_hit", 1.0) for t in real["transitions"]}
    gone = {t["step"]: bool(t.get("autopipe", {}).get("prefix_cached")) for t in real["transitions"]}

    def elapsed(e: dict, upto: int | None) -> float | None:
        """The elastic run's seconds up to step ``upto``: its steps and its overhead."""
        return sum(e["per_step"][:upto]) + overhead(sc, e, best, upto) if upto else None

    for k, v in VARIANTS.items():
        e = elastic_times(sc, real["prefix_hits"], real["model"].n_layers, best, topo, **v, expected_hit=expected,
                          prefix_cached=gone)
        extra = overhead(sc, e, best, steps_e)
        tt = elapsed(e, steps_e)
        total = elapsed(e, len(e["per_step"]))
        out["variants"][k] = {"time_to_target_s": tt, "total_s": total, "overhead_s": extra,
                              "prefill_s": prefill_seconds(sc, real, len(e["per_step"])) if v["cache"] else 0.0,
                              "whole_run_speedup_vs_best_static": round(static_total / total, 3),
                              "speedup_vs_best_static": round(static_tt / tt, 3) if (tt and static_tt) else None,
                              "speedup_vs_plain_dp": round(dp_tt / tt, 3) if (tt and dp_tt) else None,
                              "history": e["history"], "wire_s": e["wire_s"]}
        if k == "all":
            out["speedup_by_target"] = {}
            for name, (sb, se) in (other_targets or {}).items():
                t_e = elapsed(e, se)
                out["speedup_by_target"][name] = {
                    "steps_baseline": sb, "steps_elastic": se,
                    "speedup_vs_best_static": round(best["iteration_s"] * sb / t_e, 3) if (sb and t_e) else None}
    return out


def print_half(title: str, h: dict) -> None:
    print(f"\n{title}")
    print("static sweep (s/iteration; - = does not fit in device memory):")
    for S in (1, 2, 4, 8, 16):
        row = [r for r in h["sweep"] if r["stages"] == S]
        if row:
            print(f"  S={S:<2} R={N_DEV // S:<2} " + "  ".join(
                f"M={r['n_micro']}: {r['iteration_s']:.4g}" if r["iteration_s"] else f"M={r['n_micro']}: -" for r in row))
    b, dp = h["best_static"], h["plain_dp"]
    print(f"best static: S={b['stages']} R={b['replicas']} M={b['n_micro']} {b['iteration_s']:.4g} s/it; plain DP: "
          + ("does not fit" if dp is None else f"M={dp['n_micro']} {dp['iteration_s']:.4g} s/it"))
    print("elastic layouts (step: frozen, stages x replicas, micro-batches): " + ", ".join(
        f"{x['step']}: {x['frozen']}, {len(x['counts'])}x{x['replicas']}, M={x['n_micro']}"
        for x in h["variants"]["all"]["history"]))
    tts = h["time_to_target_s"]
    fmt = lambda t: f"{t:.4g}s" if t else "-"  # noqa: E731
    print(f"{'config':<28} {'time to target':>14} {'vs best static':>15} {'whole run':>10} {'vs best static':>15}")
    print(f"{'best static':<28} {fmt(tts['best_static']):>14} {'1.00x':>15} {fmt(h['static_total_s']):>10} {'1.00x':>15}")
    if tts["plain_dp"]:
        print(f"{'plain DP':<28} {fmt(tts['plain_dp']):>14} {tts['best_static'] / tts['plain_dp']:>14.2f}x")
    else:
        print(f"{'plain DP':<28} {'n/a (OOM)':>14}")
    for k, v in h["variants"].items():
        sp = v["speedup_vs_best_static"]
        print(f"{'elastic ' + k:<28} {fmt(v['time_to_target_s']):>14} {(f'{sp:.2f}x' if sp else '-'):>15} "
              f"{fmt(v['total_s']):>10} {v['whole_run_speedup_vs_best_static']:>14.2f}x")


def run_swarm(args, best: dict, init: dict | None) -> dict:
    """The swarm half on the real half's fine-tuning windows (written as a derived data set the
    node processes open by path), from ``init`` (pre-trained weights; None: from scratch)."""
    seeds = [args.seed] if args.quick else [int(x) for x in args.swarm_seeds.split(",")]
    ft = subset(args.data, 0, args.windows, 64, args.finetune)
    with work_dir(None, "elastic-data") as tmp:
        data = write_splits(tmp, ft, {"train": ft.tokens("train"), "val": ft.tokens("val")},
                            f"{args.windows} fine-tuning windows of {args.data} ({args.finetune})")
        return swarm_half(args, best, seeds, args.swarm_iterations, str(data.path), init)


def swarm_only(args) -> int:
    """``--swarm-only S,R,M``: the swarm half alone, against that static layout."""
    t_start = time.time()
    S, R, M = (int(x) for x in args.swarm_only.split(","))
    init = None
    if args.pretrain:
        torch.set_num_threads(1)
        with work_dir(None, "elastic") as tmp:
            init, _ = pretrain(args, Path(tmp))
    swarm = run_swarm(args, {"stages": S, "replicas": R, "n_micro": M}, init)
    print_swarm(swarm)
    print(f"\nbench {time.time() - t_start:.0f}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"swarm": swarm, "bench_seconds": round(time.time() - t_start, 1),
                                         "args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()}}, indent=1, default=str))
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the ``--quick`` / full defaults resolved."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default=str(ROOT / "data" / "shakespeare"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--pretrain", type=int, default=None, help="pre-training steps before the timed runs (0 = from scratch)")
    ap.add_argument("--windows", type=int, default=1024, help="training samples of the timed runs (multi-epoch)")
    ap.add_argument("--finetune", choices=("train", "ood"), default="train",
                    help="fine-tuning text: Shakespeare windows held out of pre-training (train) or Milton (ood: "
                         "a domain shift, validated on Milton's last 5%%)")
    ap.add_argument("--pretrain-cache", default=str(ROOT / "runs" / "bench" / "pretrain"),
                    help="directory keeping pre-trained states for reuse ('' = never keep)")
    ap.add_argument("--seed", type=int, default=1234, help="model init, data order (pre-training and fine-tuning)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--alpha", type=float, default=0.5,
                    help="freeze bound per window (the paper: 1/3 safe, 1/2 faster; the guard bounds the loss)")
    ap.add_argument("--tol", type=float, default=0.2)
    ap.add_argument("--stable-windows", type=int, default=2)
    ap.add_argument("--start-window", type=int, default=3)
    ap.add_argument("--guard-tol", type=float, default=0.003)
    ap.add_argument("--guard-confirm", type=int, default=1,
                    help="consecutive windows above the guard's projection before it undoes a freeze")
    ap.add_argument("--guard-min-ref", type=int, default=2,
                    help="unfrozen validation points after the learning-rate warm-up before anything freezes")
    ap.add_argument("--check-every", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--profile-every", type=int, default=50,
                    help="steps between per-node cost profiles (the least of them is used; 0 = one at the end)")
    ap.add_argument("--eval-batches", type=int, default=8,
                    help="validation micro-batches (of 4 windows) per point of the loss curves that set the target")
    ap.add_argument("--swarm-iterations", type=int, default=None,
                    help="iterations per phase of the 16-process swarm runs (default: --steps, the real half's "
                         "budget, so the rule sees as many windows; 0 = no swarm half)")
    ap.add_argument("--swarm-seeds", default="1234,3,7", help="seeds of the swarm runs (--quick: --seed only)")
    ap.add_argument("--swarm-check-every", type=int, default=None, help="the swarm's freeze-rule and validation window (iterations; default 5)")
    ap.add_argument("--swarm-warmup", type=int, default=None, help="the swarm's learning-rate warm-up (iterations; default: --warmup)")
    ap.add_argument("--swarm-spl", type=float, default=None,
                    help="emulated seconds per sample per layer forward in the swarm (compute is padded to it; "
                         "default 0.05, --quick 0.02)")
    ap.add_argument("--swarm-timeout", type=float, default=None, help="seconds per launch (default: 10 per iteration)")
    ap.add_argument("--swarm-cache", choices=("on", "off"), default="on",
                    help="the swarm's activation cache (on: the originators serve the frozen prefix from it, "
                         "prefilled at a freeze when the rows will be read often enough)")
    ap.add_argument("--swarm-cache-share", choices=("location", "node"), default="location",
                    help="with the cache on: one cache per machine of the swarm's topology (2 x 8), shared by its "
                         "originators, each window prefilled once per machine (location), or one per node")
    ap.add_argument("--swarm-prefill-min-gain", type=float, default=1.0,
                    help="the swarm prefills a new layout's cache only when the simulated iteration time it saves "
                         "until the end is at least this many times the prefill's (elastic.prefill_min_gain; "
                         "0 = at every freeze)")
    ap.add_argument("--swarm-prefill-hold", type=int, default=1,
                    help="windows a new frozen depth must hold before the swarm prefills its cache "
                         "(elastic.prefill_hold; 0 = at the freeze)")
    ap.add_argument("--swarm-guard-windows", type=int, default=GUARD_WINDOWS,
                    help="validation windows of the swarm's guard check (default: the real half's, 4 micro-batches of 4)")
    ap.add_argument("--swarm-keep", default="", help="keep the swarm's run directories under this path")
    ap.add_argument("--swarm-only", default="", metavar="S,R,M",
                    help="run only the swarm half, against the static layout S stages x R replicas x M "
                         "micro-batches (the real half's best static configuration, e.g. 4,4,4), from the same "
                         "pre-trained weights (--pretrain-cache) and fine-tuning windows")
    args = ap.parse_args(argv)
    # --quick: the same code path on a short budget -- windows of 5 so that the rule freezes,
    # transitions and (in the swarm) prefills its cache within 60 steps
    for k, quick, full in [("steps", 60, 400), ("pretrain", 50, 400), ("check_every", 5, 10),
                           ("eval_every", 5, 10), ("lr", 1e-3, 1e-3), ("warmup", 5, 20),
                           ("swarm_spl", 0.02, 0.05)]:
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    # the swarm runs the real half's budget and warm-up, its rule in windows of 5 iterations (80
    # samples each): the guard's reference points are then 25 and 30, so freezing can start at 30
    for k, like in (("swarm_iterations", args.steps), ("swarm_check_every", 5), ("swarm_warmup", args.warmup)):
        if getattr(args, k) is None:
            setattr(args, k, like)
    if args.swarm_timeout is None:
        args.swarm_timeout = max(600.0, 10.0 * args.swarm_iterations)
    if args.data and not (Path(args.data) / "manifest.json").is_file():
        raise SystemExit(f"--data {args.data}: no prepared data set there (run `skiptrain prepare` first)")
    return args


def print_real(real: dict, final: dict, target: float, st: dict, sec: dict) -> None:
    """The 1-node table: final validation loss, steps and CPU seconds to the target per run, then
    the freeze schedule, the decisions and the elastic run's overheads."""
    print(f"\nREAL, 1 node (this machine, 1 thread, measured CPU seconds of the training thread; "
          f"target val loss {target} = baseline final x 1.01)")
    print(f"{'run':<12} {'final val':>9} {'vs base':>8} {'train s':>8} {'steps→tgt':>9} {'s→tgt':>7} {'speed-up':>8}")
    for n in final:
        sp = sec["baseline"] / sec[n] if (sec[n] and sec["baseline"]) else None
        print(f"{n:<12} {final[n]:>9.4f} {final[n] / final['baseline']:>8.4f} {real['train_s'][n]:>8.1f} "
              f"{str(st[n]):>9} {(f'{sec[n]:.1f}' if sec[n] else '-'):>7} {(f'{sp:.2f}x' if sp else '-'):>8}")
    print("freeze schedule (step: frozen/stages x replicas): "
          + ", ".join(f"{l['step']}: {l['frozen']}/{len(l['counts'])}x{l['replicas']}" for l in real["layouts"]))
    acts = [d for d in real["decisions"] if d["action"] in ("freeze", "undo")]
    print("freeze decisions: " + (", ".join(f"{d['step']} {d['action']} {d['frozen_before']}->{d['frozen_after']}"
                                            for d in acts) or "none"))
    print(f"transitions {real['transition_s']:.3f}s + cache prefill {real['prefill_s']:.3f}s + guard validation "
          f"{real['guard_s']:.3f}s of "
          f"{real['train_s']['elastic']:.1f}s; cache {real['cache']}; freeze-only == elastic losses "
          f"bit-identical: {real['bit_identical_freeze_vs_cache']}")


def overlap_check(real: dict, small: Scale, topo) -> list[dict]:
    """The 1-node emulation (the measured costs, S=1 R=1 M=4) against the measured median step,
    per run and frozen count with at least 3 steps; printed, and returned for the JSON."""
    co = real["costs"]
    print(f"\nmeasured costs per sample: layer fwd {co['fwd_s'] * 1e3:.3f} ms, backward x{co['backward_factor']:.2f}, "
          f"head fwd+bwd {co['head_s'] * 1e3:.3f} ms, cached row read {co['read_s'] * 1e3:.4f} ms, "
          f"AdamW {co['opt_s_per_param'] * 1e9:.2f} ns/param (least of {co['profiles']} profiles through the run)")
    print("overlap: 1-node emulation (same costs, S=1 R=1 M=4) vs the measured median step, per frozen count:")
    overlap = []
    for n, hitw in (("baseline", False), ("freeze_only", False), ("elastic", True)):
        for F in sorted(set(real["frozen"][n])):
            idx = [i for i, f in enumerate(real["frozen"][n]) if f == F]
            if len(idx) < 3:
                continue
            hit = statistics.median(real["prefix_hits"][i][1] for i in idx) if (hitw and F) else 0.0
            meas = statistics.median(real["step_s"][n][i] for i in idx)
            pred = iteration(small, [small.model.n_layers], F, 1, 4, hit, topo, check_mem=False)
            overlap.append({"run": n, "frozen": F, "hit": round(hit, 3), "measured_s": round(meas, 5),
                            "emulated_s": round(pred, 5), "ratio": round(pred / meas, 3)})
            print(f"  {n:<12} F={F} hit={hit:.2f}: measured {meas * 1e3:7.1f} ms, emulated {pred * 1e3:7.1f} ms "
                  f"({pred / meas:.2f}x)")
    return overlap


def elastic_overhead(real: dict, sc: Scale, e: dict, best, upto: int | None, cpu: bool = True) -> float:
    """Seconds the elastic run spends outside its steps up to step ``upto``: the transitions
    (their measured CPU on the small scale, and the wire time of their transfers), the cache
    prefills (:func:`prefill_seconds`, variants with the cache) and the guard's validation
    passes (16 samples spread over the replicas of the layout in force at each check; the
    guard keeps its windows' frozen-prefix outputs, see
    ElasticTrainer._guard_from_prefix, so a check runs the active layers and the head, and
    the prefix once per new depth)."""
    if not upto:
        return 0.0
    trans = sum(t["cpu_s"] for t in real["transitions"] if t["step"] <= upto) if cpu else 0.0
    wire = sum(h.get("wire_s", 0.0) for h in e["history"] if h["step"] <= upto)
    L, L_real = sc.model.n_layers, real["model"].n_layers
    head_fwd = sc.head_s / (1 + sc.backward_factor)
    g, kept = 0.0, None
    for d in real["decisions"]:
        if d["step"] <= upto and d["val_loss"] is not None:
            # the check precedes the transition it may trigger: the layout before that step
            R = max((h for h in e["history"] if h["step"] < d["step"] or h["step"] == 0),
                    key=lambda h: h["step"])["replicas"]
            F = round(d["frozen_before"] / L_real * L)
            layers = (L - F) + (F if F and F != kept else 0)
            kept = F or None
            g += math.ceil(16 / R) * (layers * sc.fwd_s + head_fwd)
    return trans + wire + g + (prefill_seconds(sc, real, upto) if e["cache"] else 0.0)


def target_levels(c: dict, final: dict) -> tuple[dict, dict]:
    """The headline target's sensitivity: other levels of the baseline's final loss and of its
    best (it overfits late); (levels, steps to each for baseline and elastic)."""
    best_b = min(p["val_loss"] for p in c["baseline"])
    levels = {f"final x {m}": final["baseline"] * m for m in (1.005, 1.01, 1.02, 1.03)}
    levels.update({f"best x {m}": best_b * m for m in (1.01, 1.02)})
    return levels, {k: (time_to(c["baseline"], v), time_to(c["elastic"], v)) for k, v in levels.items()}


def print_levels(levels: dict, em: dict, paper: dict) -> None:
    """The speed-up at each of the other target levels, emulated and simulated."""
    print("\nspeed-up to other target levels (steps baseline / elastic: emulated, sim):")
    for k, v in levels.items():
        a, b = em["speedup_by_target"][k], paper["speedup_by_target"][k]
        print(f"  {k:<16} {v:.4f}: steps {a['steps_baseline']} / {a['steps_elastic']}: "
              f"{a['speedup_vs_best_static']}x, {b['speedup_vs_best_static']}x")


def result_of(args, real: dict, target: float, final: dict, st: dict, sec: dict, em: dict, paper: dict,
              levels: dict, others: dict, overlap: list, swarm: dict | None, t_start: float) -> dict:
    """The JSON of the whole bench."""
    c = real["curves"]
    ev, pv = em["variants"]["all"], paper["variants"]["all"]
    return {
        "speedup_vs_best_static": ev["speedup_vs_best_static"],
        "speedup_vs_best_static_sim": pv["speedup_vs_best_static"],
        "final_loss_ratio": round(final["elastic"] / final["baseline"], 5),
        "transition_fraction": round((ev["total_s"] and (sum(t["cpu_s"] for t in real["transitions"]) + ev["wire_s"])
                                      / ev["total_s"]), 6),
        "transition_fraction_sim": round(pv["wire_s"] / pv["total_s"], 6),
        "transition_fraction_real_1node": round(real["transition_s"] / real["train_s"]["elastic"], 6),
        "prefill_fraction": round(ev["prefill_s"] / ev["total_s"], 6),
        "prefill_fraction_sim": round(pv["prefill_s"] / pv["total_s"], 6),
        "prefill_fraction_real_1node": round(real["prefill_s"] / real["train_s"]["elastic"], 6),
        "guard_fraction_real_1node": round(real["guard_s"] / real["train_s"]["elastic"], 6),
        "whole_run_speedup_vs_best_static": ev["whole_run_speedup_vs_best_static"],
        "whole_run_speedup_vs_best_static_sim": pv["whole_run_speedup_vs_best_static"],
        "ablation": {k: v["speedup_vs_best_static"] for k, v in em["variants"].items()},
        "ablation_whole_run": {k: v["whole_run_speedup_vs_best_static"] for k, v in em["variants"].items()},
        "ablation_sim": {k: v["speedup_vs_best_static"] for k, v in paper["variants"].items()},
        "speedup_vs_plain_dp": ev["speedup_vs_plain_dp"],
        "speedup_by_target": {k: {"target_val_loss": round(v, 5),
                                  "emulated": em["speedup_by_target"][k]["speedup_vs_best_static"],
                                  "sim": paper["speedup_by_target"][k]["speedup_vs_best_static"],
                                  "steps": others[k]} for k, v in levels.items()},
        "real": {"target_val_loss": target, "final_val_loss": final, "train_cpu_s": real["train_s"],
                 "steps_to_target": st, "seconds_to_target_1node": sec,
                 "speedup_to_target_1node": {n: (round(sec["baseline"] / sec[n], 3) if sec[n] and sec["baseline"] else None)
                                             for n in sec},
                 "whole_run_speedup_1node": {n: round(real["train_s"]["baseline"] / real["train_s"][n], 3) for n in c},
                 "bit_identical_freeze_vs_cache": real["bit_identical_freeze_vs_cache"],
                 "pretrain_steps": real["pretrain_steps"], "pretrain_s": real["pretrain_s"],
                 "layouts": real["layouts"], "decisions": real["decisions"], "transitions": real["transitions"],
                 "cache": real["cache"], "curves": c, "windows": real["windows"], "epochs": real["epochs"],
                 "params": real["params"], "costs": real["costs"], "overlap": overlap,
                 "guard_s": real["guard_s"], "transition_s": real["transition_s"], "prefill_s": real["prefill_s"]},
        "emulated": em, "sim": paper, "swarm": swarm,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "bench_seconds": round(time.time() - t_start, 1),
    }


def print_summary(result: dict) -> None:
    print(f"\nspeedup_vs_best_static {result['speedup_vs_best_static']} (16 emulated nodes) / "
          f"{result['speedup_vs_best_static_sim']} (paper-scale sim); whole run at equal tokens "
          f"{result['whole_run_speedup_vs_best_static']} / {result['whole_run_speedup_vs_best_static_sim']}; "
          f"speedup_vs_plain_dp {result['speedup_vs_plain_dp']}; "
          f"final_loss_ratio {result['final_loss_ratio']}; transition_fraction {result['transition_fraction']} "
          f"(emulated) / {result['transition_fraction_sim']} (sim) / {result['transition_fraction_real_1node']} "
          f"(1 node, + guard {result['guard_fraction_real_1node']}); cache prefill {result['prefill_fraction']} "
          f"(emulated) / {result['prefill_fraction_sim']} (sim) / {result['prefill_fraction_real_1node']} (1 node); "
          f"bench {result['bench_seconds']:.0f}s")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.swarm_only:
        return swarm_only(args)
    t_start = time.time()
    print(f"real runs: {'pre-train ' + str(args.pretrain) + ' steps, then ' if args.pretrain else ''}"
          f"{args.steps} steps on {args.windows} samples of 64 tokens of "
          f"{'Shakespeare' if args.finetune == 'train' else 'Milton (domain shift)'}, 3 trainers interleaved", flush=True)
    real = real_runs(args)
    c = real["curves"]
    final = {n: c[n][-1]["val_loss"] for n in c}
    target = round(final["baseline"] * 1.01, 5)
    st = {n: time_to(c[n], target) for n in c}
    sec = {n: (sum(real["step_s"][n][:st[n]]) if st[n] else None) for n in c}
    print_real(real, final, target, st, sec)

    # ---- emulated 16 nodes with the measured costs, and the overlap check -------------------
    small = small_scale(real)
    topo = sim_topology()
    overlap = overlap_check(real, small, topo)
    overhead = functools.partial(elastic_overhead, real)
    levels, others = target_levels(c, final)
    em = half(small, real, st["baseline"], st["elastic"], topo, overhead, others)
    print_half("REAL, 16 emulated nodes (losses and steps from the runs above; per-node compute measured on "
               "this machine; device memory = largest stage of the 4-stage start)", em)
    paper = half(paper_scale(), real, st["baseline"], st["elastic"], topo, functools.partial(overhead, cpu=False),
                 others)
    print_half("SIMULATED, paper scale (32 layers d=2048, 16 devices = 2 machines x 8, 24 GiB each, global "
               "batch 128 x 1024 tokens; freeze schedule mapped by layer fraction)", paper)
    print_levels(levels, em, paper)
    swarm = None
    if args.swarm_iterations:
        swarm = run_swarm(args, em["best_static"], real["init"])
        print_swarm(swarm)
    result = result_of(args, real, target, final, st, sec, em, paper, levels, others, overlap, swarm, t_start)
    print_summary(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
