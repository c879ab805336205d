"""SparseLoCo: DiLoCo's local steps with a sparse, 2-bit, error-fed outer pseudo-gradient.

As in :mod:`skiptrain.dp.diloco` (its base class), every iteration hands the replica's own mean gradient to the
one optimizer path (AdamW: the inner step, no communication).  After that step, every
``H = dp.sync_every`` iterations:

* the pseudo-gradient ``delta = anchor - p`` (anchor: the parameters after the previous outer
  step) is folded into a per-replica error-feedback accumulator in chunk space,
  ``e = dp.ef_decay * e + C(delta)`` (:class:`~skiptrain.dp.dct.ChunkedDCT`, plain chunks unless
  ``dp.dct``);
* the top ``dp.topk`` coefficients of every chunk, quantised with ``dp.values`` (``sign2``: 2
  bits each plus one scale), leave in one bucketed payload with packed indices (``dp.indices``);
  once the gather is validated, what was sent is subtracted from ``e``
  (:class:`~skiptrain.dp.sparse.SparseExchange`);
* the replicas' sparse contributions are averaged (summed, divided by the replica count), and an
  outer Nesterov step is taken on that average: ``v = mu v + d``;
  ``p = anchor - outer_lr (d + mu v)`` (``dp.outer_lr``, ``dp.outer_momentum``); ``anchor = p``.

Parameters are bit-identical on every replica after each outer step (everyone decodes the same
payloads the same way) and drift by design between them; consistency checks run on sync steps.
Bytes per sync: the payload (see ``payload_bytes``), per iteration that over ``H``.
"""

from __future__ import annotations

import torch

from .diloco import DiLoCoStrategy
from .sparse import SparseExchange


class SparseLoCoStrategy(DiLoCoStrategy):
    """DiLoCo's local steps (inherited ``_exchange``) with a sparse, error-fed outer step."""

    name = "sparseloco"

    def __init__(self, named_params, transport, dp_cfg, optim_cfg):
        super().__init__(named_params, transport, dp_cfg, optim_cfg)
        self.ef_decay = dp_cfg.ef_decay
        self.sparse = SparseExchange(self.named, dp_cfg, transport)
        self.layout = self.sparse.layout
        self.e = self.sparse.zeros()

    @property
    def payload_bytes(self) -> int:
        return self.sparse.payload_bytes

    @torch.no_grad()
    def _after_update(self, lr: float) -> int | None:
        if not self.interval_due(self.H):
            return None
        geo = self.sparse.geo
        for x, p in self.named:
            self.e[x].mul_(self.ef_decay).add_(geo[x].forward((self.anchor[x] - p).float()))
        decoded = self.sparse.exchange(self.e, max(self.n_since, 1))
        total = sum(decoded.weights)
        self.n_since = 0
        mu, olr = self.dp.outer_momentum, self.dp.outer_lr
        for x, d in self.sparse.average(decoded, by="replicas").items():
            p = self.params[x]
            self.v[x].mul_(mu).add_(d)
            p.copy_(self.anchor[x] - olr * (d + mu * self.v[x]))
            self.anchor[x].copy_(p)
        return total

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["syncs"] = self.sparse.syncs
        for x, _ in self.named:
            st["tensors"][x]["error_feedback"] = self.e[x].clone()
        return st

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sparse.syncs = int(state["syncs"])
        for x, _ in self.named:
            self.e[x].copy_(state["tensors"][x]["error_feedback"])
