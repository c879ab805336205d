"""The pluggable data-parallel sync interface.

A *sync strategy* owns the optimizer of a set of parameters replicated over a process group
(the whole model's replicas, or the replicas of one pipeline stage) and keeps the replicas in
sync.  Build one with :func:`make_strategy` and call :meth:`SyncStrategy.step` once per
iteration, after backward::

    strat = make_strategy(cfg.dp, model.named_parameters(), group, cfg.train)
    for it in range(steps):
        for p in params: p.grad = None
        n = 0
        for x, y in my_micro_batches:           # may be none at all
            model(x, y)[1].backward(); n += 1   # grads accumulate: SUM over micro-batches
        stats = strat.step(lr(it), n)           # sync + exactly one optimizer step

Contract of ``step(lr, n_processed)``:

* on entry each ``param.grad`` holds the **sum** of the loss gradients of the ``n_processed``
  micro-batches this replica ran this iteration (``None`` or zeros when ``n_processed == 0``);
* every replica of the group must call it (a replica that processed nothing still takes part
  in the collectives, with ``n_processed = 0``);
* it performs the exchange and exactly one optimizer step; after it returns, parameters are
  bit-identical on all replicas (DiLoCo: after every sync step; between syncs replicas drift by
  design);
* the gradient average is weighted by micro-batch counts: dense strategies all-reduce the
  summed gradients and counts and divide; DeMo weights each replica's coefficients by its count
  (see :mod:`skiptrain.dp.demo`); if no replica processed anything, parameters only see weight
  decay / momentum;
* errors: a peer's malformed payload raises :class:`~skiptrain.dp.payload.PayloadError` and a
  failed consistency check :class:`~skiptrain.dp.consistency.ConsistencyError` on every rank,
  before anything is applied; a dead peer raises gloo's error after the group's timeout.

Parameters are ordered by global name, so replicas whose modules were built in another order
still agree; at construction the group checks that every replica has the same names and shapes.

``state_dict()`` returns ``{"strategy", "step", "tensors": {global name: {state: tensor}}, ...}``;
tensor states are keyed by global parameter name so checkpoints can be resharded by name.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import UserError
from .accountant import ByteAccountant
from .consistency import check_consistency
from .link import LinkModel
from .transport import Transport


@dataclass
class SyncStats:
    step: int                 # iterations completed, this one included
    synced: bool              # whether this iteration exchanged data and updated parameters
    n_total: int              # micro-batches processed by the whole group (synced steps; else local)
    payload_bytes: int        # what this node contributed to the collectives this step
    received_bytes: int       # what this node downloaded (ring algorithms)
    dense_fp32_bytes: int     # payload of a dense fp32 all-reduce of the same parameters
    comm_s: float             # wall time spent in collectives (emulated delay included)
    checked: bool = False     # whether the consistency hashes were compared this step


class StrategyError(UserError, RuntimeError):
    """Replicas were built inconsistently (names/shapes differ) or a state does not fit."""


class SyncStrategy:
    """Base class: parameter bookkeeping, consistency checks, accounting.  Subclasses implement
    :meth:`_sync_and_update` and the state of their optimizer."""

    name = "base"

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], transport: Transport,
                 dp_cfg, optim_cfg):
        self.named = sorted(((n, p) for n, p in named_params if p.requires_grad), key=lambda t: t[0])
        if not self.named:
            raise StrategyError("a sync strategy needs at least one trainable parameter")
        self.params = dict(self.named)
        self.tr = transport
        self.dp, self.opt = dp_cfg, optim_cfg
        self.n_params = sum(p.numel() for _, p in self.named)
        self.tr.acct.n_params = self.n_params
        self.step_count = 0
        self._check_layout()

    # ---- helpers for subclasses ----------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.tr.rank

    @property
    def world(self) -> int:
        return self.tr.world

    def _grads(self) -> dict[str, torch.Tensor]:
        return {n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                for n, p in self.named}

    def _check_layout(self) -> None:
        desc = "|".join(f"{n}:{tuple(p.shape)}" for n, p in self.named)
        h = torch.tensor([zlib.crc32(desc.encode()), self.n_params], dtype=torch.int64)
        allh = self.tr.all_gather_tensor(h, account=False)
        bad = [r for r, x in enumerate(allh) if not torch.equal(x, allh[0])]
        if bad:
            raise StrategyError(f"data-parallel replicas disagree on parameter names/shapes: ranks {bad} "
                                "differ from rank 0; every replica of a group must hold the same tensors")

    # ---- the interface -------------------------------------------------------------------

    def step(self, lr: float, n_processed: int) -> SyncStats:
        if n_processed < 0:
            raise ValueError(f"n_processed must be >= 0, got {n_processed}")
        c0 = self.tr.comm_s
        self.step_count += 1
        synced, n_total = self._sync_and_update(float(lr), int(n_processed))
        checked = False
        k = getattr(self.dp, "check_every", 0)
        if synced and k and self.step_count % k == 0:
            check_consistency(self.named, self.tr, self.step_count)
            checked = True
        sb = self.tr.acct.end_step()
        return SyncStats(self.step_count, synced, n_total, sb.payload, sb.received, 4 * self.n_params,
                         self.tr.comm_s - c0, checked)

    def check_consistency(self) -> None:
        """Compare parameter hashes across the group now (raises ConsistencyError)."""
        check_consistency(self.named, self.tr, self.step_count)

    def _sync_and_update(self, lr: float, n: int) -> tuple[bool, int]:
        """Exchange and update; return (synced, micro-batches over the group)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"strategy": self.name, "step": self.step_count, "tensors": {}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("strategy") != self.name:
            raise StrategyError(f"state is for strategy {state.get('strategy')!r}, this is {self.name!r}")
        missing = [n for n, _ in self.named if n not in state["tensors"]] if state["tensors"] else []
        if missing:
            raise StrategyError(f"state lacks tensors {missing[:3]}{'...' if len(missing) > 3 else ''}")
        self.step_count = int(state["step"])

    def summary(self) -> dict:
        return self.tr.acct.summary()


def make_strategy(dp_cfg, named_params: Iterable[tuple[str, torch.nn.Parameter]], group=None,
                  optimizer_cfg=None, link: LinkModel | None = None) -> SyncStrategy:
    """Build the strategy ``dp_cfg.strategy`` for ``named_params`` replicated over ``group``.

    ``dp_cfg`` is a :class:`skiptrain.config.DPConfig`; ``optimizer_cfg`` a
    :class:`skiptrain.config.TrainConfig` (betas, weight decay, clip; default: its defaults).
    ``group`` is any initialised gloo process group (None: the default group, or a group of one
    when torch.distributed is not initialised).  ``link`` overrides the link emulation of
    ``dp_cfg`` (``link_up_mbps`` etc.).
    """
    from ..config import TrainConfig
    from .allreduce import AllReduceStrategy
    from .demo import DeMoStrategy
    from .diloco import DiLoCoStrategy
    from .powersgd import PowerSGDStrategy

    optimizer_cfg = optimizer_cfg or TrainConfig()
    if link is None:
        link = LinkModel(dp_cfg.link_up_mbps, dp_cfg.link_down_mbps, dp_cfg.link_latency_ms)
    tr = Transport(group, link, ByteAccountant(1))
    tr.acct.world = tr.world
    kinds = {"allreduce": AllReduceStrategy, "allreduce_bf16": AllReduceStrategy,
             "powersgd": PowerSGDStrategy, "diloco": DiLoCoStrategy, "demo": DeMoStrategy}
    if dp_cfg.strategy not in kinds:
        raise StrategyError(f"unknown dp.strategy {dp_cfg.strategy!r}; choose one of {sorted(kinds)}")
    return kinds[dp_cfg.strategy](named_params, tr, dp_cfg, optimizer_cfg)
