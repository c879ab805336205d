"""Baseline: DiLoCo (Douillard et al. 2023): H local AdamW steps, then an outer Nesterov step.

Like torchft's ``DiLoCo`` it wraps the optimizer instead of owning one: every iteration
:meth:`exchange` hands the replica's own mean gradient to the one optimizer path (AdamW, the
inner step; no communication; inner optimizer state is per replica).  After that step, every
``H = dp.sync_every`` iterations:

* pseudo-gradient ``delta_r = anchor - p_r`` (anchor = parameters after the previous sync),
  weighted by the micro-batches the replica processed since then; one fp32 all-reduce of all
  weighted deltas plus the counts gives ``delta = sum_r n_r delta_r / sum_r n_r``;
* outer Nesterov SGD: ``v = mu v + delta``; ``p = anchor - outer_lr (delta + mu v)``
  (``dp.outer_lr`` 0.7, ``dp.outer_momentum`` 0.9 by default); ``anchor = p``.

Parameters are bit-identical on every replica after each sync and differ between syncs by
design; consistency checks therefore run only on sync steps.  Bytes per sync ``4P + 4``,
per iteration ``(4P + 4) / H``.
"""

from __future__ import annotations

import torch

from .strategy import SyncStrategy


class DiLoCoStrategy(SyncStrategy):
    name = "diloco"
    replicas_drift = True

    def __init__(self, named_params, transport, dp_cfg, optim_cfg):
        super().__init__(named_params, transport, dp_cfg, optim_cfg)
        self.H = dp_cfg.sync_every
        self.anchor = {n: p.detach().clone() for n, p in self.named}
        self.v = {n: torch.zeros_like(p) for n, p in self.named}
        self.n_since = 0

    @torch.no_grad()
    def _exchange(self, grads: dict[str, torch.Tensor], n: int, lr: float):
        self.n_since += n
        if n == 0:
            return None, False, 0
        for g in grads.values():
            g.div_(n)
        return grads, False, n

    @torch.no_grad()
    def _after_update(self, lr: float) -> int | None:
        if not self.interval_due(self.H):
            return None
        w = float(self.n_since)
        def contribution():
            return torch.cat([(self.anchor[x] - p).reshape(-1) * w for x, p in self.named]
                             + [torch.tensor([w], device=self.device)])
        flat = contribution()
        self.tr.all_reduce_sum(flat, contribution)
        total = float(flat[-1])
        self.n_since = 0
        off = 0
        mu, olr = self.dp.outer_momentum, self.dp.outer_lr
        for x, p in self.named:
            d = flat[off: off + p.numel()].view_as(p)
            off += p.numel()
            d = d / total if total > 0 else torch.zeros_like(d)
            self.v[x].mul_(mu).add_(d)
            p.copy_(self.anchor[x] - olr * (d + mu * self.v[x]))
            self.anchor[x].copy_(p)
        return int(total)

    def state_tensor_names(self) -> list[str]:
        return [n for n, _ in self.named]

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["n_since"] = self.n_since
        st["tensors"] = {x: {"anchor": self.anchor[x].clone(), "outer_momentum": self.v[x].clone()}
                         for x, _ in self.named}
        return st

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.n_since = int(state["n_since"])
        for x, _ in self.named:
            self.anchor[x].copy_(state["tensors"][x]["anchor"])
            self.v[x].copy_(state["tensors"][x]["outer_momentum"])
