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

Then the same preset as a 4-node swarm sharing that one GPU: four node processes on this machine
(``skiptrain.runtime.launcher``), one per stage (1/1/1/1, the full pipeline, k = 0), every node on
``cuda:0`` (``runtime.devices``), bf16 autocast, bf16 activations and gradients between the nodes
through pinned host buffers over gloo on loopback.  Its tokens/s are the global batch over the
median iteration time rank 0 records (common start to the last event: pipeline, transfers,
replica-free optimizer step), and, lower, over the median period between iteration starts (which
adds the swarm's per-iteration start barrier and stats gather).  Four processes time-share the
GPU, so this shows what a swarm's machinery costs on one device, not a speed-up.

    python bench/gpu.py [--quick] [--json PATH] [--peak-tflops T] [--no-swarm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workdir import work_dir  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0}
SWARM_NODES = 4


def peak_tflops(name: str, given: float | None) -> float | None:
    if given:
        return given
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def make_dataset(vocab_size: int, out: Path):
    """The test excerpts as byte tokens, presented to the model as ids of ``vocab_size`` ids,
    written under ``out``."""
    from skiptrain.data.corpus import read_documents
    from skiptrain.data.dataset import TokenDataset, write_dataset

    data = ROOT / "tests" / "data"
    write_dataset(out, read_documents([str(data / "hamlet_excerpt.txt"), str(data / "macbeth_excerpt.txt")]),
                  None, tokenizer="byte", val_fraction=0.1, source="test excerpts")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = vocab_size       # on disk too: a swarm's nodes open it
    (out / "manifest.json").write_text(json.dumps(manifest))
    return TokenDataset.open(out)


def build(preset: str, device: str, quick: bool, overrides: dict | None, tmp: Path):
    """The skiptrain Trainer and a plain loop over the same config, data (written under ``tmp``)
    and device."""
    from skiptrain.config import build_config
    from skiptrain.train.trainer import Trainer

    train = {"eval_every": 0, "progress": False, "device": device, "skip_ratio": 0.0}
    if quick:
        train.update(micro_batch=4, n_micro=2)
    cfg = build_config(preset, overrides={"train": train, **(overrides or {})})
    ds = make_dataset(cfg.model.vocab_size, tmp)
    trainer = Trainer(cfg, dataset=ds)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _plain_loop import plain_step

    return trainer, plain_step(cfg, ds, trainer.device)


def train_flops_per_token(cfg) -> float:
    from skiptrain.model.partition import head_flops_per_token, layer_flops_per_token

    return 3.0 * (cfg.n_layers * layer_flops_per_token(cfg) + head_flops_per_token(cfg))


def measure(preset: str = "125m", device: str = "cuda", steps: int = 20, warmup: int = 3, quick: bool = False,
            overrides: dict | None = None, keep: str | Path | None = None) -> dict:
    """Median step time of both loops, interleaved; tokens/s and model FLOPs/s of each.  Its run
    goes to ``keep`` (default: a new folder under runs/bench/gpu)."""
    with work_dir(keep, "gpu") as tmp:
        return timed(*build(preset, device, quick, overrides, Path(tmp)), steps, warmup, preset)


def timed(trainer, plain_step, steps: int, warmup: int, preset: str) -> dict:
    """Both loops' step times, interleaved, and what they give per second."""
    import torch

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


def measure_swarm(preset: str = "125m", device: str = "cuda", iterations: int = 12, warmup: int = 2,
                  quick: bool = False, overrides: dict | None = None, keep: str | Path | None = None) -> dict:
    """A 4-node swarm (one stage each) with every node on ``device``: median iteration time and
    period, tokens/s and model FLOPs/s (see the module doc).  Its run goes to ``keep`` (default:
    a new folder under runs/bench/gpu-swarm)."""
    from skiptrain.config import build_config
    from skiptrain.runtime.job import Job, build_cost, build_schedule, build_topology, phase_for
    from skiptrain.runtime.launcher import launch

    train = {"eval_every": 0, "progress": False, "device": "cpu" if device == "cpu" else "cuda", "skip_ratio": 0.0,
             "steps": warmup + iterations}
    if quick:
        train.update(micro_batch=4)
    sections = {"train": train, "model": {"n_stages": SWARM_NODES},
                "runtime": {"nodes": SWARM_NODES, "stage_sizes": ",".join(["1"] * SWARM_NODES),
                            "mb_per_originator": 2 if quick else 8, "timeout_s": 120,
                            "devices": ",".join([device] * SWARM_NODES)}}
    for name, values in (overrides or {}).items():
        sections[name] = {**sections.get(name, {}), **values}
    cfg = build_config(preset, overrides=sections)
    with work_dir(keep, "gpu-swarm") as tmp:
        ds = make_dataset(cfg.model.vocab_size, Path(tmp) / "data")
        cfg.model.vocab_size = ds.vocab_size
        topo = build_topology(cfg, SWARM_NODES)
        cost = build_cost(cfg, s_per_sample_layer=0.001)
        sched = build_schedule(cfg, "full_pipeline", topo, cost)
        run = Path(tmp) / "run"
        res = launch(Job(config=cfg.to_dict(), data_path=str(ds.path), run_dir=str(run),
                         phases=[phase_for(cfg, sched, topo, cost, "swarm", warmup + iterations)]), timeout_s=1800)
        rows = res.phase_iterations("swarm")[warmup:]
        t0 = [it["t0"] for it in json.loads((run / "phases" / "swarm" / "node0.json").read_text())["iterations"]]
    tokens = len(sched.micro_batches) * cfg.train.micro_batch * cfg.model.seq_len
    it_s = statistics.median(r["iteration_s"] for r in rows)
    period = statistics.median(b - a for a, b in zip(t0[warmup:], t0[warmup + 1:]))
    flops = train_flops_per_token(cfg.model)
    return {"nodes": SWARM_NODES, "devices": cfg.runtime.devices, "tokens_per_iteration": tokens,
            "iterations": len(rows), "median_iteration_s": it_s, "median_period_s": period,
            "tok_s": tokens / it_s, "model_tflops": tokens / it_s * flops / 1e12, "tok_s_period": tokens / period,
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def print_table(res: dict, peak: float | None) -> None:
    gpu = f" ({res['gpu']})" if res.get("gpu") else ""
    print(f"{res['preset']} ({res['params'] / 1e6:.0f}M parameters, {res['precision']}) on {res['device']}{gpu}, "
          f"{res['tokens_per_step']} tokens/step, {res['steps']} steps")
    print(f"{'loop':<30}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
    for which, label in (("skiptrain", "skiptrain Trainer, 1 node"), ("plain", "plain PyTorch loop")):
        r = res[which]
        mfu = f"{r['model_tflops'] / peak * 100:.1f}%" if peak else "n/a"
        print(f"{label:<30}{r['tok_s']:>12.0f}{r['model_tflops']:>10.1f}{mfu:>8}")
    sw = res.get("swarm")
    if sw is None:
        print(f"{'4-node swarm, one GPU':<30}  not measured (--no-swarm)")
    else:
        mfu = f"{sw['model_tflops'] / peak * 100:.1f}%" if peak else "n/a"
        print(f"{'4-node swarm, one GPU':<30}{sw['tok_s']:>12.0f}{sw['model_tflops']:>10.1f}{mfu:>8}"
              f"   ({sw['tokens_per_iteration']} tokens/iteration; {sw['tok_s_period']:.0f} tokens/s with the start barrier)")
    print(f"skiptrain overhead (median of paired step-time ratios - 1): {res['overhead'] * 100:+.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batch and fewer steps")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per loop (default 20, quick 5)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's peak dense bf16 TFLOP/s, for GPUs not in the built-in table")
    ap.add_argument("--no-swarm", action="store_true", help="skip the 4-node swarm sharing the GPU")
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
    if not args.no_swarm:
        res["swarm"] = measure_swarm("125m", "cuda:0", iterations=steps, quick=args.quick)
    print_table(res, peak)
    if args.json:
        Path(args.json).write_text(json.dumps({"cuda": True, "measured": True, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
