"""Does training with skipped stages converge like full training?  (SkipPipe's first quality claim.)

Trains the same model (9 stages x 2 layers, real text: Shakespeare, BPE 4096) for the same
iterations with skip ratio k = 0, 0.25 and 0.33, routes drawn as the planner draws them (balanced
visits per body stage, up to one adjacent swap), for several seeds.  Every run of one seed sees
the same initial weights and the same micro-batches in the same order: skipping stages changes
which layers a micro-batch visits, never which tokens are consumed, so equal iterations are also
equal tokens.  Validation loss is measured along the full route (all stages).

    .venv/bin/python bench/convergence.py --json runs/bench/convergence.json --plot docs/img/quality_convergence.png
    .venv/bin/python bench/convergence.py --quick --json runs/bench/convergence.json

Prints a table per k: final and best validation loss and perplexity (mean over seeds), and the
paired gap to k=0; ``--json`` writes ``{"k": {"0": {"val_loss": ...}, "0.25": ..., "0.33": ...}}``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _quality as Q  # noqa: E402


def curves(run: Path) -> dict:
    from skiptrain.train.metrics import read_metrics

    rows = read_metrics(run / "metrics.jsonl")
    return {"val": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r],
            "train": [(r["step"], r["loss"]) for r in rows if "loss" in r]}


def mean(xs):
    return statistics.fmean(xs)


def sd(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarise(args, dirs: dict) -> dict:
    import json

    from skiptrain.schedule.routes import skip_count

    ks = sorted({k for k, _ in dirs})
    seeds = sorted({s for _, s in dirs})
    res: dict = {"k": {}}
    for k in ks:
        per_seed = {}
        for s in seeds:
            d = dirs[(k, s)]
            c = curves(d)
            summ = json.loads((d / "run.json").read_text())
            final, best = c["val"][-1][1], min(v for _, v in c["val"])
            per_seed[str(s)] = {"val_loss": final, "best_val_loss": best, "ppl": math.exp(final),
                                "best_ppl": math.exp(best), "tokens": summ["tokens"], "steps": summ["step"],
                                "train_seconds": summ["seconds"], "run_dir": str(d)}
        cfg = Q.make_config(args, k, seeds[0])
        S = cfg.model.n_stages
        finals = [v["val_loss"] for v in per_seed.values()]
        bests = [v["best_val_loss"] for v in per_seed.values()]
        res["k"][f"{k:g}"] = {
            "skipped_body_stages": skip_count(k, S) if k > 0 else 0, "body_stages": S - 1,
            "val_loss": mean(finals), "val_loss_sd": sd(finals), "best_val_loss": mean(bests),
            "ppl": math.exp(mean(finals)), "best_ppl": math.exp(mean(bests)),
            "tokens": per_seed[str(seeds[0])]["tokens"], "steps": per_seed[str(seeds[0])]["steps"],
            "train_seconds": mean(v["train_seconds"] for v in per_seed.values()), "seeds": per_seed}
    base = res["k"].get("0")
    if base:
        for key, r in res["k"].items():
            # Paired by seed: same init, same data order.
            gaps = [r["seeds"][s]["val_loss"] / base["seeds"][s]["val_loss"] - 1 for s in r["seeds"]]
            bgaps = [r["seeds"][s]["best_val_loss"] / base["seeds"][s]["best_val_loss"] - 1 for s in r["seeds"]]
            r["gap_vs_k0"], r["gap_vs_k0_sd"], r["best_gap_vs_k0"] = mean(gaps), sd(gaps), mean(bgaps)
    cfg = Q.make_config(args, 0.0, 0)
    res["setup"] = {"setting": Q.setting_name(args), "seeds": len(seeds), "steps": cfg.train.steps,
                    "tokens_per_step": cfg.train.micro_batch * cfg.train.n_micro * cfg.model.seq_len,
                    "model": cfg.to_dict()["model"], "train": cfg.to_dict()["train"],
                    "overrides": args.overrides, "data": args.data}
    if "0.33" in res["k"] and base:
        g = res["k"]["0.33"]["gap_vs_k0"]
        res["criterion"] = {"k0.33_within_3pct_of_k0": g <= 0.03, "gap": g}
    return res


def print_table(res: dict) -> None:
    st = res["setup"]
    print(f"\nconvergence: {st['setting']}, {st['seeds']} seed(s), {st['steps']} iterations x "
          f"{st['tokens_per_step']} tokens (equal for every k), validation along the full route")
    hdr = (f"{'k':>5} {'skipped':>8} {'tokens':>9} {'final val':>15} {'ppl':>7} {'best val':>9} "
           f"{'best ppl':>8} {'gap vs k=0':>13} {'train s':>8}")
    print(hdr)
    print("-" * len(hdr))
    for key, r in res["k"].items():
        gap = "n/a (no k=0)" if "gap_vs_k0" not in r else (
            f"{100 * r['gap_vs_k0']:+.2f}%" + (f"±{100 * r['gap_vs_k0_sd']:.1f}" if r.get("gap_vs_k0_sd") else ""))
        print(f"{key:>5} {str(r['skipped_body_stages']) + '/' + str(r['body_stages']):>8} {r['tokens']:>9,} "
              f"{r['val_loss']:>8.4f}±{r['val_loss_sd']:.3f} {r['ppl']:>7.2f} {r['best_val_loss']:>9.4f} "
              f"{r['best_ppl']:>8.2f} {gap:>13} {r['train_seconds']:>8.0f}")
    if "criterion" in res:
        c = res["criterion"]
        print(f"k=0.33 vs k=0 final validation loss: {100 * c['gap']:+.2f}% "
              f"({'within' if c['k0.33_within_3pct_of_k0'] else 'NOT within'} 3%)")


def plot(res: dict, dirs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    st = res["setup"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"0": "C0", "0.25": "C1", "0.33": "C2"}
    for key, r in res["k"].items():
        k = float(key)
        col = colors.get(key)
        vals = [curves(dirs[(k, int(s))]) for s in r["seeds"]]
        steps = [s for s, _ in vals[0]["val"]]
        v = np.mean([[x for _, x in c["val"]] for c in vals], axis=0)
        label = f"k={key} (skip {r['skipped_body_stages']}/{r['body_stages']})"
        a.plot(steps, v, "o-", ms=3, color=col, label=label)
        tr = np.mean([[x for _, x in c["train"]] for c in vals], axis=0)
        w = max(1, len(tr) // 25)
        sm = np.convolve(tr, np.ones(w) / w, mode="valid")
        b.plot(np.arange(len(sm)) + w, sm, color=col, label=label)
    for ax, t in ((a, "validation loss (full route)"), (b, f"training loss (own routes, mean of {w})")):
        ax.set_xlabel(f"iteration ({st['tokens_per_step']} tokens each, every k)")
        ax.set_ylabel("cross-entropy (nats)")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.set_ylim(top=min(a.get_ylim()[1], 7.5))
    b.set_ylim(top=min(b.get_ylim()[1], 7.5))
    fig.suptitle(f"skip training vs full training: {st['setting']}, mean of {st['seeds']} seed(s)", fontsize=11)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    Q.add_common_args(p)
    p.add_argument("--ks", default="0,0.25,0.33", help="skip ratios to train (default 0,0.25,0.33)")
    p.add_argument("--plot", metavar="PNG", help="loss-curve plot (default: <root>/<setting>/convergence.png)")
    args = p.parse_args(argv)
    t0 = time.time()
    ks = tuple(float(x) for x in args.ks.split(","))
    dirs = Q.ensure_runs(args, ks)
    res = summarise(args, dirs)
    res["wall_seconds"] = round(time.time() - t0, 1)
    print_table(res)
    plot(res, dirs, args.plot or str(Path(args.root) / Q.setting_name(args) / "convergence.png"))
    Q.write_json(args.json, res)
    print(f"convergence bench: {res['wall_seconds']:.0f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
