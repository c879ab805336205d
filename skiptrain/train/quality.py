"""Model quality with body stages missing: SkipPipe's inference-robustness measurement.

A model trained with skipping should keep working when some body stages are gone.  The
measurement (DESIGN.md section 1): keep stage 0 and a random subset of the body stages, compare
perplexity with the full model **of the same weights**, on the same samples:

    rise = ppl(subset) / ppl(full) - 1 = exp(loss(subset) - loss(full)) - 1

Each subset is exactly the route ``drop_route(n_stages, drop_fraction=f, seed=s)`` that
``skiptrain eval RUN --drop-fraction f --seed s`` evaluates, on the same first samples of the
split, so every number here can be reproduced from the command line.  Subsets are distinct: the
seeds 0, 1, 2, ... are tried in order and a seed whose subset was already drawn is passed over.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from math import comb
from typing import Sequence

from ..data.loader import SampleSource
from ..model import StagedLM
from ..schedule.routes import drop_route, full_route
from ..runtime.evaluate import evaluate
from .evaluate import perplexity


def drop_subsets(n_stages: int, drop_fraction: float, n_subsets: int) -> list[tuple[int, list[int]]]:
    """Up to ``n_subsets`` distinct ``(seed, route)`` pairs omitting ``drop_fraction`` of the body.

    Fewer are returned only when fewer distinct subsets exist (e.g. dropping 0 stages: one).
    """
    body = n_stages - 1
    n_drop = int(drop_fraction * body + 0.5)
    possible = comb(body, n_drop)
    want = min(n_subsets, possible)
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, list[int]]] = []
    seed = 0
    while len(out) < want:
        r = drop_route(n_stages, drop_fraction=drop_fraction, seed=seed)
        if tuple(r) not in seen:
            seen.add(tuple(r))
            out.append((seed, r))
        seed += 1
    return out


@dataclass
class SubsetResult:
    seed: int
    route: list[int]
    loss: float
    ppl: float
    rise: float  # ppl / ppl_full - 1, same model, same samples


@dataclass
class FractionResult:
    drop_fraction: float
    kept: int  # body stages kept
    subsets: list[SubsetResult] = field(default_factory=list)

    @property
    def rises(self) -> list[float]:
        return [s.rise for s in self.subsets]

    def summary(self) -> dict:
        r = self.rises
        return {"drop_fraction": self.drop_fraction, "kept": self.kept, "n_subsets": len(r),
                "rise_mean": statistics.fmean(r), "rise_std": statistics.pstdev(r) if len(r) > 1 else 0.0,
                "rise_min": min(r), "rise_max": max(r),
                "ppl_mean": statistics.fmean(s.ppl for s in self.subsets)}


@dataclass
class RobustnessResult:
    n_stages: int
    samples: int
    full_loss: float
    fractions: list[FractionResult]

    @property
    def full_ppl(self) -> float:
        return perplexity(self.full_loss)

    def to_dict(self) -> dict:
        return {"n_stages": self.n_stages, "samples": self.samples, "full_loss": self.full_loss,
                "full_ppl": self.full_ppl,
                "fractions": {f"{f.drop_fraction:g}": {**f.summary(), "subsets": [asdict(s) for s in f.subsets]}
                              for f in self.fractions}}


def robustness(model: StagedLM, source: SampleSource, batches: int, micro_batch: int,
               drop_fractions: Sequence[float] = (0.25, 0.5), n_subsets: int = 16) -> RobustnessResult:
    """Loss along the full route, then along ``n_subsets`` random subsets per drop fraction.

    All evaluations use the same first ``batches * micro_batch`` samples of ``source`` (as
    ``skiptrain eval --batches`` does), so each rise is a paired comparison.
    """
    S = model.cfg.n_stages
    full = evaluate(model, source, batches, micro_batch, route=full_route(S))
    out = []
    for f in drop_fractions:
        subs = drop_subsets(S, f, n_subsets)
        fr = FractionResult(f, len(subs[0][1]) if subs else S - 1)
        for seed, route in subs:
            loss = evaluate(model, source, batches, micro_batch, route=route)
            fr.subsets.append(SubsetResult(seed, route, loss, perplexity(loss), math.exp(loss - full) - 1.0))
        out.append(fr)
    return RobustnessResult(S, min(batches * micro_batch, source.n), full, out)
