"""Bench: data-parallel sync strategies on consumer links, at equal steps and at equal seconds.

N=8 node processes of the runtime (``skiptrain.runtime``: one stage holding the whole model,
N replicas, gloo on 127.0.0.1, one torch thread each), one phase per run, train the same model
on the same real text (data/shakespeare, BPE 4096) with the same tokens per step for every
method (16 samples a step, one micro-batch per replica); only the sync strategy differs.

* **Equal steps**: every method trains 60 and 240 steps (each length its own run, cosine over
  its length); the final validation loss over ``--seeds`` seeds for AdamW + fp32 all-reduce and
  the ``--best`` method (other methods: the first seed), and its ratio to AdamW's.
* **Equal seconds on consumer links** (``dp.link=consumer``: 10 Mbit/s up, 100 Mbit/s down,
  25 ms per node, :mod:`skiptrain.dp.link`): each method also runs a few steps twice, unshaped
  and with the consumer links emulated (real sleeps computed from the real bytes); the emulated
  link seconds per step of that run are added to the measured seconds of every step of the
  training runs, so a run's clock is ``sum of its measured step seconds + steps x link seconds
  per step``.  The ``--best`` method also makes a ``--long-steps`` run (600 steps, same seeds).  The time to
  AdamW's final loss is the clock at the first validation point at or below AdamW's final
  validation loss (mean over seeds, longest equal-steps length); AdamW's own is its run's clock.
  The shaped run checks the clock: its measured extra seconds vs the emulated link seconds.

The default model is the ``small`` preset narrowed to d_model 128 and 4 layers (1.8M parameters:
what fits three seeds on a 2-core machine); ``--full-model`` trains the ``small`` preset as is.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.dp import LINK_PRESETS  # noqa: E402
from skiptrain.runtime.job import Job, data_parallel_phase, with_runtime  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402

K8 = ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign1"]
K8C = ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign1c"]
SL = ["dp.strategy=sparseloco", "dp.indices=u12", "dp.values=sign2"]
BEST = "sparseloco_h5_k40"  # default --best: the method the targets are judged on (docs/dp.md, tuning table)
METHODS = {
    "adamw_allreduce": ["dp.strategy=allreduce"],
    "adamw_allreduce_bf16": ["dp.strategy=allreduce_bf16"],
    "powersgd_r4": ["dp.strategy=powersgd", "dp.powersgd_rank=4"],
    "diloco_h10": ["dp.strategy=diloco", "dp.sync_every=10", "dp.outer_lr=0.7", "dp.outer_momentum=0.9"],
    "demo_reference": ["dp.strategy=demo", "dp.topk=32", "dp.indices=int64", "dp.values=fp32"],
    "demo_k8_sign1_u12": K8,
    # SparseLoCo: H local AdamW steps, top-k of the chunked DCT of the pseudo-gradient with error
    # feedback, 2-bit values, 12-bit indices; k scales with H so that every setting is >= 1000x
    "sparseloco_h5_k40": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0.5"],
    # the SparseLoCo settings of the tuning sweep (docs/dp.md; run with --methods)
    "sparseloco_h5_k40_olr1.5": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1.5", "dp.outer_momentum=0.5"],
    "sparseloco_h5_k40_olr2": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=2", "dp.outer_momentum=0.5"],
    "sparseloco_h5_k40_ef1": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0.5",
                                   "dp.ef_decay=1.0"],
    "sparseloco_h5_k40_nesterov": SL + ["dp.sync_every=5", "dp.topk=40"],  # outer lr 0.7, momentum 0.9
    "sparseloco_h5_k40_sign1c": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0.5",
                                      "dp.values=sign1c"],
    "sparseloco_h5_k40_nodct": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0.5",
                                     "dp.dct=false"],
    "sparseloco_h5_k40_lr4e-3": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0.5",
                                      "train.lr=4e-3"],
    "sparseloco_h5_c32_k10": SL + ["dp.sync_every=5", "dp.chunk=32", "dp.topk=10", "dp.outer_lr=1",
                                   "dp.outer_momentum=0.5"],
    "sparseloco_h5_k40_mom0": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0"],
    "sparseloco_h5_k40_ef0.9": SL + ["dp.sync_every=5", "dp.topk=40", "dp.outer_lr=1", "dp.outer_momentum=0.5",
                                     "dp.ef_decay=0.9"],
    "sparseloco_h10_k80": SL + ["dp.sync_every=10", "dp.topk=80"],
    "sparseloco_h10_k80_olr1.5": SL + ["dp.sync_every=10", "dp.topk=80", "dp.outer_lr=1.5", "dp.outer_momentum=0.5"],
    "sparseloco_h2_k16_olr1.5": SL + ["dp.sync_every=2", "dp.topk=16", "dp.outer_lr=1.5", "dp.outer_momentum=0.5"],
    "sparseloco_h2_k16": SL + ["dp.sync_every=2", "dp.topk=16", "dp.outer_lr=1", "dp.outer_momentum=0.5"],
    "sparseloco_h1_k8": SL + ["dp.sync_every=1", "dp.topk=8", "dp.outer_lr=1", "dp.outer_momentum=0"],
    # DeMo variants measured on the 4-replica, 8.0M-parameter setting (docs/dp.md; run with --methods)
    "demo_k8_sign1c_u12": K8C,
    "demo_k8_sign1c_u12_rms": K8C + ["dp.step_rule=rms"],
    "demo_k8_sign1c_u12_clip_lr3e-3": K8C + ["dp.step_rule=clip", "train.lr=3e-3"],
    "demo_k8_sign2_u12": ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign2"],
    "demo_k32_sign1_u12": ["dp.strategy=demo", "dp.topk=32", "dp.indices=u12", "dp.values=sign1"],
    "demo_k8_sign1_u12_lr4e-3": K8 + ["train.lr=4e-3"],
    "demo_k8_sign1_u12_adam": K8 + ["dp.step_rule=adam"],
    "demo_k8_sign1c_u12_lr4e-3": K8C + ["train.lr=4e-3"],
    "demo_k8_sign1c_u12_lr3e-3_wu2": K8C + ["train.lr=3e-3", "train.warmup_steps=2"],
    "demo_k8_sign1c_u12_clip": K8C + ["dp.step_rule=clip"],
    "demo_k8_sign1_u12_lr1e-3": K8 + ["train.lr=1e-3"],
    "demo_k8_sign1_u12_lr8e-3": K8 + ["train.lr=8e-3"],
    "demo_k8_sign1c_u12_adam": K8C + ["dp.step_rule=adam"],
    "diloco_h5": ["dp.strategy=diloco", "dp.sync_every=5", "dp.outer_lr=0.7", "dp.outer_momentum=0.9"],
}
DEFAULT_METHODS = ["adamw_allreduce", "diloco_h10", "demo_k8_sign1_u12"]  # + --best
REF = "adamw_allreduce"
NARROW = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2"]


def base_overrides(args, vocab: int) -> list[str]:
    """The overrides of the ``small`` preset every run shares (steps and seed are per run)."""
    if args.quick:  # same code path, a reduced model and run
        ov = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.seq_len=64", "train.warmup_steps=2", "train.eval_every=5", "train.eval_batches=4"]
    else:
        ov = ([] if args.full_model else NARROW) + ["train.warmup_steps=6", "train.eval_every=20",
                                                    "train.eval_batches=32"]
    mb = args.micro_batch or max(1, 16 // args.nodes)
    return ov + [f"model.vocab_size={vocab}", "model.n_stages=1", f"train.n_micro={args.nodes}",
                 f"train.micro_batch={mb}", "dp.check_every=25", "train.progress=false"]


def run_many(cfgs: list, nodes: int, data: str, timeout_s: float = 4 * 3600) -> list[dict]:
    """Train each config as one phase of one launch of ``nodes`` runtime node processes (data
    parallelism: every node a replica of the whole model); one record per config: per-step
    loss (mean over every micro-batch), iteration and sync seconds, validation points, the byte
    summary and every replica's final parameter hashes.  The runs stay under ``runs/bench/dp``."""
    from _workdir import work_dir

    with work_dir(None, "dp") as tmp:
        phases = [data_parallel_phase(c, f"m{i}", nodes) for i, c in enumerate(cfgs)]
        job = Job(config=with_runtime(cfgs[0].to_dict(), timeout_s=max(c.dp.timeout_s for c in cfgs)),
                  data_path=str(data), run_dir=tmp, phases=phases)
        res = launch(job, timeout_s=timeout_s, echo=False)
        out = []
        for ph in phases:
            rows = res.phase_metrics(ph.name)
            nodes_rec = [json.loads((Path(tmp) / "phases" / ph.name / f"node{r}.json").read_text())
                         for r in range(nodes)]
            train = [r for r in rows if "loss" in r]
            summ = nodes_rec[0]["sync_summary"]
            hashes = {tuple(n["sync_summary"]["param_hashes"]) for n in nodes_rec}
            if len(hashes) != 1:
                raise SystemExit(f"phase {ph.name}: replicas are not identical at the end")
            out.append({"losses_mean": [r["loss"] for r in train], "step_s": [r["iteration_s"] for r in train],
                        "val": [[r["step"], r["val_loss"]] for r in rows if "val_loss" in r],
                        "summary": summ, "emulated_s": summ["emulated_link_s"], "n_params": summ["n_params"]})
        return out


def shaped_steps(name: str) -> int:
    """Steps of the short link runs: whole sync periods (H), at least 3."""
    cfg = build_config("small", overrides=METHODS[name])
    h = cfg.dp.sync_every if cfg.dp.strategy in ("diloco", "sparseloco", "demo") else 1
    return h * max(1, -(-3 // h))


def plan(args, names: list[str], best: str, base: list[str], seeds: int) -> list[list[tuple]]:
    """Runs per launch (one launch per seed): ``(method, kind, steps, seed, extra overrides)``;
    kind ``steps`` (equal steps), ``long`` (the best method's long run), ``plain``/``link`` (the
    short unshaped / consumer-link runs, first seed)."""
    launches = []
    for s in range(seeds):
        runs = [(n, "steps", L, s, []) for n in names for L in args.lengths if s == 0 or n in (REF, best)]
        if args.long_steps:
            runs.append((best, "long", args.long_steps, s, []))
        if s == 0 and not args.no_link:
            for n in names:
                k = shaped_steps(n)
                q = [f"train.steps={k}", "train.eval_every=0", "train.eval_batches=1"]
                runs += [(n, "plain", k, s, q), (n, "link", k, s, q + [f"dp.link={args.link}"])]
        launches.append(runs)
    return launches


def execute(args, launches: list[list[tuple]], base: list[str]) -> dict:
    """Run every launch; records by (method, kind, steps) -> list over seeds."""
    recs: dict[tuple, list[dict]] = {}
    for runs in launches:
        cfgs = [build_config("small", overrides=base + METHODS[n] + [f"train.steps={L}", f"train.seed={1234 + s}"] + q)
                for n, _, L, s, q in runs]
        for (n, kind, L, s, _), rec in zip(runs, run_many(cfgs, args.nodes, args.data)):
            recs.setdefault((n, kind, L), []).append(rec)
            if rec["val"]:
                print(f"  {n} {kind} {L} steps seed {s}: val {rec['val'][-1][1]:.4f}  "
                      f"{statistics.median(rec['step_s'][2:] or rec['step_s']):.3f} s/step", flush=True)
    return recs


def clock(rec: dict, link_s_per_step: float) -> list[float]:
    """Seconds on the emulated links at the end of each step of ``rec``."""
    out, t = [], 0.0
    for s in rec["step_s"]:
        t += s + link_s_per_step
        out.append(t)
    return out


def time_to(rec: dict, link_s: float, target: float) -> float | None:
    """The clock at the first validation point at or below ``target`` (None: not reached)."""
    c = clock(rec, link_s)
    return next((c[step - 1] for step, v in rec["val"] if v <= target), None)


def link_check(recs: dict, name: str) -> dict | None:
    if (name, "link", shaped_steps(name)) not in recs:
        return None
    k = shaped_steps(name)
    plain, linked = recs[(name, "plain", k)][0], recs[(name, "link", k)][0]
    return {"steps": k, "emulated_link_s_per_step": linked["emulated_s"] / k,
            "plain_s_per_step": sum(plain["step_s"]) / k, "link_s_per_step_measured": sum(linked["step_s"]) / k}


def summarize(args, recs: dict, names: list[str], best: str) -> dict:
    lengths = args.lengths
    ref_final = {L: statistics.mean(r["val"][-1][1] for r in recs[(REF, "steps", L)]) for L in lengths}
    target = ref_final[lengths[-1]]
    methods = {}
    for n in names:
        chk = link_check(recs, n)
        link_s = chk["emulated_link_s_per_step"] if chk else 0.0
        first = recs[(n, "steps", lengths[-1])]
        summ = first[0]["summary"]
        m = {"payload_bytes": summ["payload_bytes_per_step"], "payload_bytes_per_sync": summ["payload_bytes_per_sync"],
             "ratio_vs_fp32": summ["ratio_payload_vs_fp32"], "received_bytes": summ["received_bytes_per_step"],
             "step_s": statistics.median(statistics.median(r["step_s"][2:] or r["step_s"]) for r in first),
             "link_s_per_step": link_s, "link_check": chk, "overrides": METHODS[n]}
        for L in lengths:
            vals = [r["val"][-1][1] for r in recs[(n, "steps", L)]]
            m[f"val_loss_{L}"], m[f"val_loss_{L}_seeds"] = statistics.mean(vals), vals
            m[f"loss_ratio_vs_adamw_{L}"] = statistics.mean(vals) / ref_final[L]
        for L in lengths:
            per_seed = seconds_to(recs, n, L, link_s, ref_final[L])
            m[f"time_to_adamw_{L}_s_seeds"] = per_seed
            m[f"time_to_adamw_{L}_s"] = statistics.mean(per_seed) if None not in per_seed else None
        m["time_to_adamw_final_s"] = m[f"time_to_adamw_{lengths[-1]}_s"]
        methods[n] = m
    for L in lengths:
        t_ref = methods[REF][f"time_to_adamw_{L}_s"]
        for m in methods.values():
            t = m[f"time_to_adamw_{L}_s"]
            m[f"sooner_than_adamw_{L}"] = t_ref / t if t else None
    for m in methods.values():
        m["sooner_than_adamw"] = m[f"sooner_than_adamw_{lengths[-1]}"]
    return {"methods": methods, "adamw_final_val": target, "adamw_final_val_by_steps": ref_final}


def seconds_to(recs: dict, n: str, L: int, link_s: float, target: float) -> list:
    """Per seed of method ``n``: seconds on the links to AdamW's final loss at ``L`` steps
    (AdamW itself: its ``L``-step run's clock), over every run of ``n`` of that seed."""
    first = recs[(n, "steps", L)]
    per_seed = []
    for s in range(len(first)):
        if n == REF:
            per_seed.append(clock(first[s], link_s)[-1])
            continue
        runs = [recs[k][s] for k in recs if k[0] == n and k[1] in ("steps", "long") and len(recs[k]) > s]
        hits = [t for t in (time_to(r, link_s, target) for r in runs) if t is not None]
        per_seed.append(min(hits) if hits else None)
    return per_seed


def print_tables(out: dict, lengths: list[int]) -> None:
    L0, L1 = lengths[0], lengths[-1]
    print(f"\nN={out['nodes']} replicas, {out['params'] / 1e6:.2f}M params, {out['global_batch_samples']} samples x "
          f"{out['seq_len']} tokens a step; links: {out['links']['preset']} ({out['links']['up_mbps']:g} Mbit/s up, "
          f"{out['links']['down_mbps']:g} down, {out['links']['latency_ms']:g} ms); AdamW's final val loss "
          f"{out['adamw_final_val']:.4f}; x fp32 = dense fp32 bytes / method bytes, per step")
    hdr = (f"{'method':22s} {'B/step':>11s} {'x fp32':>8s} {f'val@{L0}':>7s} {f'xAdamW@{L0}':>10s} {f'val@{L1}':>7s} "
           f"{f'xAdamW@{L1}':>10s} {'s/step':>6s} {'link s':>6s} {f'to AdamW@{L0}':>16s} {f'to AdamW@{L1}':>16s}")
    print(hdr + "\n" + "-" * len(hdr))
    for name, m in out["methods"].items():
        to = []
        for L in (L0, L1):
            t, x = m[f"time_to_adamw_{L}_s"], m[f"sooner_than_adamw_{L}"]
            to.append(f"{t:.0f} s ({x:.1f}x)" if t else "not reached")
        print(f"{name:22s} {m['payload_bytes']:11,.0f} {m['ratio_vs_fp32']:8.1f} {m[f'val_loss_{L0}']:7.4f} "
              f"{m[f'loss_ratio_vs_adamw_{L0}']:10.4f} {m[f'val_loss_{L1}']:7.4f} {m[f'loss_ratio_vs_adamw_{L1}']:10.4f} "
              f"{m['step_s']:6.3f} {m['link_s_per_step']:6.3f} {to[0]:>16s} {to[1]:>16s}")
    print("(s/step: median measured step; link s: emulated link seconds per step; to AdamW@L: seconds on the links to "
          "AdamW's final loss at L steps, and how many times sooner than AdamW)")
    print("\nlink check (short runs, mean s/step): unshaped, with the emulated links, and the emulated link delay")
    for name, m in out["methods"].items():
        c = m["link_check"]
        if c:
            print(f"{name:22s} {c['steps']:3d} steps  unshaped {c['plain_s_per_step']:7.3f}  linked "
                  f"{c['link_s_per_step_measured']:7.3f}  extra {c['link_s_per_step_measured'] - c['plain_s_per_step']:7.3f}"
                  f"  emulated {c['emulated_link_s_per_step']:7.3f}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/shakespeare")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="reduced model and steps (about a minute)")
    ap.add_argument("--full-model", action="store_true", help="the `small` preset's model as is (8.0M parameters)")
    ap.add_argument("--steps", default=None, help="equal-steps lengths, comma list (default 60,240; quick 10,20)")
    ap.add_argument("--long-steps", type=int, default=None,
                    help="steps of a long run of the --best method, every seed (default 600; quick 40; 0 = none)")
    ap.add_argument("--micro-batch", type=int, default=None, help="samples per micro-batch (default 16 / nodes)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds for AdamW and --best (default 3, quick 1)")
    ap.add_argument("--methods", default=None, help=f"comma list of {list(METHODS)} (default: {DEFAULT_METHODS} + --best)")
    ap.add_argument("--best", default=BEST, help="the method the targets are judged on (default %(default)s)")
    ap.add_argument("--link", default="consumer", choices=sorted(LINK_PRESETS), help="dp.link preset of the clock")
    ap.add_argument("--no-link", action="store_true", help="skip the short link runs (no clock)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="loss-vs-seconds PNG (default: next to --json)")
    args = ap.parse_args(argv)
    args.lengths = sorted(int(x) for x in (args.steps or ("10,20" if args.quick else "60,240")).split(",") if x)
    if args.long_steps is None:
        args.long_steps = 40 if args.quick else 600
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ds = TokenDataset.open(args.data)
    base = base_overrides(args, ds.vocab_size)
    seeds = args.seeds or (1 if args.quick else 3)
    best = args.best
    names = list(dict.fromkeys([m for m in args.methods.split(",") if m] if args.methods
                               else DEFAULT_METHODS + [best]))
    bad = [m for m in names + [best] if m not in METHODS]
    if bad or REF not in names or best not in names:
        raise SystemExit(f"methods must include {REF} and --best, from {list(METHODS)}; unknown: {bad}")
    t_start = time.time()
    recs = execute(args, plan(args, names, best, base, seeds), base)
    cfg0 = build_config("small", overrides=base)
    link = LINK_PRESETS[args.link]
    out = {**summarize(args, recs, names, best), "nodes": args.nodes, "params": recs[(REF, "steps", args.lengths[0])][0]["n_params"],
           "quick": args.quick, "steps": args.lengths, "long_steps": args.long_steps, "seeds": seeds,
           "seeds_for": [REF, best], "best": best, "global_batch_samples": cfg0.train.micro_batch * cfg0.train.n_micro,
           "seq_len": cfg0.model.seq_len, "model": {"d_model": cfg0.model.d_model, "n_layers": cfg0.model.n_layers},
           "links": {"preset": args.link, "up_mbps": link.up_mbps, "down_mbps": link.down_mbps,
                     "latency_ms": link.latency_ms, "per": "node"},
           "curves": {f"{n} {kind} {L}": {"val": rs[0]["val"], "clock_s": clock(rs[0], 0.0)}
                      for (n, kind, L), rs in recs.items() if kind in ("steps", "long")}}
    out["wall_s"] = time.time() - t_start
    print_tables(out, args.lengths)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot or args.json:
        plot(out, args.plot or str(Path(args.json).with_suffix(".png")))
    print(f"\ntotal {out['wall_s']:.0f} s")
    return 0


def plot(out: dict, path: str) -> None:
    """Validation loss against seconds on the emulated links, every method (first seed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = out["steps"][-1]
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=90)
    for name, m in out["methods"].items():
        link_s = m["link_s_per_step"]
        keys = [k for k in out["curves"] if k.startswith(f"{name} ") and (k.endswith(f"steps {L}") or " long " in k)]
        color = None
        for k in keys:
            c = out["curves"][k]
            xs = [c["clock_s"][s - 1] + s * link_s for s, _ in c["val"]]
            line, = ax.plot(xs, [v for _, v in c["val"]], "-o" if "long" not in k else "--.", ms=3, lw=1.2, color=color,
                            label=f"{name} ({m['ratio_vs_fp32']:.0f}x)" if color is None else f"{name}, {k.split()[-1]} steps")
            color = line.get_color()
    ax.axhline(out["adamw_final_val"], color="k", lw=0.8, ls=":", label=f"AdamW final ({L} steps)")
    ax.set_xscale("log")
    lk = out["links"]
    ax.set_xlabel(f"seconds on {lk['preset']} links ({lk['up_mbps']:g}/{lk['down_mbps']:g} Mbit/s up/down, "
                  f"{lk['latency_ms']:g} ms)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{out['nodes']} replicas, {out['params'] / 1e6:.1f}M params, Shakespeare BPE-4096 (seed 0)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
