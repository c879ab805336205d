"""Fit the cost model's per-task overhead (``fwd_task_s``, ``bwd_task_s``) to measured timelines.

:func:`done_times` reads, from a timeline in the simulator's format (the runtime writes the same,
:mod:`skiptrain.schedule.timeline`), when each micro-batch finished: the end of its stage-0
backward, from the first task's start.  :func:`fit_task_overhead` picks the forward and backward
overhead whose simulation of the same schedules comes closest to those finishes (least squares
over every micro-batch of every run given): a grid over ``[0, limit]`` for both, then finer grids
around the best point.  Everything else in the cost model stays as given.
"""

from __future__ import annotations

from typing import Sequence

from ..net.topology import Topology
from .cost import CostModel
from .schedule import Schedule
from .simulator import simulate
from .timeline import Event

GRID = 9          # points per axis and round
ROUNDS = 4        # each round narrows the grid around the best point by GRID / 2


def done_times(events: Sequence[Event]) -> dict[int, float]:
    """Per micro-batch id, the end of its stage-0 backward, from the earliest task start."""
    tasks = [e for e in events if e.kind in ("fwd", "bwd", "loss")]
    if not tasks:
        return {}
    t0 = min(e.start for e in tasks)
    return {e.mb: e.end - t0 for e in tasks if e.kind == "bwd" and e.stage == 0}


def _error(runs: Sequence[tuple[Schedule, dict[int, float]]], topo: Topology, cost: CostModel,
           contention: bool, f: float, b: float) -> float:
    c = cost.with_task_s(f, b)
    err = 0.0
    for sched, measured in runs:
        sim = simulate(sched, topo, c, contention=contention, dp_sync=False, record=False).mb_done_s
        err += sum((sim[j] - t) ** 2 for j, t in measured.items() if j in sim)
    return err


def fit_task_overhead(runs: Sequence[tuple[Schedule, dict[int, float]]], topo: Topology, cost: CostModel,
                      limit_s: float, contention: bool = True) -> tuple[float, float, float]:
    """(forward, backward overhead per task, root-mean-square error of the finishes in seconds)
    that best explain ``runs``: pairs of a schedule and its measured :func:`done_times`, simulated
    on ``topo`` with ``cost`` (its own overhead replaced) without DP sync."""
    lo_f = lo_b = 0.0
    step = limit_s / (GRID - 1)
    best = (0.0, 0.0, _error(runs, topo, cost, contention, 0.0, 0.0))
    for _ in range(ROUNDS):
        for i in range(GRID):
            for k in range(GRID):
                f, b = lo_f + i * step, lo_b + k * step
                if f < 0 or b < 0:
                    continue
                e = _error(runs, topo, cost, contention, f, b)
                if e < best[2]:
                    best = (f, b, e)
        step /= GRID / 2
        lo_f, lo_b = best[0] - (GRID - 1) / 2 * step, best[1] - (GRID - 1) / 2 * step
    n = sum(len(m) for _, m in runs)
    return best[0], best[1], (best[2] / max(1, n)) ** 0.5
