"""The reference every overhead figure compares against: the minimal training loop a PyTorch user
writes by hand (same model, data, optimizer, clip and precision as the run's config)."""

from __future__ import annotations


def plain_step(cfg, ds, device="cpu"):
    """``step(i)``: one iteration of the hand-written loop on global batch ``i`` of ``ds``."""
    import torch

    from skiptrain.data.loader import SampleSource
    from skiptrain.model import StagedLM
    from skiptrain.model.device import autocast

    t = cfg.train
    torch.manual_seed(t.seed)
    model = StagedLM(cfg.model, seed=t.seed, device=device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
    src = SampleSource(ds.tokens("train"), cfg.model.seq_len, seed=t.seed)
    B = t.micro_batch * t.n_micro

    def step(i: int) -> None:
        x, y = src.batch(range(i * B, (i + 1) * B))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with autocast(torch.device(device), t.precision):
            for j in range(t.n_micro):
                sl = slice(j * t.micro_batch, (j + 1) * t.micro_batch)
                (model(x[sl], y[sl])[1] / t.n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()

    return step
