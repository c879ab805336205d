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
unchanged.  ``wait`` (optional) waits for each collective's work instead of blocking in it: a
swarm node's waits, while its sync runs before the iteration's commit, give up as soon as its
membership changes (raising), so a sync whose peer left it is abandoned at once rather than
after the group's timeout (with gloo; the hierarchical sum's point-to-point steps block: gloo's
send and receive works never report completion).  Nothing here retries.  An all-reduce whose
sum is not finite (checked on its total:
one pass at memory speed) is done again as an all-gather of every member's contribution (built
again by the caller's ``contribution``, or a copy kept): members that sent a non-finite value are
named in a :class:`NonFiniteContribution` (global ranks), so the caller can blame the sender and
not a node downstream of it; when every contribution is finite (a member sent NaN to the
all-reduce only), their sum is the result.

Hierarchical sum: when the link is a :class:`~skiptrain.dp.link.HierarchicalLinks` that picks the
hierarchical shape for the bytes at hand, :meth:`Transport.all_reduce_sum` runs the cost model's
three phases (:meth:`skiptrain.schedule.cost.CostModel.sync_phases`) point to point inside the
group: every region reduce-scatters over its ring so that piece ``j`` of ``k`` is summed at its
``j``-th member; piece ``j`` is summed over the ring of every region's ``j``-th member; every
region gathers the pieces back over its ring.  A region with more than ``2k`` members sums over
its ring instead, twice, the second time each member contributing the piece it summed across regions
(zeros elsewhere, none for a member without a piece).  Each ring runs the chains of
:mod:`skiptrain.schedule.sync_rings` over ``isend``/``irecv`` (:meth:`Transport.ring_pass`; a sum
is a reduce-scatter then an all-gather, :meth:`Transport.ring_sum`), so every member ends with the
same bits.  No process group is created for it: the groups of a
swarm are created by every rank in one order (the node's layout), and regions are named by
group rank, derived by every member from the job's topology.  The non-finite check and its
all-gather run over the whole group as for one all-reduce.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..schedule.sync_rings import chain_starts, moves_at
from .accountant import ByteAccountant
from .link import HierarchicalLinks, LinkModel


class NonFiniteContribution(RuntimeError):
    """Members of a group sent non-finite values to a sum (``ranks``: their global ranks; empty
    when every contribution was finite and the sum itself overflowed)."""

    def __init__(self, msg: str, ranks: list[int]):
        super().__init__(msg)
        self.ranks = ranks


class Transport:
    def __init__(self, group=None, link: LinkModel | None = None,
                 accountant: ByteAccountant | None = None, device: torch.device | None = None,
                 wait: Callable | None = None):
        self.group = group
        self.wait = wait        # (work) -> None: how a collective's work is waited for (None: block in it)
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

    def _collective(self, fn, *args, **kw) -> None:
        """``fn(*args, **kw)`` on this group, waited for by :attr:`wait` where set."""
        if self.wait is None:
            fn(*args, group=self.group, **kw)
        else:
            self.wait(fn(*args, group=self.group, async_op=True, **kw))

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
        self._collective(dist.all_gather, out, t)
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
            if isinstance(self.link, HierarchicalLinks) and on.is_contiguous() and \
                    self.link.hierarchical(nbytes, self.world):
                self._hierarchical_sum(on.view(-1), self.link)
            else:
                self._collective(dist.all_reduce, on, op=dist.ReduceOp.SUM)
            if on is not t:
                t.copy_(on)
            self._delay(self.link.all_reduce_s(nbytes, self.world))
            self.comm_s += time.perf_counter() - t0
            if not bool(torch.isfinite(t.sum())):       # (NaN and inf reach the total; an overflow of it
                t.copy_(self._sum_of_finite(mine if contribution is None else contribution()))   # is sorted out there)
        return t

    def _hierarchical_sum(self, flat: torch.Tensor, links: HierarchicalLinks) -> None:
        """The three phases of the hierarchical sum (module doc), in place on 1-D ``flat``."""
        i = next(i for i, r in enumerate(links.regions) if self.rank in r)
        region, owners = links.regions[i], links.owners[i]
        k = len(links.shards)
        if owners:
            self.ring_pass(flat, region, "scatter", owners)
        else:
            self.ring_sum(flat, region)
        pieces = flat.tensor_split(k)
        j = next((i for i, ring in enumerate(links.shards) if self.rank in ring), None)
        if j is not None:
            self.ring_sum(pieces[j], links.shards[j])
        if owners:
            self.ring_pass(flat, region, "gather", owners)
        else:
            keep = pieces[j].clone() if j is not None else None
            flat.zero_()
            if keep is not None:
                pieces[j].copy_(keep)
            self.ring_sum(flat, region)
        flat.add_(0.0)        # (-0.0 + 0.0 is +0.0: the regions that summed with zeros and those that copied agree)

    def ring_sum(self, x: torch.Tensor, ring: tuple[int, ...]) -> None:
        """Sum 1-D contiguous ``x`` in place over the group ranks ``ring`` (this rank among them;
        in ring order): a reduce-scatter into one piece per member (member ``i`` sums piece
        ``i + 1``) then its all-gather, so every member ends with the same bits."""
        n = len(ring)
        owners = tuple(ring[(j - 1) % n] for j in range(n))
        self.ring_pass(x, ring, "scatter", owners)
        self.ring_pass(x, ring, "gather", owners)

    def ring_pass(self, x: torch.Tensor, ring: tuple[int, ...], op: str, owners: tuple[int, ...]) -> None:
        """One pass of 1-D contiguous ``x`` in place over the group ranks ``ring`` (this rank among
        them; in ring order), cut into ``len(owners)`` pieces: ``"scatter"`` leaves piece ``j``
        summed over the ring at ``owners[j]``, ``"gather"`` copies every owner's piece to every
        member (the chains of :mod:`skiptrain.schedule.sync_rings`, each step a send to the next
        member and a receive from the previous)."""
        n = len(ring)
        if n < 2:
            return
        me = ring.index(self.rank)
        nxt, prv = ring[(me + 1) % n], ring[(me - 1) % n]
        parts = x.tensor_split(len(owners))
        starts = chain_starts(n, op, [ring.index(o) for o in owners])
        for out, into in moves_at(n, starts, n - 1, me):
            works, buf = [], None
            if out is not None and parts[out].numel():
                works.append(dist.isend(parts[out], group=self.group, group_dst=nxt))
            if into is not None and parts[into].numel():
                buf = torch.empty_like(parts[into])
                works.append(dist.irecv(buf, group=self.group, group_src=prv))
            for w in works:     # (blocking: gloo's send and receive works never report completion)
                w.wait()
            if buf is None:
                continue
            if op == "scatter":
                parts[into].add_(buf)
            else:
                parts[into].copy_(buf)

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
        self._collective(dist.all_gather, out, on)
        out = [o.to(t.device) for o in out]
        if account:
            self._delay(self.link.all_gather_s(t.numel() * t.element_size(), self.world))
            self.comm_s += time.perf_counter() - t0
        return out
