"""Baseline: PowerSGD (Vogels et al. 2019) low-rank gradient compression; AdamW applies the result.

Equivalent to ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` with error
feedback and warm start, re-implemented outside DDP so it fits the strategy interface and
its byte accounting:

* matrices where rank-r factors are smaller than the matrix (``r (rows + cols) < rows cols``):
  ``M = grad_sum + error``; ``P = M Q`` summed over the group; ``P`` orthogonalised (QR);
  ``Q = M^T P`` summed over the group; the group's summed gradient is approximated by ``P Q^T``
  and ``error = M - P Q^T / N`` stays local;
* other tensors (norm weights, small matrices) travel uncompressed in the first all-reduce,
  together with the micro-batch count.

Two all-reduces per step.  ``Q`` starts from the same seeded random matrix on every replica and
is reused (warm start) across steps.  The averaged gradient ``sum / total_count`` is what the
optimizer path (``skiptrain.optim``) clips and applies.  Bytes per step: ``4 * (sum(rows r) + uncompressed + 1) + 4 * sum(cols r)``.
"""

from __future__ import annotations

import torch

from .strategy import SyncStrategy


class PowerSGDStrategy(SyncStrategy):
    name = "powersgd"

    def __init__(self, named_params, transport, dp_cfg, optim_cfg):
        super().__init__(named_params, transport, dp_cfg, optim_cfg)
        r = dp_cfg.powersgd_rank
        self.low_rank: dict[str, int] = {}
        gen = torch.Generator().manual_seed(12345)
        self.q: dict[str, torch.Tensor] = {}
        self.err: dict[str, torch.Tensor] = {}
        for n, p in self.named:
            if p.ndim >= 2:
                rows, cols = p.shape[0], p.numel() // p.shape[0]
                rank = min(r, rows, cols)
                if rank * (rows + cols) < rows * cols:
                    self.low_rank[n] = rank
                    self.q[n] = torch.randn(cols, rank, generator=gen).to(self.device)   # same draw on any device
                    self.err[n] = torch.zeros(rows, cols, device=self.device)

    @torch.no_grad()
    def _exchange(self, grads: dict[str, torch.Tensor], n: int, lr: float):
        mats = {name: grads[name].reshape(grads[name].shape[0], -1) + self.err[name] for name in self.low_rank}
        ps = {name: m @ self.q[name] for name, m in mats.items()}
        dense = [name for name in grads if name not in self.low_rank]
        def contribution1():
            return torch.cat([ps[x].reshape(-1) for x in ps] + [grads[x].reshape(-1) for x in dense]
                             + [torch.tensor([float(n)], device=self.device)])
        buf1 = contribution1()
        self.tr.all_reduce_sum(buf1, contribution1)
        total = int(round(float(buf1[-1])))
        off = 0
        for name in ps:
            ps[name] = torch.linalg.qr(buf1[off: off + ps[name].numel()].view_as(ps[name])).Q
            off += ps[name].numel()
        for name in dense:
            grads[name].copy_(buf1[off: off + grads[name].numel()].view_as(grads[name]))
            off += grads[name].numel()
        qs = {name: mats[name].T @ ps[name] for name in mats}
        buf2 = torch.cat([qs[x].reshape(-1) for x in qs]) if qs else torch.zeros(0, device=self.device)
        if qs:
            self.tr.all_reduce_sum(buf2, lambda: torch.cat([qs[x].reshape(-1) for x in qs]))
        off = 0
        for name in qs:
            q = buf2[off: off + qs[name].numel()].view_as(qs[name])
            off += q.numel()
            approx_sum = ps[name] @ q.T
            self.err[name] = mats[name] - approx_sum / self.world
            self.q[name] = q.clone()
            grads[name].copy_(approx_sum.view_as(grads[name]))
        if total == 0:
            return None, True, 0
        for g in grads.values():
            g.div_(total)
        return grads, True, total

    def state_tensor_names(self) -> list[str]:
        return list(self.low_rank)

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["tensors"] = {name: {"powersgd_q": self.q[name].clone(), "powersgd_error": self.err[name].clone()}
                         for name in self.low_rank}
        return st

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for name in self.low_rank:
            self.q[name] = state["tensors"][name]["powersgd_q"].to(self.device, copy=True)
            self.err[name] = state["tensors"][name]["powersgd_error"].to(self.device, copy=True)
