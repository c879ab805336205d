"""Sparse exchange with error feedback: the compression DeMo and SparseLoCo share.

Each replica keeps, per parameter tensor, an accumulator in chunk space (:class:`ChunkedDCT`:
chunks of ``dp.chunk`` elements per side, DCT-transformed when ``dp.dct``).  At a sync
:meth:`SparseExchange.exchange`:

1. keeps the ``dp.topk`` largest-magnitude coefficients of every chunk, quantised with the value
   encoding ``dp.values``, and after the gather subtracts exactly what the others decode of them
   from the accumulator (error feedback: the residual, quantisation error included, stays local
   for the next sync);
2. frames every tensor's indices and values as one fixed-size byte payload
   (:mod:`skiptrain.dp.payload`) and all-gathers it: one collective per sync;
3. validates every peer's payload before anything is used (:class:`~skiptrain.dp.payload.PayloadError`
   names the peer).

:meth:`SparseExchange.average` turns the gathered payloads back into dense tensors (inverse DCT,
padding cropped): each coefficient averaged over the replicas that sent it, weighted by their
micro-batch counts (``by="senders"``, DeMo), or summed over every replica and divided by the
replica count (``by="replicas"``: an unbiased average of sparse pseudo-gradients, SparseLoCo).
Every replica decodes the same payloads in the same rank order with the same operations, so the
result is bit-identical on all of them.  Accumulators, transforms and averages live on the
parameters' device; only the payload bytes pass through the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dct import ChunkedDCT
from .encoding import INDEX_LIMIT
from .payload import PayloadLayout, TensorSpec
from .strategy import StrategyError


class SparseExchange:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], dp_cfg, transport):
        self.device = named[0][1].device
        self.geo = {n: ChunkedDCT(p.shape, dp_cfg.chunk, dp_cfg.dct, self.device) for n, p in named}
        self.k = {n: min(dp_cfg.topk, g.chunk_numel) for n, g in self.geo.items()}
        for n, g in self.geo.items():
            if g.chunk_numel > INDEX_LIMIT[dp_cfg.indices]:
                raise StrategyError(f"tensor {n}: chunks of {g.chunk_numel} elements do not fit "
                                    f"{dp_cfg.indices} indices; use a smaller dp.chunk or wider dp.indices")
        self.layout = PayloadLayout(
            [TensorSpec(n, tuple(p.shape), self.geo[n].n_chunks, self.geo[n].chunk_numel, self.k[n])
             for n, p in named], dp_cfg.indices, dp_cfg.values)
        self.tr = transport
        self.syncs = 0          # sync counter (payload header "step"; replicas are in lock-step)

    @property
    def payload_bytes(self) -> int:
        return self.layout.nbytes

    def zeros(self) -> dict[str, torch.Tensor]:
        """A chunk-space accumulator of zeros per tensor."""
        return {n: torch.zeros(g.n_chunks, g.chunk_numel, device=self.device) for n, g in self.geo.items()}

    def exchange(self, acc: dict[str, torch.Tensor], weight: int) -> "Gathered":
        """Send the top-k of every chunk of ``acc``; returns every replica's validated weight and
        ``(indices, values)``, stacked in rank order.  Error feedback: when ``weight`` > 0, what
        the others decode of this replica's payload (its own row of the gathered values, so the
        values are encoded once) is then subtracted from ``acc``; a replica that processed
        nothing keeps its residual, and a sync that fails leaves ``acc`` as it was."""
        picked = {}
        for name, m in acc.items():
            idx = m.abs().topk(self.k[name], dim=1, sorted=False).indices
            picked[name] = (idx, m.gather(1, idx))
        bufs = self.tr.all_gather_bytes(self.layout.encode(self.syncs, weight, picked))
        weights, tensors = self.layout.decode_all(bufs, list(range(len(bufs))), expect_step=self.syncs)
        self.syncs += 1
        if weight > 0:
            me = self.tr.rank
            for name, (idx, v) in picked.items():
                acc[name].scatter_(1, idx, v - tensors[name][1][me].to(v.device))
        return Gathered(weights, tensors)

    def average(self, gathered: "Gathered", by: str = "senders") -> dict[str, torch.Tensor]:
        """Dense tensors from the gathered payloads (see the module doc for ``by``): every
        replica's coefficients go into one scatter per tensor."""
        n = len(gathered.weights)
        weights = [float(w) for w in gathered.weights]
        if by == "replicas" or sum(weights) == 0:
            weights = [1.0] * n
        per_replica = torch.tensor(weights, device=self.device).view(n, 1, 1)
        out = {}
        for name, geo in self.geo.items():
            idx, val = (t.to(self.device) for t in gathered.tensors[name])        # (replicas, n_chunks, k)
            w = per_replica.expand_as(val)
            idx, val, w = (t.permute(1, 0, 2).reshape(geo.n_chunks, -1) for t in (idx, val * w, w))
            acc = torch.zeros(geo.n_chunks, geo.chunk_numel, device=self.device).scatter_add_(1, idx, val)
            if by == "replicas":
                avg = acc / n
            else:
                wsum = torch.zeros_like(acc).scatter_add_(1, idx, w)
                avg = torch.where(wsum > 0, acc / wsum.clamp_min(1e-30), torch.zeros((), device=self.device))
            out[name] = geo.inverse(avg)
        return out


class Gathered(NamedTuple):
    """What one sync gathered: each replica's weight (micro-batches since its previous sync) and,
    per tensor, every replica's ``(indices, values)`` of shape ``(replicas, n_chunks, k)``."""
    weights: list[int]
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
