"""Trainer overhead: skiptrain's training loop against a minimal hand-written PyTorch loop.

Same model (the `small` preset), same data (the prepared Shakespeare set), same optimizer
(fused AdamW), same global batch.  Both loops live in one process and their steps are
interleaved (A B B A ...), so that the machine's noise hits both alike; the skiptrain side is
what ``Trainer.fit`` does per step (``train_step`` plus its metrics line).  Peak memory is the
resident high-water mark of a separate process running only one loop.

    python bench/trainer_speed.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ensure_data(path: Path) -> None:
    if not (path / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "skiptrain.cli", "prepare", "--out", str(path)], check=True)


def build_pair(data: str, threads: int, which: str = "both"):
    """The skiptrain Trainer (or None) and a minimal hand-written loop over the same model config and data."""
    import torch

    from skiptrain.config import build_config
    from skiptrain.data.dataset import TokenDataset
    from skiptrain.train.trainer import Trainer

    torch.set_num_threads(threads)
    cfg = build_config("small", overrides={"data": {"path": data}, "train": {
        "eval_every": 0, "progress": False, "threads": threads}})
    ds = TokenDataset.open(data)
    cfg.model.vocab_size = ds.vocab_size
    trainer = Trainer(cfg, dataset=ds) if which != "reference" else None
    if which == "skiptrain":
        return trainer, None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _plain_loop import plain_step

    return trainer, plain_step(cfg, ds)


def trainer_step(trainer, log) -> None:
    """What Trainer.fit does per step: the step itself plus its metrics line."""
    r = trainer.train_step()
    log.write(step=trainer.step, loss=round(r.loss, 5), lr=r.lr, grad_norm=round(r.grad_norm, 4))


def speed(data: str, steps: int, warmup: int, threads: int) -> dict:
    """Both loops in one process, steps interleaved A B A B, so machine noise hits both alike."""
    from skiptrain.train.metrics import MetricsLog

    trainer, reference_step = build_pair(data, threads)
    ts, tr = [], []
    with tempfile.TemporaryDirectory() as d:
        log = MetricsLog(Path(d) / "metrics.jsonl")
        for i in range(warmup + steps):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for which in order:
                t0 = time.perf_counter()
                trainer_step(trainer, log) if which == 0 else reference_step(i)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    (ts if which == 0 else tr).append(dt)
        log.close()
    # Medians, not means: on a shared machine a single step can be stretched many-fold by load
    # spikes; the median of the paired per-step ratios is what the overhead figure reports.
    tokens = trainer.tokens_per_step
    return {"skiptrain_tok_s": tokens / statistics.median(ts), "reference_tok_s": tokens / statistics.median(tr),
            "step_ratio_median": statistics.median(a / b for a, b in zip(ts, tr))}


def peak_memory(method: str, data: str, steps: int, threads: int) -> float:
    """Resident high-water mark (MB) of a process running only one of the loops."""
    trainer, reference_step = build_pair(data, threads, which=method)
    if method == "skiptrain":
        from skiptrain.train.metrics import MetricsLog

        with tempfile.TemporaryDirectory() as d:
            log = MetricsLog(Path(d) / "m.jsonl")
            for _ in range(steps):
                trainer_step(trainer, log)
            log.close()
    else:
        for i in range(steps):
            reference_step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (about a minute)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--data", default=str(ROOT / "data" / "shakespeare"))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 30)
    warmup = 2
    ensure_data(Path(args.data))
    if args.worker:
        print(json.dumps({"peak_mb": peak_memory(args.worker, args.data, 2, args.threads)}))
        return
    res = speed(args.data, steps, warmup, args.threads)
    mem = {}
    for m in ("skiptrain", "reference"):
        out = subprocess.run([sys.executable, __file__, "--worker", m, "--data", args.data,
                              "--threads", str(args.threads)], check=True, capture_output=True, text=True).stdout
        mem[m] = json.loads(out.strip().splitlines()[-1])["peak_mb"]
    sk, ref = res["skiptrain_tok_s"], res["reference_tok_s"]
    overhead = res["step_ratio_median"] - 1
    print(f"{'loop':<22}{'tokens/s (median step)':>24}{'peak MB':>10}")
    print(f"{'skiptrain Trainer':<22}{sk:>24.0f}{mem['skiptrain']:>10.0f}")
    print(f"{'hand-written loop':<22}{ref:>24.0f}{mem['reference']:>10.0f}")
    print(f"framework overhead (median of paired per-step time ratios - 1): {overhead * 100:+.1f}% "
          f"(target <= 10%); {steps} interleaved steps after {warmup} warm-up, "
          f"{args.threads} threads, `small` preset")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "skiptrain_tok_s": sk, "reference_tok_s": ref, "peak_mb": mem["skiptrain"],
            "reference_peak_mb": mem["reference"], "overhead": overhead,
            "step_ratio_median": res["step_ratio_median"], "steps": steps, "threads": args.threads}, indent=1))


if __name__ == "__main__":
    main()
