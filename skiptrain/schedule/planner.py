"""Network-aware skip-and-reorder route planner (SkipPipe's scheduling problem, in seconds).

:func:`plan` returns a :class:`~.schedule.Schedule` for one iteration:

1. **Placement** (:func:`~.placement.place`): stage sizes by work (stage 0 larger when
   skipping), nodes onto stages by local search on an estimate of the iteration time.  The
   estimate ranks placements only roughly, so the local optima of the search's restarts (up
   to ``PLACEMENTS_SMALL`` for <= 32 nodes, one above) all become candidates (step 4).
2. **Construction** (:func:`~.construction.construct_routes`): micro-batches are taken wave by wave, round-robin
   over originators; each picks the stage set, order (ascending up to ``max_swaps`` neighbour
   swaps) and replicas whose estimated finish is earliest given the load already reserved on
   every node (list scheduling; replicas by dynamic programming along the visit order).
   Balance holds by construction: every body stage has a quota of visits (``M * visits /
   (S - 1)``, +-1), and a stage whose quota equals the number of micro-batches still to plan
   must be taken, so the quotas always stay satisfiable.  Lane-like constructions
   (:func:`~.construction.construct_affinity`) are tried too; the simulator keeps the best start.
3. **Local search** (:func:`~.local_search.improve_routes`): balance-preserving moves (re-pick a micro-batch's
   replicas by hop cost, change a hop's replica, trade a stage or a replica between two
   micro-batches, exchange two routes, toggle a neighbour swap), half of them aimed at the
   critical originator, each scored by the discrete-event simulator
   (:func:`~.simulator.simulate` with the requested contention and DP-sync settings); a move is
   kept when the score is no worse (descent with plateau moves).  Deadlocking schedules score
   infinity, so they are never kept.
4. **Screening**: with several placement candidates, each gets ``SCREEN_SHARE`` / candidates of
   the search budget from its best start; the best one continues with the rest.

Collision awareness is steps 2 and 3: routes are chosen against each other's load and scored
with queueing on nodes and links.  ``collision_aware=False`` gives the "SkipPipe without
collision awareness" ablation: every micro-batch takes its individually cheapest route (as if
alone on the network) under the stage quotas, with one static load rule (no replica takes more
than ``NO_CA_SHARE_CAP`` times its speed-weighted share of its stage's visits) and no simulator
feedback.  The cap is the strongest of those measured for the ablation (docs/scheduler.md).

The search is deterministic for a given ``seed`` and ``max_evals``; ``time_limit_s`` (CPU
seconds of this process, default 80% of the planning-time target: 8 s for 20 nodes, 48 s for 64)
is a safety cap on every phase: the placement search stops at half of it
(``meta["planner"]["placement_capped"]``), no lane-like construction starts after it, and the
local search stops at it (``meta["planner"]["time_capped"]``); the first placement's estimate,
one constructive start per candidate and the final check always run.  When the cap cuts the
search, results can differ between machines.  The default budget (:func:`default_evals`) takes about 4 s of CPU for
20 nodes and about 25 s for 64 (full model), see docs/scheduler.md.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..net.topology import Topology
from .cells import default_cells
from .construction import PENALTIES, RouteContext, construct_affinity, construct_routes
from .local_search import improve_routes
from .regional import Search, plan_regions, replan_regions
from .cost import CostModel
from .placement import check_sizes, place, stage_sizes
from .routes import skip_count, visits_per_route
from .schedule import MicroBatch, Schedule, ScheduleError
from .simulator import simulate


@dataclass
class PlanConfig:
    """What to plan: stages, skip ratio, memory, micro-batches per originator, search budget."""
    n_stages: int = 6
    stage_sizes: list[int] | None = None
    skip_ratio: float = 0.33
    max_swaps: int = 2
    memory: int = 3
    mb_per_originator: int = 6
    seed: int = 0
    contention: bool = True        # model used to score candidates
    dp_sync: bool = True
    collision_aware: bool = True
    max_evals: int | None = None   # simulator calls in local search (None: by problem size)
    time_limit_s: float | None = None  # CPU-seconds cap (None: default_time_limit(n_nodes))
    placement: list[list[int]] | None = None  # skip placement search when given
    constructions: int | None = None  # lane-like starting points tried (None: by size)
    placements: int | None = None  # placement candidates screened with real routes (None: by size)
    anneal: float = 0.0            # local-search start temperature x start score (0: descent)
    cells: int | None = None       # regional decomposition (regional.py): cells (None: by size, 1: none)
    quotas: dict[int, int] | None = None  # visits per body stage (None: balanced, +-1); set per cell

    def check(self, n_nodes: int) -> None:
        if self.n_stages < 1:
            raise ScheduleError("need at least one stage")
        if self.memory < 1:
            raise ScheduleError(f"memory {self.memory}: every node needs at least one micro-batch "
                                "credit (memory >= 1)")
        if self.mb_per_originator < 1:
            raise ScheduleError("need at least one micro-batch per originator")
        if not 0 <= self.max_swaps <= 2:
            raise ScheduleError(f"max_swaps {self.max_swaps} must be 0, 1 or 2")
        if n_nodes < self.n_stages and self.placement is None:   # a given placement may share nodes
            raise ScheduleError(f"{n_nodes} nodes cannot serve {self.n_stages} stages: every stage needs "
                                "at least one node; add nodes or lower the number of stages")
        skip_count(self.skip_ratio, self.n_stages)  # raises when k is too large
        if self.placement is not None and len(self.placement) != self.n_stages:
            raise ScheduleError(f"placement {self.placement} does not list {self.n_stages} stages")
        if self.stage_sizes is not None:
            if len(self.stage_sizes) != self.n_stages:
                raise ScheduleError(f"stage sizes {self.stage_sizes} do not list {self.n_stages} stages")
            if self.placement is None:      # a given placement's nodes may serve several stages
                check_sizes(self.stage_sizes, n_nodes)


SCREEN_SHARE = 0.4  # share of the search budget spent screening placement candidates
PLACEMENT_SHARE = 0.5  # share of the time cap the placement search may use
PLACEMENTS_SMALL = 4  # placement candidates screened for topologies of <= 32 nodes (1 above)


def default_evals(n_mb: int) -> int:
    """Local-search budget in simulations: 4000 for 30 micro-batches, fewer for big problems
    (a simulation costs about 25 us per micro-batch; see docs/scheduler.md for measured times)."""
    return max(400, min(4000, 120000 // max(1, n_mb)))


def default_time_limit(n_nodes: int) -> float:
    """Safety cap in CPU seconds on the whole plan: 80% of the issue's limit (10 s for 20 nodes,
    60 s for 64, linear in between and beyond).  The eval budget normally ends the search well
    before (``meta["planner"]["time_capped"]`` says when it did not).  CPU time, not wall-clock,
    so that other jobs on a shared machine do not change the result."""
    limit = 10.0 + (n_nodes - 20) * (50.0 / 44.0)
    return 0.8 * max(10.0, limit)


def ascending_routes(sched: Schedule, topo: Topology, cost: CostModel) -> None:
    """Fall back from a credits deadlock (reordered routes) to ascending orders kept on their
    nodes (:meth:`Schedule.keep_on_nodes`), which cannot deadlock while every node's stages are
    consecutive (:func:`~.schedule.keep_on_node`); raises when they still do (a placement that
    gives a node stages that are not consecutive, which ``runtime.node_stages`` refuses)."""
    for mb in sched.micro_batches:
        mb.route = sorted(mb.route)
    sched.keep_on_nodes()
    if math.isinf(simulate(sched, topo, cost, contention=False, dp_sync=False, record=False).iteration_s):
        raise ScheduleError(f"placement {sched.placement}: the memory credits ({sched.memory}) deadlock even on "
                            "ascending routes; give a node consecutive stages (e.g. 1+2, not 1+3) or more memory")


def _candidates(topo: Topology, cost: CostModel, cfg: PlanConfig, sizes: list[int], deadline: float) -> list:
    """Placement candidates: the local optima of the placement search's restarts (step 1)."""
    k = cfg.placements if cfg.placements is not None else (PLACEMENTS_SMALL if topo.n <= 32 else 1)
    if cfg.max_evals == 0 or not cfg.collision_aware:
        k = 1  # no search to screen with: the placement search's best, as before
    cands = place(topo, sizes, cost, cfg.skip_ratio, cfg.memory, cfg.mb_per_originator, cfg.dp_sync, mode="skip",
                  seed=cfg.seed, restarts=max(4, k), return_all=True, deadline=deadline)
    return cands[:max(1, k)]


def _limited(cfg: PlanConfig, n_nodes: int) -> PlanConfig:
    """``cfg`` with its time limit set (:func:`default_time_limit` for ``n_nodes`` when unset)."""
    limit = cfg.time_limit_s if cfg.time_limit_s is not None else default_time_limit(n_nodes)
    return dataclasses.replace(cfg, time_limit_s=limit)


def replan(topo: Topology, cost: CostModel, cfg: PlanConfig, in_force: Schedule, alive: Sequence[int]) -> Schedule:
    """Re-plan ``in_force`` for the nodes ``alive`` (survivors and joiners, ids of ``topo``) from
    the plan in force, under the same limit as a fresh plan (:func:`~.regional.replan_regions`)."""
    return replan_regions(topo, cost, _limited(cfg, len(alive)), in_force, alive, Search(plan, improve_routes))


def plan(topo: Topology, cost: CostModel, cfg: PlanConfig) -> Schedule:
    """Plan one iteration: placement candidates, constructive routes, simulator-scored local search.

    Without ``cfg.placement`` the placement search's restarts give up to ``cfg.placements``
    distinct candidates; each gets its constructions and a short screening search, and the
    best continues with the rest of the budget.  A given ``cfg.placement`` is kept as it is, and
    its nodes may serve several stages (``runtime.node_stages``): compute is then weighed per
    stage and node, and a hop between two stages of one node costs nothing."""
    cells = cfg.cells if cfg.cells is not None else default_cells(topo.n)
    if cells > 1 and cfg.placement is None:        # large swarms: cell by cell (regional.py)
        return plan_regions(topo, cost, _limited(cfg, topo.n), cells, Search(plan, improve_routes))
    t0 = time.perf_counter()
    c0 = time.process_time()
    cfg.check(topo.n)
    if cost.n_stages != cfg.n_stages:
        raise ScheduleError(f"cost model has {cost.n_stages} stages but {cfg.n_stages} were requested")
    rng = random.Random(cfg.seed)
    if cfg.placement is None:
        sizes = cfg.stage_sizes or stage_sizes(topo.n, cfg.n_stages, cfg.skip_ratio, cost)
    time_limit = cfg.time_limit_s if cfg.time_limit_s is not None else default_time_limit(topo.n)

    def left() -> float:
        return max(0.0, time_limit - (time.process_time() - c0))

    cands = _candidates(topo, cost, cfg, sizes, c0 + PLACEMENT_SHARE * time_limit) if cfg.placement is None \
        else [[list(p) for p in cfg.placement]]
    t_place = time.perf_counter() - t0
    v = visits_per_route(cfg.skip_ratio, cfg.n_stages)
    method = "planner" if cfg.collision_aware else "planner_no_ca"

    def mk(pl: list[list[int]], mbs_: list[MicroBatch]) -> Schedule:
        return Schedule(placement=pl, micro_batches=mbs_, memory=cfg.memory, skip_ratio=cfg.skip_ratio,
                        max_swaps=cfg.max_swaps, method=method).keep_on_nodes()

    def sc(x: Schedule) -> float:
        return simulate(x, topo, cost, contention=cfg.contention, dp_sync=cfg.dp_sync, record=False).score()

    def starting_point(pl: list[list[int]]) -> tuple[float, Schedule]:
        ctx = RouteContext(topo, cost, pl)
        sched = mk(pl, construct_routes(ctx, pl[0], cfg.mb_per_originator, cfg.n_stages, v, cfg.max_swaps,
                                        cfg.memory, rng, aware=cfg.collision_aware, quotas=cfg.quotas))
        if not cfg.collision_aware:
            return math.nan, sched
        # several lane-like constructions too; keep the one the simulator likes best
        best_sc = sc(sched)
        n_con = cfg.constructions if cfg.constructions is not None else (12 if topo.n <= 32 else 4)
        for k in range(n_con):
            if left() <= 0:       # the time cap: the constructive start alone
                break
            oo = list(pl[0])
            rng.shuffle(oo)
            cand = mk(pl, construct_affinity(ctx, pl[0], cfg.mb_per_originator, cfg.n_stages, v,
                                             cfg.max_swaps, rng, PENALTIES[k % len(PENALTIES)], oo, cfg.quotas))
            x = sc(cand)
            if x < best_sc:
                best_sc, sched = x, cand
        return best_sc, sched

    info: dict[str, Any] = {"placement_s": t_place, "placement_candidates": len(cands), "placement_capped":
                            cfg.placement is None and time.process_time() - c0 > PLACEMENT_SHARE * time_limit}
    t_con = time.perf_counter()
    starts = [starting_point(pl) for pl in cands]
    info["construct_s"] = time.perf_counter() - t_con
    if not cfg.collision_aware:
        sched = starts[0][1]
    else:
        budget = cfg.max_evals if cfg.max_evals is not None else default_evals(len(starts[0][1].micro_batches))
        evals = 0
        pick = 0
        if len(starts) > 1 and budget > 0:
            # screening: a short search from every candidate; the best goes on with the rest
            each = max(1, int(budget * SCREEN_SHARE) // len(starts))
            screened = []
            for i, (_, s0) in enumerate(starts):
                s1, st = improve_routes(s0, topo, cost, cfg.contention, cfg.dp_sync, rng, each, left(),
                                        anneal=cfg.anneal)
                evals += st["evals"]
                screened.append((st["score"], i, s1))
            info["screen_scores"] = [x for x, _, _ in screened]
            _, pick, sched = min(screened, key=lambda x: (x[0], x[1]))
        else:
            sched = min(starts, key=lambda x: x[0])[1]
        info["placement_pick"] = pick
        sched, st = improve_routes(sched, topo, cost, cfg.contention, cfg.dp_sync, rng, max(0, budget - evals),
                                   left(), anneal=cfg.anneal)
        st["evals"] += evals
        info.update(st)
    if math.isinf(simulate(sched, topo, cost, contention=cfg.contention, dp_sync=cfg.dp_sync,
                           record=False).iteration_s):
        info["deadlock_fallback"] = True
        ascending_routes(sched, topo, cost)
    info["planner_s"] = time.perf_counter() - t0
    info["planner_cpu_s"] = time.process_time() - c0
    sched.meta = {"planner": info, "seed": cfg.seed, "contention": cfg.contention, "dp_sync": cfg.dp_sync}
    return sched
