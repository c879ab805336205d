"""The one optimizer path: a name-keyed optimizer, the learning-rate schedule and the global clip.

Every way of training (one process hosting every stage, a swarm of node processes, data
parallelism alone) updates its parameters the same way (:func:`skiptrain.runtime.step.optimizer_step`):
the data-parallel sync strategy turns each stage's summed gradients into an update input, one
clip by the *global* gradient norm scales it, and one optimizer built here applies it.

* ``adamw``: :class:`torch.optim.AdamW` (fused where torch has the kernel), decoupled weight
  decay on matrices only.  Sync strategies that average gradients (all-reduce, PowerSGD) and
  DiLoCo's inner steps feed it.
* ``direction``: :class:`DirectionDescent`, ``p -= lr * d`` with the same decoupled weight decay,
  for strategies whose output is already a unit-scale direction (DeMo's sign of the decoded
  momentum).

Optimizer state is addressed by global parameter name wherever it leaves the process
(:mod:`skiptrain.checkpoint.state`), so it reshards and transfers under any layout.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .config import TrainConfig

RULES = ("adamw", "direction")


class DirectionDescent(torch.optim.Optimizer):
    """``p *= 1 - lr * weight_decay`` (per group), then ``p -= lr * d`` with ``d = p.grad``.

    Stateless: the direction is computed by the caller (e.g. DeMo's ``sign`` of the decoded
    momentum); parameters whose ``grad`` is None are left untouched.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if g["weight_decay"]:
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(p.grad.to(p.dtype), alpha=-g["lr"])
        return None


def build_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: TrainConfig,
                    rule: str = "adamw") -> torch.optim.Optimizer:
    """The optimizer over ``(name, param)`` pairs: weight decay on >=2-D tensors, none on norms.

    ``rule`` is ``adamw`` (the fused CPU/GPU kernel when torch has one, else foreach) or
    ``direction`` (:class:`DirectionDescent`).  Frozen parameters (``requires_grad`` off) are
    left out.
    """
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if rule == "direction":
        return DirectionDescent(groups, lr=cfg.lr)
    if rule != "adamw":
        raise ValueError(f"unknown optimizer rule {rule!r}; choose one of {RULES}")
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kw)


def build_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """:func:`build_optimizer` with the ``adamw`` rule."""
    return build_optimizer(named_params, cfg, "adamw")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    total = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, max(0, step - cfg.warmup_steps) / total)
    floor = cfg.lr * cfg.min_lr_frac
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_clock(step: int, cfg: TrainConfig) -> float:
    """The learning rate summed over optimizer steps ``0..step-1``, in units of the peak rate:
    training progress follows the integrated rate, so the freeze guard takes it as its time axis."""
    return sum(lr_at(s, cfg) for s in range(step)) / cfg.lr


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def squared_norm(tensors: Iterable[torch.Tensor]) -> float:
    """Sum of squares of every element (per-tensor norms in the tensors' dtype, summed in float64)."""
    ts = [t for t in tensors if t is not None and t.numel()]
    if not ts:
        return 0.0
    return float(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in ts))


def clip_coefficient(total_sq: float, max_norm: float) -> float:
    """The factor that brings a gradient of squared norm ``total_sq`` to at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``'s rule; 1.0 when the clip is off or not needed)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_sq) + 1e-6))
