"""GPU throughput: skiptrain's one-node trainer against a plain PyTorch loop, tokens/s and MFU.

Needs CUDA: without a CUDA device it prints that and exits 0, measuring nothing.

With CUDA, both loops train the ``125m`` preset (134M parameters, LLaMA shapes, bf16 autocast,
fp32 master weights, fused AdamW, same global batch) in one process, their steps interleaved
(A B B A ...) so the GPU's clocks and the machine's noise hit both alike; every step ends with
``torch.cuda.synchronize()``.  The skiptrain side is ``Trainer.train_step`` (its executor, the
one optimizer step with the global clip); the plain loop is what a PyTorch user writes by hand.
Tokens are the bytes of the test excerpts (tests/data) presented as ids of the preset's 32000-token
vocabulary: throughput does not depend on which ids are fed.

MFU = model FLOPs per second / the GPU's peak dense bf16 FLOPs.  Model FLOPs per token are
3 x the forward FLOPs of the cost model (:func:`skiptrain.model.partition.layer_flops_per_token`
per layer plus the head), the usual 6N-plus-attention count.  The peak comes from a table of known
GPUs (``--peak-tflops`` for others; without it MFU is not printed).

The 4-node swarm sharing one GPU is listed but not measured: node processes
(skiptrain/runtime/node.py) do not yet place their stage on a device, so a swarm runs on the CPU.

    python bench/gpu.py [--quick] [--json PATH] [--peak-tflops T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0}
SWARM_NOTE = "not measured: node processes do not place their stage on a device yet"


def peak_tflops(name: str, given: float | None) -> float | None:
    if given:
        return given
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def make_dataset(vocab_size: int):
    """The test excerpts as byte tokens, presented to the model as ids of ``vocab_size`` ids."""
    from skiptrain.data.corpus import read_documents
    from skiptrain.data.dataset import TokenDataset, write_dataset

    out = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    data = ROOT / "tests" / "data"
    write_dataset(out, read_documents([str(data / "hamlet_excerpt.txt"), str(data / "macbeth_excerpt.txt")]),
                  None, tokenizer="byte", val_fraction=0.1, source="test excerpts")
    ds = TokenDataset.open(out)
    ds.manifest = {**ds.manifest, "tokenizer": {**ds.manifest["tokenizer"], "vocab_size": vocab_size}}
    return ds


def build(preset: str, device: str, quick: bool, overrides: dict | None = None):
    """The skiptrain Trainer and a plain loop over the same config, data and device."""
    from skiptrain.config import build_config
    from skiptrain.train.trainer import Trainer

    train = {"eval_every": 0, "progress": False, "device": device, "skip_ratio": 0.0}
    if quick:
        train.update(micro_batch=4, n_micro=2)
    cfg = build_config(preset, overrides={"train": train, **(overrides or {})})
    ds = make_dataset(cfg.model.vocab_size)
    trainer = Trainer(cfg, dataset=ds)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _plain_loop import plain_step

    return trainer, plain_step(cfg, ds, trainer.device)


def train_flops_per_token(cfg) -> float:
    from skiptrain.model.partition import head_flops_per_token, layer_flops_per_token

    return 3.0 * (cfg.n_layers * layer_flops_per_token(cfg) + head_flops_per_token(cfg))


def measure(preset: str = "125m", device: str = "cuda", steps: int = 20, warmup: int = 3, quick: bool = False,
            overrides: dict | None = None) -> dict:
    """Median step time of both loops, interleaved; tokens/s and model FLOPs/s of each."""
    import torch

    trainer, plain_step = build(preset, device, quick, overrides)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"skiptrain": [], "plain": []}
    for i in range(warmup + steps):
        for which in (("skiptrain", "plain") if i % 2 == 0 else ("plain", "skiptrain")):
            sync()
            t0 = time.perf_counter()
            trainer.train_step() if which == "skiptrain" else plain_step(i)
            sync()
            if i >= warmup:
                times[which].append(time.perf_counter() - t0)
    tokens = trainer.tokens_per_step
    flops = train_flops_per_token(trainer.cfg.model)
    out = {"preset": preset, "device": str(trainer.device), "params": trainer.model.num_parameters(),
           "tokens_per_step": tokens, "steps": steps, "precision": trainer.cfg.train.precision}
    for which, ts in times.items():
        tok_s = tokens / statistics.median(ts)
        out[which] = {"tok_s": tok_s, "model_tflops": tok_s * flops / 1e12, "median_step_s": statistics.median(ts)}
    out["overhead"] = statistics.median(a / b for a, b in zip(times["skiptrain"], times["plain"])) - 1
    return out


def print_table(res: dict, peak: float | None) -> None:
    gpu = f" ({res['gpu']})" if res.get("gpu") else ""
    print(f"{res['preset']} ({res['params'] / 1e6:.0f}M parameters, {res['precision']}) on {res['device']}{gpu}, "
          f"{res['tokens_per_step']} tokens/step, {res['steps']} steps")
    print(f"{'loop':<30}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
    for which, label in (("skiptrain", "skiptrain Trainer, 1 node"), ("plain", "plain PyTorch loop")):
        r = res[which]
        mfu = f"{r['model_tflops'] / peak * 100:.1f}%" if peak else "n/a"
        print(f"{label:<30}{r['tok_s']:>12.0f}{r['model_tflops']:>10.1f}{mfu:>8}")
    print(f"{'4-node swarm, one GPU':<30}  {SWARM_NOTE}")
    print(f"skiptrain overhead (median of paired step-time ratios - 1): {res['overhead'] * 100:+.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batch and fewer steps")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per loop (default 20, quick 5)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's peak dense bf16 TFLOP/s, for GPUs not in the built-in table")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device; this torch sees none, so nothing was measured.")
        if args.json:
            Path(args.json).write_text(json.dumps({"cuda": False, "measured": False}) + "\n")
        return 0
    steps = args.steps or (5 if args.quick else 20)
    res = measure("125m", "cuda", steps=steps, warmup=2 if args.quick else 3, quick=args.quick)
    res["gpu"] = torch.cuda.get_device_name(0)
    peak = peak_tflops(res["gpu"], args.peak_tflops)
    for which in ("skiptrain", "plain"):
        res[which]["mfu"] = res[which]["model_tflops"] / peak if peak else None
    res["swarm_4_nodes_one_gpu"] = SWARM_NOTE
    print_table(res, peak)
    if args.json:
        Path(args.json).write_text(json.dumps({"cuda": True, "measured": True, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
