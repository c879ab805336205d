"""The collectives a sync strategy uses, with byte accounting and optional link emulation.

:class:`Transport` wraps one torch.distributed process group (any gloo group, sub-groups
included; ``group=None`` with no initialised default group means a group of one).  Every call
records what this node sent and received in an :class:`~skiptrain.dp.accountant.ByteAccountant`
and, when a :class:`~skiptrain.dp.link.LinkModel` is set, sleeps for the modelled transfer time.

Device: a collective runs on ``device``, the device of the group's backend (the CPU for gloo, the
replica's GPU for NCCL, ``dp.backend``); a tensor elsewhere is copied there for the collective
and the result copied back into it, so strategies hand in tensors on their parameters' device.

Failure semantics: a dead peer makes gloo raise within the group's timeout (set it short, e.g.
``timedelta(seconds=60)`` in ``init_process_group``); the error propagates to the caller
unchanged.  Nothing here retries.  An all-reduce whose sum is not finite (checked on its total:
one pass at memory speed) is done again as an all-gather of every member's contribution (built
again by the caller's ``contribution``, or a copy kept): members that sent a non-finite value are
named in a :class:`NonFiniteContribution` (global ranks), so the caller can blame the sender and
not a node downstream of it; when every contribution is finite (a member sent NaN to the
all-reduce only), their sum is the result.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .accountant import ByteAccountant
from .link import LinkModel


class NonFiniteContribution(RuntimeError):
    """Members of a group sent non-finite values to a sum (``ranks``: their global ranks; empty
    when every contribution was finite and the sum itself overflowed)."""

    def __init__(self, msg: str, ranks: list[int]):
        super().__init__(msg)
        self.ranks = ranks


class Transport:
    def __init__(self, group=None, link: LinkModel | None = None,
                 accountant: ByteAccountant | None = None, device: torch.device | None = None):
        self.group = group
        self.device = device or torch.device("cpu")
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            if group is not None:
                raise ValueError("a process group was given but torch.distributed is not initialised")
            self.world, self.rank = 1, 0
        self.link = link or LinkModel()
        self.acct = accountant or ByteAccountant(self.world)
        self.emulated_s = 0.0
        self.comm_s = 0.0  # wall time inside collectives, emulated delay included

    def _delay(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
            self.emulated_s += seconds

    def all_gather_bytes(self, buf: np.ndarray) -> list[np.ndarray]:
        """All-gather one equal-size uint8 buffer per node; returns the buffers by rank."""
        buf = np.ascontiguousarray(buf, dtype=np.uint8)
        self.acct.add_all_gather(buf.size)
        if self.world == 1:
            return [buf.copy()]
        t0 = time.perf_counter()
        t = torch.from_numpy(buf).to(self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        self._delay(self.link.all_gather_s(buf.size, self.world))
        self.comm_s += time.perf_counter() - t0
        return [o.cpu().numpy() for o in out]

    def all_reduce_sum(self, t: torch.Tensor, contribution: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """Sum a tensor over the group in place (in its own dtype) and return it.  ``contribution``
        builds ``t``'s value again (it is only called when the sum is not finite); without it a
        copy of ``t`` is kept for that."""
        nbytes = t.numel() * t.element_size()
        self.acct.add_all_reduce(nbytes)
        if self.world > 1:
            t0 = time.perf_counter()
            mine = t.clone() if contribution is None else None   # (to find the sender of a non-finite value)
            on = t.to(self.device)            # t itself when it is on the backend's device
            dist.all_reduce(on, op=dist.ReduceOp.SUM, group=self.group)
            if on is not t:
                t.copy_(on)
            self._delay(self.link.all_reduce_s(nbytes, self.world))
            self.comm_s += time.perf_counter() - t0
            if not bool(torch.isfinite(t.sum())):       # (NaN and inf reach the total; an overflow of it
                t.copy_(self._sum_of_finite(mine if contribution is None else contribution()))   # is sorted out there)
        return t

    def _sum_of_finite(self, mine: torch.Tensor) -> torch.Tensor:
        """The sum again, from every member's contribution gathered; raises
        :class:`NonFiniteContribution` naming the members whose contribution is not finite."""
        parts = self.all_gather_tensor(mine)
        bad = [i for i, p in enumerate(parts) if not bool(torch.isfinite(p).all())]
        ranks = [dist.get_global_rank(self.group, i) if self.group is not None else i for i in bad]
        if bad:
            raise NonFiniteContribution(f"the gradient sum is not finite: group member(s) {bad} sent "
                                        "non-finite values", ranks)
        total = torch.stack(parts).sum(0)
        if not bool(torch.isfinite(total).all()):
            raise NonFiniteContribution("the gradient sum overflowed (every contribution is finite): "
                                        "lower the learning rate or use fp32 sync", [])
        return total

    def all_gather_tensor(self, t: torch.Tensor, account: bool = True) -> list[torch.Tensor]:
        """All-gather an equal-shape tensor (control traffic such as hashes)."""
        if account:
            self.acct.add_all_gather(t.numel() * t.element_size(), control=True)
        if self.world == 1:
            return [t.clone()]
        t0 = time.perf_counter()
        on = t.contiguous().to(self.device)
        out = [torch.empty_like(on) for _ in range(self.world)]
        dist.all_gather(out, on, group=self.group)
        out = [o.to(t.device) for o in out]
        if account:
            self._delay(self.link.all_gather_s(t.numel() * t.element_size(), self.world))
            self.comm_s += time.perf_counter() - t0
        return out
