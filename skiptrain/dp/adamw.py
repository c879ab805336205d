"""A plain AdamW whose state is keyed by global parameter name (for reshardable checkpoints).

Decoupled weight decay applies to matrices only (``ndim >= 2``), as in the rest of skiptrain.
The update is a fixed sequence of element-wise float32 operations, so replicas that feed it
identical gradients stay bit-identical.
"""

from __future__ import annotations

import math

import torch


class AdamW:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.named = named
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.t = 0
        self.m = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}
        self.v = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}

    @torch.no_grad()
    def step(self, lr: float, grads: dict[str, torch.Tensor]) -> None:
        self.t += 1
        bc1 = 1 - self.b1 ** self.t
        bc2 = 1 - self.b2 ** self.t
        for n, p in self.named:
            g = grads[n]
            m, v = self.m[n], self.v[n]
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            if self.wd and p.ndim >= 2:
                p.mul_(1 - lr * self.wd)
            denom = (v / bc2).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / bc1)

    def state_dict(self) -> dict:
        return {"t": self.t, "tensors": {n: {"exp_avg": self.m[n].clone(), "exp_avg_sq": self.v[n].clone()}
                                         for n, _ in self.named}}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        for n, _ in self.named:
            self.m[n].copy_(state["tensors"][n]["exp_avg"])
            self.v[n].copy_(state["tensors"][n]["exp_avg_sq"])


def mean_and_clip_(grads: dict[str, torch.Tensor], count: float, max_norm: float) -> float:
    """Turn summed ``grads`` into their mean over ``count`` micro-batches, then :func:`clip_`."""
    for g in grads.values():
        g.div_(count)
    return clip_(grads, max_norm)


def clip_(grads: dict[str, torch.Tensor], max_norm: float) -> float:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``; return the norm."""
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    if max_norm > 0 and total > max_norm:
        s = max_norm / (total + 1e-6)
        for g in grads.values():
            g.mul_(s)
    return total
