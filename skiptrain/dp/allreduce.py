"""Baseline: gradients averaged by one dense all-reduce per step (fp32 or bf16), then AdamW.

All summed gradients and this replica's micro-batch count are flattened into one buffer and
summed over the group in a single all-reduce; the mean gradient ``sum / total_count`` is what
the optimizer (``skiptrain.optim``, AdamW) applies after the global clip.  ``allreduce_bf16``
casts the buffer to bfloat16 before the all-reduce (half the bytes; the summation itself runs
in bf16, like ``bf16_compress_hook``); the count travels in the same buffer and is exact in bf16
up to 256 micro-batches per step.  If no replica processed a micro-batch, parameters are not
updated (the step is counted).  In a group of one nothing is exchanged: the mean is local.
"""

from __future__ import annotations

import torch

from .strategy import SyncStrategy


class AllReduceStrategy(SyncStrategy):
    def __init__(self, named_params, transport, dp_cfg, optim_cfg):
        super().__init__(named_params, transport, dp_cfg, optim_cfg)
        self.name = dp_cfg.strategy  # "allreduce" or "allreduce_bf16"
        self.dtype = torch.bfloat16 if self.name == "allreduce_bf16" else torch.float32

    @torch.no_grad()
    def _exchange(self, grads: dict[str, torch.Tensor], n: int, lr: float):
        if self.world == 1:
            total = n
        else:
            def contribution():
                return torch.cat([g.reshape(-1) for g in grads.values()]
                                 + [torch.tensor([float(n)], device=self.device)]).to(self.dtype)
            flat = contribution()
            self.tr.all_reduce_sum(flat, contribution)
            flat = flat.float()
            total = int(round(float(flat[-1])))
            off = 0
            for g in grads.values():
                g.copy_(flat[off: off + g.numel()].view_as(g))
                off += g.numel()
        if total == 0:
            return None, True, 0
        for g in grads.values():
            g.div_(total)
        return grads, True, total
