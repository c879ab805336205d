"""Baseline: AdamW on gradients averaged by one dense all-reduce per step (fp32 or bf16).

All summed gradients and this replica's micro-batch count are flattened into one buffer and
summed over the group in a single all-reduce; the mean gradient is ``sum / total_count``,
clipped by global norm (``train.grad_clip``), and fed to :class:`~skiptrain.dp.adamw.AdamW`.
``allreduce_bf16`` casts the buffer to bfloat16 before the all-reduce (half the bytes; the
summation itself runs in bf16, like ``bf16_compress_hook``); the count travels in the same
buffer and is exact in bf16 up to 256 micro-batches per step.
If no replica processed a micro-batch, the step is skipped for parameters (counted, not applied).
"""

from __future__ import annotations

import torch

from .adamw import AdamW, clip_
from .strategy import SyncStrategy


class AllReduceStrategy(SyncStrategy):
    def __init__(self, named_params, transport, dp_cfg, optim_cfg):
        super().__init__(named_params, transport, dp_cfg, optim_cfg)
        self.name = dp_cfg.strategy  # "allreduce" or "allreduce_bf16"
        self.dtype = torch.bfloat16 if self.name == "allreduce_bf16" else torch.float32
        self.adam = AdamW(self.named, (optim_cfg.beta1, optim_cfg.beta2), weight_decay=optim_cfg.weight_decay)

    @torch.no_grad()
    def _sync_and_update(self, lr: float, n: int) -> tuple[bool, int]:
        grads = self._grads()
        flat = torch.cat([g.reshape(-1) for g in grads.values()] + [torch.tensor([float(n)])]).to(self.dtype)
        self.tr.all_reduce_sum(flat)
        flat = flat.float()
        total = int(round(float(flat[-1])))
        if total == 0:
            return True, 0
        off = 0
        for name, g in grads.items():
            g.copy_(flat[off: off + g.numel()].view_as(g)).div_(total)
            off += g.numel()
        clip_(grads, self.opt.grad_clip)
        self.adam.step(lr, grads)
        return True, total

    def state_dict(self) -> dict:
        st = super().state_dict()
        a = self.adam.state_dict()
        st["adam_t"], st["tensors"] = a["t"], a["tensors"]
        return st

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.adam.load_state_dict({"t": state["adam_t"], "tensors": state["tensors"]})
