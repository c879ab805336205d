"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine schedule."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def build_adamw(named_params, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``(name, param)`` pairs: weight decay on >=2-D tensors, none on norms.

    Uses the fused CPU/GPU kernel when torch has one for these parameters, else foreach.
    """
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kw)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    total = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / total)
    floor = cfg.lr * cfg.min_lr_frac
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
