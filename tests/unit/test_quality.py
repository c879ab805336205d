"""Robustness measurement with missing stages (issue 7)."""

import math
from math import comb

import pytest
import torch

from skiptrain.config import build_config
from skiptrain.data.dataset import TokenDataset
from skiptrain.data.loader import SampleSource
from skiptrain.model import StagedLM
from skiptrain.schedule.routes import drop_route, full_route
from skiptrain.runtime.evaluate import evaluate
from skiptrain.train.quality import drop_subsets, robustness


def tiny(data=None, model=None, **train):
    over = {"train": {"progress": False, **train}, "model": {"n_stages": 5, "n_layers": 5, **(model or {})}}
    if data is not None:
        over["data"] = {"path": str(data)}
    return build_config("tiny", overrides=over)


@pytest.mark.parametrize("n_stages,frac,n", [(9, 0.5, 16), (9, 0.25, 40), (5, 0.5, 16), (9, 0.0, 5)])
def test_drop_subsets_are_distinct_and_reproducible_from_the_cli_seed(n_stages, frac, n):
    body = n_stages - 1
    n_drop = int(frac * body + 0.5)
    subs = drop_subsets(n_stages, frac, n)
    assert len(subs) == min(n, comb(body, n_drop))
    assert len({tuple(r) for _, r in subs}) == len(subs)
    for seed, route in subs:
        # The same route `skiptrain eval --drop-fraction frac --seed seed` evaluates.
        assert route == drop_route(n_stages, drop_fraction=frac, seed=seed)
        assert len(route) == body - n_drop and route == sorted(route) and 0 not in route


def test_robustness_is_paired_and_matches_evaluate(byte_data):
    cfg = tiny()
    model = StagedLM(cfg.model, seed=3)
    src = SampleSource(TokenDataset.open(byte_data).tokens("val"), cfg.model.seq_len, shuffle=False)
    res = robustness(model, src, batches=2, micro_batch=4, drop_fractions=(0.25, 0.5), n_subsets=3)
    assert res.full_loss == pytest.approx(evaluate(model, src, 2, 4, route=full_route(5)))
    assert [len(f.subsets) for f in res.fractions] == [3, 3] and [f.kept for f in res.fractions] == [3, 2]
    for f in res.fractions:
        for s in f.subsets:
            assert s.loss == pytest.approx(evaluate(model, src, 2, 4, route=s.route))
            assert s.rise == pytest.approx(math.exp(s.loss - res.full_loss) - 1)
    d = res.to_dict()
    assert set(d["fractions"]) == {"0.25", "0.5"} and d["samples"] == 8
    assert any(abs(s.rise) > 1e-6 for f in res.fractions for s in f.subsets)


def test_robustness_rise_is_zero_when_body_stages_are_identities(byte_data):
    """Zero the output projections of every body layer: each body stage then passes the residual
    stream through unchanged, so removing any of them cannot change the perplexity."""
    cfg = tiny()
    model = StagedLM(cfg.model, seed=0)
    body_layers = [i for s in range(1, 5) for i in model.partition.layers(s)]
    with torch.no_grad():
        for i in body_layers:
            model.layers[str(i)].attn.wo.weight.zero_()
            model.layers[str(i)].ffn.w2.weight.zero_()
    src = SampleSource(TokenDataset.open(byte_data).tokens("ood"), cfg.model.seq_len, shuffle=False)
    res = robustness(model, src, batches=1, micro_batch=4, drop_fractions=(0.5,), n_subsets=4)
    assert all(abs(s.rise) < 1e-5 for s in res.fractions[0].subsets)
