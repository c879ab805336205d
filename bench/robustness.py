"""Does a skip-trained model keep working with body stages removed?  (SkipPipe's second quality claim.)

Loads the runs of bench/convergence.py (training them with the same code if absent) and evaluates
each model along the full route, then with 25% and 50% of the body stages removed (stage 0 always
kept; many distinct random subsets, the same subsets and the same samples for every model), on
the validation split and on Milton (the ``ood`` split, never trained on).  The perplexity rise
of a model is ``ppl(subset) / ppl(full) - 1`` of that same model; the skip-trained models' rise
is reported next to the k=0 model's under the same omission.

    .venv/bin/python bench/robustness.py --json runs/bench/robustness.json
    .venv/bin/python bench/robustness.py --quick --json runs/bench/robustness.json

Every row can be reproduced with ``skiptrain eval RUN --drop-fraction F --seed S --batches B``
(the subset seeds are in the JSON).  ``--json`` writes
``{"rise": {"skip": {"0.25": ..., "0.5": ...}, "full": {...}}}`` (keys: fraction of body stages
removed; "skip" = the k=0.33 model, "full" = the k=0 model; validation split, mean over subsets
and seeds), with every k, split and subset in ``"detail"``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _quality as Q  # noqa: E402

FRACTIONS = (0.25, 0.5)


def _eval_one(run: str, data: str, split: str, batches: int, fractions, n_subsets: int) -> dict:
    """Child process: the robustness sweep of one trained run on one split."""
    import torch

    torch.set_num_threads(1)
    from skiptrain.data.dataset import TokenDataset
    from skiptrain.data.loader import SampleSource
    from skiptrain.train.quality import robustness
    from skiptrain.train.rundir import load_run

    cfg, model, _ = load_run(run)
    src = SampleSource(TokenDataset.open(data).tokens(split), cfg.model.seq_len, shuffle=False)
    return robustness(model, src, batches, cfg.train.micro_batch, fractions, n_subsets).to_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    Q.add_common_args(p)
    p.add_argument("--skip-k", type=float, default=0.33, help='the skip-trained model reported as "skip"')
    p.add_argument("--ks", default="0,0.25,0.33", help="models to evaluate (k=0 is the reference)")
    p.add_argument("--subsets", type=int, help="distinct random subsets per fraction (default 16, --quick 3)")
    p.add_argument("--batches", type=int, help="micro-batches evaluated per route (default 16, --quick 2)")
    p.add_argument("--splits", default="val,ood")
    args = p.parse_args(argv)
    t0 = time.time()
    ks = tuple(float(x) for x in args.ks.split(","))
    dirs = Q.ensure_runs(args, ks)
    n_sub = args.subsets or (3 if args.quick else 16)
    batches = args.batches or (2 if args.quick else 16)
    splits = args.splits.split(",")
    jobs = [(k, s, split) for (k, s) in sorted(dirs) for split in splits]
    print(f"[eval] {len(jobs)} model x split sweeps, {n_sub} subsets per fraction, {batches} micro-batches each",
          flush=True)
    out: dict = {}
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=mp.get_context("spawn")) as ex:
        futs = {ex.submit(_eval_one, str(dirs[(k, s)]), args.data, split, batches, FRACTIONS, n_sub): (k, s, split)
                for k, s, split in jobs}
        for f in cf.as_completed(futs):
            k, s, split = futs[f]
            out[(k, s, split)] = f.result()

    def agg(k, split, frac):
        """Mean and spread of the rise over all subsets of all seeds of model k."""
        rises = [r for (kk, s, sp), d in out.items() if kk == k and sp == split
                 for r in (x["rise"] for x in d["fractions"][f"{frac:g}"]["subsets"])]
        seed_means = [d["fractions"][f"{frac:g}"]["rise_mean"] for (kk, s, sp), d in out.items()
                      if kk == k and sp == split]
        return {"mean": statistics.fmean(rises), "sd": statistics.pstdev(rises), "min": min(rises),
                "max": max(rises), "n": len(rises), "seed_means": seed_means}

    detail: dict = {}
    for split in splits:
        detail[split] = {}
        for k in ks:
            fulls = [d["full_loss"] for (kk, s, sp), d in out.items() if kk == k and sp == split]
            detail[split][f"{k:g}"] = {
                "full_loss": statistics.fmean(fulls), "full_ppl": statistics.fmean(
                    d["full_ppl"] for (kk, s, sp), d in out.items() if kk == k and sp == split),
                "rise": {f"{f:g}": agg(k, split, f) for f in FRACTIONS},
                "dropped_ppl": {f"{f:g}": statistics.fmean(
                    d["fractions"][f"{f:g}"]["ppl_mean"] for (kk, s, sp), d in out.items() if kk == k and sp == split)
                    for f in FRACTIONS},
                "runs": {str(s): d for (kk, s, sp), d in out.items() if kk == k and sp == split}}
    sk, fk = f"{args.skip_k:g}", "0"

    def rises(split, key):
        """Mean rise per fraction of model ``key`` (None when that model was not evaluated)."""
        d = detail[split].get(key)
        return {f: r["mean"] for f, r in d["rise"].items()} if d else None

    res = {"rise": {"skip": rises(splits[0], sk), "full": rises(splits[0], fk)},
           "skip_k": args.skip_k, "split": splits[0]}
    if len(splits) > 1:
        res["rise_" + splits[1]] = {"skip": rises(splits[1], sk), "full": rises(splits[1], fk)}
    r50 = res["rise"]["skip"].get("0.5") if res["rise"]["skip"] else None
    res["criterion"] = {"skip_rise_at_half_removed": r50, "within_7pct": r50 is not None and r50 <= 0.07,
                        "within_5pct": r50 is not None and r50 <= 0.05}
    cfg = Q.make_config(args, 0.0, 0)
    n_body = cfg.model.n_stages - 1
    res["setup"] = {"setting": Q.setting_name(args), "seeds": len({s for _, s in dirs}), "subsets": n_sub,
                    "samples": next(iter(out.values()))["samples"],
                    "seq_len": cfg.model.seq_len, "body_stages": n_body,
                    "kept": {f"{f:g}": n_body - int(f * n_body + 0.5) for f in FRACTIONS}}
    res["detail"] = detail
    res["wall_seconds"] = round(time.time() - t0, 1)

    st = res["setup"]
    print(f"\nrobustness: {st['setting']}, {st['seeds']} seed(s) per k, {n_sub} random subsets per fraction, "
          f"{st['samples']} samples x {st['seq_len']} tokens per route (paired)")
    for split in splits:
        hdr = (f"{'split':>5} {'trained k':>9} {'full ppl':>9} | " + " | ".join(
            f"{n_body - int(f * n_body + 0.5)}/{n_body} kept: ppl, rise mean [min, max]" for f in FRACTIONS))
        print(hdr)
        print("-" * len(hdr))
        for k in ks:
            d = detail[split][f"{k:g}"]
            cells = []
            for f in FRACTIONS:
                r = d["rise"][f"{f:g}"]
                cells.append(f"{d['dropped_ppl'][f'{f:g}']:8.2f}  {100 * r['mean']:+7.2f}% "
                             f"[{100 * r['min']:+.1f}, {100 * r['max']:+.1f}]")
            print(f"{split:>5} {k:>9g} {d['full_ppl']:>9.2f} | " + " | ".join(f"{c:>36}" for c in cells))
        print()
    c = res["criterion"]
    if r50 is not None:
        full50 = res["rise"]["full"]["0.5"] if res["rise"]["full"] else float("nan")
        print(f"k={sk} model, half the body removed: perplexity rise {100 * r50:+.2f}% "
              f"(target <= 7%: {'met' if c['within_7pct'] else 'MISSED'}); "
              f"k=0 model under the same omission: {100 * full50:+.2f}%")
    Q.write_json(args.json, res)
    print(f"robustness bench: {res['wall_seconds']:.0f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
