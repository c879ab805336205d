"""skiptrain.dp: data-parallel sync strategies and their registry.

:func:`make_strategy` builds the strategy named by ``dp.strategy`` (:mod:`.strategy` has the
contract every strategy follows).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .accountant import ByteAccountant
from .allreduce import AllReduceStrategy
from .demo import DeMoStrategy
from .diloco import DiLoCoStrategy
from .link import LINK_PRESETS, LinkModel, RingLinks
from .powersgd import PowerSGDStrategy
from .sparseloco import SparseLoCoStrategy
from .strategy import StrategyError, SyncStats, SyncStrategy
from .transport import Transport

STRATEGIES: dict[str, type[SyncStrategy]] = {
    "allreduce": AllReduceStrategy, "allreduce_bf16": AllReduceStrategy, "powersgd": PowerSGDStrategy,
    "diloco": DiLoCoStrategy, "demo": DeMoStrategy, "sparseloco": SparseLoCoStrategy}


def update_rule_of(dp_cfg) -> str:
    """The optimizer rule (:mod:`skiptrain.optim`) that ``dp.strategy`` feeds, from the config
    alone (:meth:`SyncStrategy.rule_for`)."""
    if dp_cfg.strategy not in STRATEGIES:
        raise StrategyError(f"unknown dp.strategy {dp_cfg.strategy!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[dp_cfg.strategy].rule_for(dp_cfg)


def make_strategy(dp_cfg, named_params: Iterable[tuple[str, torch.nn.Parameter]], group=None,
                  optimizer_cfg=None, link: LinkModel | RingLinks | None = None, wait=None) -> SyncStrategy:
    """Build the strategy ``dp_cfg.strategy`` for ``named_params`` replicated over ``group``.

    ``dp_cfg`` is a :class:`skiptrain.config.DPConfig`; ``optimizer_cfg`` a
    :class:`skiptrain.config.TrainConfig` (default: its defaults).  ``group`` is any initialised
    gloo process group (None: the default group, or a group of one when torch.distributed is not
    initialised).  ``link`` overrides the link emulation of ``dp_cfg`` (``dp.link`` or
    ``link_up_mbps`` etc., :meth:`LinkModel.from_config`).  The strategy's state lives on the
    parameters' device; collectives run there with ``dp.backend=nccl`` (``group`` an NCCL group),
    on the host with gloo.  ``wait`` (a swarm node's): how each collective's work is waited for
    (:class:`~skiptrain.dp.transport.Transport`; None: blocking calls).
    """
    from ..config import TrainConfig

    if dp_cfg.strategy not in STRATEGIES:
        raise StrategyError(f"unknown dp.strategy {dp_cfg.strategy!r}; choose one of {sorted(STRATEGIES)}")
    if link is None:
        link = LinkModel.from_config(dp_cfg)
    named_params = list(named_params)
    on_params = next((p.device for _, p in named_params), torch.device("cpu"))
    comm = on_params if getattr(dp_cfg, "backend", "gloo") == "nccl" else torch.device("cpu")
    tr = Transport(group, link, ByteAccountant(1), comm, wait)
    tr.acct.world = tr.world
    return STRATEGIES[dp_cfg.strategy](named_params, tr, dp_cfg, optimizer_cfg or TrainConfig())


__all__ = ["LINK_PRESETS", "STRATEGIES", "LinkModel", "RingLinks", "StrategyError", "SyncStats", "SyncStrategy", "make_strategy",
           "update_rule_of"]
