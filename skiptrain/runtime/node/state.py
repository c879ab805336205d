"""What one node holds while it runs a phase, and how far an iteration got."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..job import Phase


@dataclass
class PhaseState:
    """Everything one node holds while it runs a phase (what a layout change replaces).

    ``stages``: the stages this node serves (ascending; empty: none), all in ``model``, each
    with its sync strategy in ``strats`` and one optimizer ``opt`` over them.  ``stage`` and
    ``strat`` name the first of them (the one of a node that serves one: what takeover and
    joins move; a freeze transition moves every stage a node served)."""
    ph: Phase
    idx: int
    sched: Any
    stages: list[int]
    model: Any
    strats: dict[int, Any]
    opt: Any
    groups: dict
    cost: Any
    topo: Any
    emulation: Any           # runtime.emulation.Emulation: the phase's emulation and measurement seam
    out_dir: Path
    order: dict[int, int]
    record: dict
    replan_pending: bool = False
    ex: Any = None
    gb: int = 0
    it: int = 0
    cursor: int = 0
    drift: Any = None
    drift_state: dict = field(default_factory=dict)
    elastic: Any = None      # runtime.freezing.SwarmFreezing when elastic.enabled

    @property
    def stage(self) -> int | None:
        return self.stages[0] if self.stages else None

    @stage.setter
    def stage(self, stage: int | None) -> None:
        self.stages = [] if stage is None else [stage]

    @property
    def strat(self):
        return self.strats.get(self.stages[0]) if self.stages else None

    @strat.setter
    def strat(self, strat) -> None:
        self.strats = {self.stages[0]: strat} if strat is not None and self.stages else {}

    def slot(self, node: int) -> int:
        """``node``'s replica position in its stages (the same in each: see
        :func:`skiptrain.config.node_stage_placement`)."""
        return self.sched.placement[self.stages[0]].index(node)


@dataclass
class Attempt:
    """One attempt at an iteration: how far it got (for recovery)."""
    step_count: int
    lr: float
    committed: bool = False
    stepped: bool = False
    samples: list[int] = field(default_factory=list)
    entry: dict | None = None
    res: Any = None
    outcome: Any = None
    exchanged: Any = None       # runtime.step.Exchanged: the sync done, not yet applied
    sync_state: dict | None = None   # the strategies' state before the sync (recovery mode: to rewind it)
    rewound: bool = False       # a recovery put the strategies' state back from before the sync
    sync_t0: float = 0.0        # when the sync began and ended (seconds after the iteration's start)
    sync_t1: float = 0.0


    @property
    def applied(self) -> bool:
        """Whether this node's optimizer stepped on the iteration (its statistics may not be done)."""
        return self.stepped or (self.exchanged is not None and self.exchanged.applied)


class StopRequested(Exception):
    """Every node agreed, at an iteration boundary, that the launcher asked to stop."""
