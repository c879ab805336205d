import torch

from skiptrain.config import build_config
from skiptrain.data.loader import shard_indices
from skiptrain.model import StagedLM
from skiptrain.train.metrics import read_metrics
from skiptrain.optim import lr_at, lr_clock
from skiptrain.train.trainer import Trainer


def cfg_for(data, **train):
    return build_config("tiny", overrides={"data": {"path": str(data)},
                                           "train": {"progress": False, **train}})


def test_training_on_real_text_beats_unigram_baseline(byte_data, tmp_path):
    tr = Trainer(cfg_for(byte_data, steps=100, eval_every=50), tmp_path / "run")
    s = tr.fit()
    # A context-free model reaches the unigram loss; the transformer must go well below it.
    assert s["val_loss"] < s["unigram_val_loss"] - 0.5, s
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 100 and sum(losses[-10:]) < sum(losses[:10])
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_skip_training_averages_each_stage_over_its_visitors(byte_data):
    """After one skip-trained step, each stage's gradient is the mean of the per-micro-batch
    gradients of the micro-batches whose route visited it (the runtime's per-stage rule)."""
    cfg = cfg_for(byte_data, skip_ratio=0.25, n_micro=4, grad_clip=0.0, lr=0.0, weight_decay=0.0)
    cfg.model.n_stages, cfg.model.n_layers, cfg.model.stage0_layers = 4, 4, 1
    tr = Trainer(cfg)
    res = tr.train_step()
    assert all(len(r) == 2 for r in res.routes)  # round(0.25 * 4) = 1 of 3 body stages skipped
    ref = StagedLM(cfg.model, seed=cfg.train.seed)
    x, y = tr.train_src.batch(shard_indices(0, cfg.train.micro_batch * cfg.train.n_micro))
    per_mb = []
    for i, route in enumerate(res.routes):
        ref.zero_grad(set_to_none=True)
        sl = slice(i * cfg.train.micro_batch, (i + 1) * cfg.train.micro_batch)
        ref(x[sl], y[sl], route=route)[1].backward()
        per_mb.append({n: (p.grad.clone() if p.grad is not None else None) for n, p in ref.named_parameters()})
    got = dict(tr.model.named_parameters())
    for s in range(cfg.model.n_stages):
        names = {n for n, p in ref.named_parameters() if any(p is q for q in ref.stage_parameters(s))}
        visitors = [i for i, r in enumerate(res.routes) if s == 0 or s in r]
        assert visitors
        for n in names:
            want = sum(per_mb[i][n] for i in visitors) / len(visitors)
            torch.testing.assert_close(got[n].grad, want, rtol=1e-4, atol=1e-6)


def test_training_is_deterministic(byte_data):
    a = Trainer(cfg_for(byte_data, skip_ratio=0.25, max_swaps=1))
    b = Trainer(cfg_for(byte_data, skip_ratio=0.25, max_swaps=1))
    for _ in range(3):
        ra, rb = a.train_step(), b.train_step()
        assert ra.loss == rb.loss and ra.routes == rb.routes
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


def test_lr_schedule():
    cfg = build_config("tiny", overrides={"train": {"steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_frac": 0.1}}).train
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert abs(lr_at(100, cfg) - 0.1) < 1e-9
    assert all(lr_at(i, cfg) >= lr_at(i + 1, cfg) for i in range(10, 100))


def test_lr_clock_is_the_learning_rate_summed_in_units_of_the_peak():
    cfg = build_config("tiny", overrides={"train": {"steps": 100, "warmup_steps": 10, "lr": 0.5, "min_lr_frac": 1.0}}).train
    assert lr_clock(0, cfg) == 0.0
    assert abs(lr_clock(10, cfg) - 5.5) < 1e-12          # the warm-up: (1 + ... + 10) / 10
    assert abs(lr_clock(30, cfg) - 25.5) < 1e-12         # then a step per step (no decay at min_lr_frac 1)
