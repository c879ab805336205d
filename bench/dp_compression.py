"""Bench: bytes vs loss of data-parallel sync strategies, on the node runtime.

N=4 node processes of the runtime (``skiptrain.runtime``: one stage holding the whole model,
N replicas, gloo on 127.0.0.1, one torch thread each), one phase per method, train the same
model on the same real text (data/shakespeare, BPE 4096) with the same tokens per step for every method;
only the sync strategy differs.  For each method the table reports payload bytes per step
(what one node puts into the step's collectives, averaged over all steps, so DiLoCo's is
averaged over H), its ratio to a dense fp32 gradient all-reduce (4 bytes x parameters), the
bytes each node receives per step, the final validation loss (mean over seeds where several
ran) and its ratio to AdamW + all-reduce, and the median seconds per step.

A second part repeats a few steps of the best DeMo setting and of the dense all-reduce with the
links emulated at 10 Mbit/s up, 100 Mbit/s down, 25 ms latency (skiptrain.dp.link: real
sleeps computed from the real bytes) and reports seconds per step unshaped vs shaped.

    .venv/bin/python bench/dp_compression.py --json runs/bench/dp_compression.json --plot docs/img/dp_loss.png
    .venv/bin/python bench/dp_compression.py --quick --json runs/bench/dp_compression_quick.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.runtime.job import Job, data_parallel_phase, with_runtime  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402

K8 = ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign1"]
K8C = ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign1c"]
BEST = "demo_k8_sign1_u12"  # default --best: the lowest 3-seed loss ratio measured so far (docs/dp.md)
METHODS = {
    "adamw_allreduce": ["dp.strategy=allreduce"],
    "adamw_allreduce_bf16": ["dp.strategy=allreduce_bf16"],
    "powersgd_r4": ["dp.strategy=powersgd", "dp.powersgd_rank=4"],
    "diloco_h10": ["dp.strategy=diloco", "dp.sync_every=10", "dp.outer_lr=0.7", "dp.outer_momentum=0.9"],
    "demo_reference": ["dp.strategy=demo", "dp.topk=32", "dp.indices=int64", "dp.values=fp32"],
    "demo_k8_sign1_u12": K8,
    # k=8 with one bf16 scale per chunk (sign1c); DeMo-only tuning of lr / warm-up / step rule
    "demo_k8_sign1c_u12": K8C,
    "demo_k8_sign1c_u12_rms": K8C + ["dp.step_rule=rms"],
    "demo_k8_sign1c_u12_lr4e-3": K8C + ["train.lr=4e-3"],
    "demo_k8_sign1c_u12_lr3e-3_wu2": K8C + ["train.lr=3e-3", "train.warmup_steps=2"],
    "demo_k8_sign1c_u12_clip": K8C + ["dp.step_rule=clip"],
    "demo_k8_sign1c_u12_clip_lr3e-3": K8C + ["dp.step_rule=clip", "train.lr=3e-3"],
    # variants explored (run with --methods)
    "demo_k8_sign2_u12": ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign2"],
    "demo_k8_sign1_u12_lr1e-3": K8 + ["train.lr=1e-3"],
    # the longer-budget diagnosis (docs/dp.md, "A 4x longer budget": --steps 240 --seeds 1)
    "demo_k32_sign1_u12": ["dp.strategy=demo", "dp.topk=32", "dp.indices=u12", "dp.values=sign1"],
    "demo_k8_sign1_u12_lr4e-3": K8 + ["train.lr=4e-3"],
    "demo_k8_sign1_u12_lr8e-3": K8 + ["train.lr=8e-3"],
    "demo_k8_sign1_u12_adam": K8 + ["dp.step_rule=adam"],
    "demo_k8_sign1c_u12_adam": K8C + ["dp.step_rule=adam"],
    "diloco_h5": ["dp.strategy=diloco", "dp.sync_every=5", "dp.outer_lr=0.7", "dp.outer_momentum=0.9"],
}
DEFAULT_METHODS = ["adamw_allreduce", "adamw_allreduce_bf16", "powersgd_r4", "diloco_h10", "demo_reference"]
# + the --best setting; the other DeMo settings above ran with --methods (docs/dp.md)
SHAPED_LINK = ["dp.link_up_mbps=10", "dp.link_down_mbps=100", "dp.link_latency_ms=25"]


def base_overrides(quick: bool, steps: int | None, vocab: int, micro_batch: int | None = None) -> list[str]:
    if quick:  # same code path, a reduced model and run
        ov = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.seq_len=64", "train.steps=10", "train.micro_batch=2", "train.n_micro=4",
              "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=4"]
    else:
        ov = ["train.steps=60", "train.micro_batch=4", "train.n_micro=4", "train.warmup_steps=6",
              "train.eval_every=20", "train.eval_batches=32"]
    ov += [f"model.vocab_size={vocab}", "model.n_stages=1", "dp.check_every=25", "train.progress=false"]
    if steps:
        ov.append(f"train.steps={steps}")
    if micro_batch:
        ov.append(f"train.micro_batch={micro_batch}")
    return ov


def run_many(cfgs: list, nodes: int, data: str, timeout_s: float = 4 * 3600) -> list[dict]:
    """Train each config as one phase of one launch of ``nodes`` runtime node processes (data
    parallelism: every node a replica of the whole model); one record per config: per-step
    loss (mean over every micro-batch), iteration and sync seconds, validation points, the byte
    summary and every replica's final parameter hashes."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="skiptrain-dp-bench-") as tmp:
        phases = [data_parallel_phase(c, f"m{i}", nodes) for i, c in enumerate(cfgs)]
        job = Job(config=with_runtime(cfgs[0].to_dict(), timeout_s=max(c.dp.timeout_s for c in cfgs)),
                  data_path=str(data), run_dir=tmp, phases=phases)
        res = launch(job, timeout_s=timeout_s, echo=False)
        out = []
        for i, ph in enumerate(phases):
            rows = res.phase_metrics(ph.name)
            nodes_rec = [json.loads((Path(tmp) / "phases" / ph.name / f"node{r}.json").read_text())
                         for r in range(nodes)]
            train = [r for r in rows if "loss" in r]
            summ = nodes_rec[0]["sync_summary"]
            out.append({"losses_mean": [r["loss"] for r in train], "step_s": [r["iteration_s"] for r in train],
                        "comm_s": [r["comm_s"] for r in train],
                        "val": [[r["step"], r["val_loss"]] for r in rows if "val_loss" in r],
                        "summary": summ, "emulated_s": summ["emulated_link_s"], "n_params": summ["n_params"],
                        "all_hashes": [n["sync_summary"]["param_hashes"] for n in nodes_rec]})
        return out


def step_time(rec: dict, skip: int = 2) -> float:
    ts = rec["step_s"][skip:] or rec["step_s"]
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/shakespeare")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="reduced model and steps (< 2 minutes)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="samples per micro-batch (4 micro-batches a step, one per replica at N=4; default 4)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds for the AdamW / best-DeMo pair (default 3, quick 1)")
    ap.add_argument("--methods", default=None, help=f"comma list of {list(METHODS)} (default: {DEFAULT_METHODS} + --best)")
    ap.add_argument("--best", default=BEST, help="the DeMo setting the targets are judged on: 3 seeds with AdamW, "
                    "and the shaped-link run (default %(default)s)")
    ap.add_argument("--shaped-steps", type=int, default=None, help="steps per shaped/unshaped timing run")
    ap.add_argument("--no-shaped", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write the loss-vs-step PNG here")
    args = ap.parse_args(argv)

    ds = TokenDataset.open(args.data)
    base = base_overrides(args.quick, args.steps, ds.vocab_size, args.micro_batch)
    seeds = args.seeds or (1 if args.quick else 3)
    if args.best not in METHODS:
        raise SystemExit(f"--best {args.best!r} is not a method; choose one of {list(METHODS)}")
    names = list(dict.fromkeys([m for m in args.methods.split(",") if m] if args.methods
                               else DEFAULT_METHODS + [args.best]))
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    best = args.best
    seeded = ("adamw_allreduce", best)  # the pair the target compares: `seeds` seeds each
    t_start = time.time()
    runs: dict[str, list[dict]] = {}
    # seed-major order, so a partial run still compares every method on seed 0;
    # all runs share one spawn of the N processes (one gloo group)
    for s in range(seeds):
        jobs = [name for name in names if s == 0 or name in seeded]
        cfgs = [build_config("small", overrides=base + METHODS[n] + [f"train.seed={1234 + s}"]) for n in jobs]
        for name, rec in zip(jobs, run_many(cfgs, args.nodes, args.data, timeout_s=4 * 3600)):
            if len({tuple(h) for h in rec["all_hashes"]}) != 1:
                raise SystemExit(f"{name}: replicas are not identical at the end")
            runs.setdefault(name, []).append(rec)
            print(f"  {name} seed {s}: val {rec['val'][-1][1]:.4f}  {step_time(rec):.2f} s/step", flush=True)
    n_params = runs[names[0]][0]["n_params"]
    ref = runs.get("adamw_allreduce")
    ref_val = statistics.mean(r["val"][-1][1] for r in ref) if ref else None
    methods = {}
    for name, recs in runs.items():
        summ = recs[0]["summary"]
        vals = [r["val"][-1][1] for r in recs]
        val = statistics.mean(vals)
        methods[name] = {
            "payload_bytes": summ["payload_bytes_per_step"],
            "payload_bytes_per_sync": summ["payload_bytes_per_sync"],
            "ratio_vs_fp32": summ["ratio_payload_vs_fp32"],
            "received_bytes": summ["received_bytes_per_step"],
            "ratio_received_vs_fp32": summ["ratio_received_vs_fp32"],
            "val_loss": val,
            "val_loss_seeds": vals,
            "val_loss_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "loss_ratio_vs_adamw": val / ref_val if ref_val else None,
            "step_s": statistics.median(step_time(r) for r in recs),
            "comm_s": statistics.median(statistics.median(r["comm_s"]) for r in recs),
            "overrides": METHODS[name],
        }
    cfg0 = build_config("small", overrides=base)
    print(f"\nN={args.nodes} replicas, model {n_params / 1e6:.2f}M params, {cfg0.train.steps} steps x "
          f"{cfg0.train.micro_batch * cfg0.train.n_micro} samples x {cfg0.model.seq_len} tokens, "
          f"dense fp32 gradient = {4 * n_params:,} B; ratios = dense fp32 bytes / method bytes, per step")
    hdr = f"{'method':24s} {'payload B/step':>14s} {'x vs fp32':>10s} {'recv B/step':>12s} {'val loss':>16s} " \
          f"{'x AdamW':>8s} {'s/step':>7s}"
    print(hdr + "\n" + "-" * len(hdr))
    for name, m in methods.items():
        vl = f"{m['val_loss']:.4f}" + (f"+-{m['val_loss_std']:.3f}" if len(m["val_loss_seeds"]) > 1 else "")
        lr = f"{m['loss_ratio_vs_adamw']:.4f}" if m["loss_ratio_vs_adamw"] else "-"
        print(f"{name:24s} {m['payload_bytes']:14,.0f} {m['ratio_vs_fp32']:10.1f} {m['received_bytes']:12,.0f} "
              f"{vl:>16s} {lr:>8s} {m['step_s']:7.2f}")

    shaped = {}
    if not args.no_shaped:
        k = args.shaped_steps or 3
        print(f"\nlink emulation: 10 Mbit/s up, 100 Mbit/s down, 25 ms latency; {k} steps per run, "
              "median s/step after the first")
        sj = [(name, label, extra) for name in (best, "adamw_allreduce") if name in names
              for label, extra in (("unshaped", []), ("shaped", SHAPED_LINK))]
        scfgs = [build_config("small", overrides=base + METHODS[n] + extra +
                              [f"train.steps={k}", "train.eval_every=0", "train.eval_batches=1"]) for n, _, extra in sj]
        srecs = dict(((n, lab), r) for (n, lab, _), r in zip(sj, run_many(scfgs, args.nodes, args.data)))
        for name in dict.fromkeys(n for n, _, _ in sj):
            row = {}
            for label in ("unshaped", "shaped"):
                rec = srecs[(name, label)]
                row[label] = step_time(rec, skip=1)
                row[f"{label}_comm_s"] = statistics.median(rec["comm_s"][1:] or rec["comm_s"])
                row[f"{label}_emulated_s_per_step"] = rec["emulated_s"] / k
            row["slowdown"] = row["shaped"] / row["unshaped"]
            shaped[name] = row
            print(f"{name:24s} unshaped {row['unshaped']:6.2f} s/step  shaped {row['shaped']:7.2f} s/step  "
                  f"slowdown {row['slowdown']:6.2f}x  (emulated link delay {row['shaped_emulated_s_per_step']:.3f} s/step)",
                  flush=True)

    out = {"methods": methods, "nodes": args.nodes, "params": n_params, "quick": args.quick,
           "steps": cfg0.train.steps, "seeds_for": list(seeded), "seeds": seeds,
           "global_batch_samples": cfg0.train.micro_batch * cfg0.train.n_micro, "seq_len": cfg0.model.seq_len,
           "best": best, "shaped": shaped, "link": {"up_mbps": 10, "down_mbps": 100, "latency_ms": 25},
           "curves": {n: {"train_loss": rs[0]["losses_mean"], "val": rs[0]["val"]} for n, rs in runs.items()},
           "wall_s": time.time() - t_start}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)
    print(f"\ntotal {out['wall_s']:.0f} s")
    return 0


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for i, (name, c) in enumerate(out["curves"].items()):
        y = np.asarray(c["train_loss"])
        w = 5 if len(y) > 20 else 1
        ys = np.convolve(y, np.ones(w) / w, mode="valid")
        line, = ax.plot(np.arange(w, len(y) + 1), ys, lw=1.3, label=f"{name} ({out['methods'][name]['ratio_vs_fp32']:.0f}x)")
        if c["val"]:
            v = np.asarray(c["val"])
            ax.plot(v[:, 0], v[:, 1], "o", ms=4, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("loss (train: line, 5-step mean; val: dots)")
    ax.set_title(f"{out['nodes']} replicas, {out['params'] / 1e6:.1f}M params, Shakespeare BPE-4096 (seed 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
