"""The planner on large swarms: plan each cell of nearby nodes, then spend what is left of the
time limit on the cell that sets the iteration time.

:func:`plan_regions` (called by :func:`~.planner.plan` when the topology is cut into more than
one cell, :func:`~.cells.default_cells`):

1. **Cells** (:mod:`.cells`): nodes grouped by hop distance into cells of about
   :data:`~.cells.CELL_NODES`; each cell's stage sizes split by work (spare nodes of equally
   loaded body stages on the deepest ones, :func:`~.placement.stage_sizes` ``deep_ties``) or the
   given sizes dealt to the cells, and the body-stage visit quotas dealt to the cells, so that
   every cell is a whole pipeline and the swarm stays balanced.
2. **Within cells**: each distinct cell problem (cells with the same speeds, sizes, quotas and
   links share one plan, whatever their locations are called) is planned by
   :func:`~.planner.plan` on its own nodes (placement search, constructions, simulator-scored
   search) with ``FIRST_SHARE`` of the time limit split evenly over the distinct problems; then
   each is planned again, deeper, with what is left of that share (:func:`_deepen`).  Routes
   never leave their cell, so a cell's search move re-simulates that cell only: the cells share
   no node and no link (with link contention on, the swarm's pipeline is exactly the union of
   the cells' pipelines).  The data-parallel sync spans cells; it depends on the placement only
   and is left to the final simulation.
3. **Between cells**: the iteration ends with the slowest cell, so the rest of the limit goes,
   chunk by chunk, to the currently slowest cell (:func:`~.local_search.improve_routes`); a cell
   that stops improving is planned again with another seed and as deep a search as its plan had
   (placement included; the better plan is kept; at most ``RESTARTS`` times), and the chunks go
   on until the limit is spent.

:func:`replan_regions` re-plans after nodes fail or join, from the plan in force: cells keep
their nodes (a joiner goes to the nearest cell; a cell left with fewer than two nodes per stage
merges into its nearest cell), untouched cells keep their placement and routes, and only the
changed cells' nodes are cut into cells again and planned (placement and routes), then step 3.  Both bound every phase
by the CPU-seconds limit (``PlanConfig.time_limit_s``, default :func:`~.planner.default_time_limit`).
The planner calls in (:func:`~.planner.plan`, :func:`~.planner.replan`) with its own search
functions (:class:`Search`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from ..net.topology import Topology
from .cells import deal_quotas, group_cells, hop_distance, split_sizes
from .cost import CostModel
from .placement import stage_sizes
from .routes import visits_per_route
from .schedule import MicroBatch, Schedule
from .simulator import simulate

FIRST_SHARE = 0.6    # share of the time limit for planning the cells one by one (the rest: step 3)
CHUNK_EVALS = 150    # simulations per step-3 round on the slowest cell
RESTARTS = 8         # step 3: a stuck slowest cell is planned again with another seed, at most this often
STUCK_ROUNDS = 3     # step 3: the slowest cell is restarted after this many rounds in a row without improvement
DEEPEN_MIN = 2.0     # step 2: a second, deeper plan of a cell only when it buys this many times the first's simulations


@dataclass
class Search:
    """The planner's two entry points this module uses (passed in: the planner imports this
    module, not the other way round): ``plan(topo, cost, cfg)`` and ``improve(schedule, topo,
    cost, contention, dp_sync, rng, max_evals, time_limit_s)`` (:func:`~.local_search.improve_routes`)."""
    plan: Callable
    improve: Callable


@dataclass
class Cell:
    """One distinct cell problem: its sub-topology (nodes in canonical order) and its schedule in
    local ids; ``members`` lists, per cell of the swarm it serves, that cell's global node ids in
    the same order (identical cells share one plan)."""
    topo: Topology
    sched: Schedule
    members: list[list[int]]
    cfg: Any | None = None      # how it was planned (None: the plan in force, kept)
    pipeline_s: float = 0.0
    stuck: int = 0                     # step-3 rounds in a row without improvement
    restarts: int = 0


class _Clock:
    """CPU seconds since the start, against the limit."""

    def __init__(self, limit: float):
        self.c0, self.t0, self.limit = time.process_time(), time.perf_counter(), limit

    def used(self) -> float:
        return time.process_time() - self.c0

    def left(self) -> float:
        return max(0.0, self.limit - self.used())


def _cell_time(cell: Cell, cost: CostModel, contention: bool) -> float:
    cell.pipeline_s = simulate(cell.sched, cell.topo, cost, contention=contention, dp_sync=False,
                               record=False).iteration_s
    return cell.pipeline_s


def _canonical(topo: Topology, nodes: Sequence[int], stage_of: dict[int, int]) -> tuple[list[int], tuple]:
    """``nodes`` in canonical order (stage, location, speed, id) and the key of the cell's problem
    up to the ids and the location names: two cells with equal keys and equal link matrices are the
    same problem (a plan sees the nodes' speeds and the links, not what a location is called)."""
    order = sorted(nodes, key=lambda n: (stage_of.get(n, -1), topo.nodes[n].location, topo.nodes[n].speed, n))
    return order, tuple((stage_of.get(n, -1), topo.nodes[n].speed) for n in order)


def _same_links(a: Topology, b: Topology) -> bool:
    return np.array_equal(a.latency_s, b.latency_s) and np.array_equal(a.bandwidth_Bps, b.bandwidth_Bps)


class _Cells:
    """The distinct cell problems planned so far (:class:`Cell`), found again by key and matrices."""

    def __init__(self, topo: Topology, cost: CostModel, cfg: Any, search: Search):
        self.topo, self.cost, self.cfg, self.search = topo, cost, cfg, search
        self.cells: list[Cell] = []
        self.index: dict[tuple, list[int]] = {}
        self.evals = 0
        self.cpu_s = 0.0           # CPU seconds of the cells' plans (their simulations per second)

    def problem(self, nodes: Sequence[int], sizes: list[int] | None, quotas: dict[int, int],
                placement: list[list[int]] | None) -> tuple[list[int], tuple, Topology]:
        """A cell's nodes in canonical order, its problem's key and its sub-topology."""
        stage_of = {n: s for s, p in enumerate(placement) for n in p} if placement is not None else {}
        order, key = _canonical(self.topo, nodes, stage_of)
        return order, (key, tuple(sizes or ()), tuple(sorted(quotas.items()))), self.topo.subset(order)

    def find(self, key: tuple, sub: Topology) -> Cell | None:
        """The planned cell that is the same problem, if any."""
        return next((self.cells[i] for i in self.index.get(key, ()) if _same_links(self.cells[i].topo, sub)), None)

    def add(self, nodes: Sequence[int], sizes: list[int] | None, quotas: dict[int, int],
            placement: list[list[int]] | None, limit: float) -> bool:
        """Plan one cell of the swarm (``placement`` in global ids kept when given, else searched
        with ``sizes``), or reuse the plan of an identical cell; True when it was planned."""
        order, key, sub = self.problem(nodes, sizes, quotas, placement)
        same = self.find(key, sub)
        if same is not None:
            same.members.append(order)
            return False
        pos = {n: i for i, n in enumerate(order)}
        local_pl = [[pos[n] for n in p if n in pos] for p in placement] if placement is not None else None
        ccfg = replace(self.cfg, cells=1, quotas=quotas, time_limit_s=limit, dp_sync=False, placement=local_pl,
                       stage_sizes=sizes if local_pl is None else [len(p) for p in local_pl])
        ccfg.seed = self.cfg.seed + len(self.cells)
        c0 = time.process_time()
        cell = Cell(sub, self.search.plan(sub, self.cost, ccfg), [order], cfg=ccfg)
        self.cpu_s += time.process_time() - c0
        self.evals += cell.sched.meta["planner"].get("evals", 0)
        _cell_time(cell, self.cost, self.cfg.contention)
        self.index.setdefault(key, []).append(len(self.cells))
        self.cells.append(cell)
        return True

    def count_new(self, jobs: list[tuple]) -> int:
        """How many distinct problems ``jobs`` of ``(nodes, sizes, quotas, placement)`` add."""
        seen: list[tuple[tuple, Topology]] = []
        for nodes, sizes, quotas, placement in jobs:
            _, key, sub = self.problem(nodes, sizes, quotas, placement)
            if self.find(key, sub) is None and not any(k == key and _same_links(t, sub) for k, t in seen):
                seen.append((key, sub))
        return len(seen)


def _restart(cell: Cell, cost: CostModel, contention: bool, limit: float, search: Search,
             max_evals: int | None = None) -> int:
    """Plan ``cell`` again with another seed (and ``max_evals`` simulations when given); the better
    plan is kept.  Returns the evaluations."""
    cell.restarts += 1
    ccfg = replace(cell.cfg, seed=cell.cfg.seed + 1000 * cell.restarts, time_limit_s=limit)
    if max_evals is not None:
        ccfg.max_evals = max_evals
    cand = Cell(cell.topo, search.plan(cell.topo, cost, ccfg), cell.members, cfg=cell.cfg)
    if _cell_time(cand, cost, contention) < cell.pipeline_s:
        cell.sched, cell.pipeline_s = cand.sched, cand.pipeline_s
    return cand.sched.meta["planner"].get("evals", 0)


def _improve_slowest(cells: list[Cell], cost: CostModel, cfg: Any, clock: _Clock, rng: random.Random,
                     search: Search) -> dict:
    """Step 3 (module doc): rounds of search on the slowest cell while time is left; a cell stuck
    for ``STUCK_ROUNDS`` rounds is planned again with another seed and as many simulations as its
    plan had (up to ``RESTARTS`` times), and its rounds go on from the better plan.  Ends at the
    limit, or when no move is possible."""
    rounds = evals = restarts = 0
    while cells and clock.left() > 0 and cfg.max_evals != 0:
        worst = max(cells, key=lambda c: c.pipeline_s)
        if worst.stuck >= STUCK_ROUNDS and worst.cfg is not None and worst.restarts < RESTARTS:
            depth = worst.sched.meta["planner"].get("evals", 0) if cfg.max_evals is None else None
            evals += _restart(worst, cost, cfg.contention, clock.left(), search, depth or None)
            restarts += 1
            worst.stuck = 0
            continue
        before = worst.pipeline_s
        worst.sched, st = search.improve(worst.sched, worst.topo, cost, cfg.contention, False, rng, CHUNK_EVALS,
                                         clock.left())
        if st["evals"] == 0:            # no move is possible (or no time left)
            break
        evals += st["evals"]
        rounds += 1
        worst.stuck = worst.stuck + 1 if _cell_time(worst, cost, cfg.contention) >= before - 1e-9 else 0
    return {"between_rounds": rounds, "between_evals": evals, "cell_restarts": restarts}


def _assemble(cells: list[Cell], cfg: Any, method: str, info: dict) -> Schedule:
    """The swarm's schedule: every member cell's placement appended stage by stage, its
    micro-batches after the previous cell's with ids renumbered, node ids mapped back."""
    placement: list[list[int]] = [[] for _ in range(cfg.n_stages)]
    mbs: list[MicroBatch] = []
    members = []
    for c in cells:
        order = {mb.id: k for k, mb in enumerate(sorted(c.sched.micro_batches, key=lambda m: m.id))}
        for ids in c.members:
            members.append(sorted(ids))
            for s, p in enumerate(c.sched.placement):
                placement[s] += [ids[n] for n in p]
            base = len(mbs)
            for mb in c.sched.micro_batches:      # list order is the injection order: kept
                mbs.append(MicroBatch(base + order[mb.id], ids[mb.originator],
                                      [(s, ids[n]) for s, n in mb.route], mb.start_s))
    info["cells"] = members
    info["cell_pipeline_s"] = [c.pipeline_s for c in cells for _ in c.members]
    info["distinct_cells"] = len(cells)
    return Schedule(placement=placement, micro_batches=mbs, memory=cfg.memory, skip_ratio=cfg.skip_ratio,
                    max_swaps=cfg.max_swaps, method=method,
                    meta={"planner": info, "seed": cfg.seed, "contention": cfg.contention, "dp_sync": cfg.dp_sync})


def _finish(cells: _Cells, cost: CostModel, cfg: Any, clock: _Clock, info: dict) -> Schedule:
    """Step 3, then the swarm's schedule with the planner's figures in ``meta["planner"]``."""
    info.update(_improve_slowest(cells.cells, cost, cfg, clock, random.Random(cfg.seed), cells.search))
    info["evals"] = cells.evals + info["between_evals"]
    info["time_capped"] = clock.left() <= 0
    info["planner_cpu_s"] = clock.used()
    info["planner_s"] = time.perf_counter() - clock.t0
    return _assemble(cells.cells, cfg, "planner" if cfg.collision_aware else "planner_no_ca", info)


def _plan_all(cells: _Cells, clock: _Clock, jobs: list[tuple]) -> int:
    """Step 2 over ``jobs`` of ``(nodes, sizes, quotas, placement)``: each new cell problem gets an
    even share of what is left of ``FIRST_SHARE`` of the limit (a cell that repeats one planned
    before costs nothing); then :func:`_deepen`.  Returns the cells planned again."""
    budget = FIRST_SHARE * clock.limit
    new = cells.count_new(jobs)
    for nodes, sizes, quotas, placement in jobs:
        share = max(0.0, budget - clock.used()) / max(1, new)
        if cells.add(nodes, sizes, quotas, placement, min(share, clock.left())):
            new -= 1
    return _deepen(cells, clock, budget)


def _deepen(cells: _Cells, clock: _Clock, budget: float) -> int:
    """What is left of step 2's ``budget`` (CPU seconds since the start) after every distinct cell's
    first plan: each is planned again with another seed and as many simulations as an even share
    of it buys at the rate measured on the first plans; the better plan is kept.  Only with the
    default search budget (``max_evals`` unset), and only when a share buys ``DEEPEN_MIN`` times
    a first plan's simulations.  Returns how many cells were planned again."""
    planned = [c for c in cells.cells if c.cfg is not None]
    if not planned or cells.cfg.max_evals is not None or cells.cpu_s <= 0:
        return 0
    rate, done = cells.evals / cells.cpu_s, 0
    for k, c in enumerate(sorted(planned, key=lambda c: -c.pipeline_s)):
        share = max(0.0, budget - clock.used()) / (len(planned) - k)
        first = c.sched.meta["planner"].get("evals", 0)
        if share * rate < DEEPEN_MIN * max(1, first):
            continue
        cells.evals += _restart(c, cells.cost, cells.cfg.contention, min(share, clock.left()), cells.search,
                                int(share * rate))
        done += 1
    return done


def plan_regions(topo: Topology, cost: CostModel, cfg: Any, n_cells: int, search: Search) -> Schedule:
    """Plan ``topo`` cut into ``n_cells`` cells (module doc, steps 1-3); ``cfg`` is a
    :class:`~.planner.PlanConfig` with its ``time_limit_s`` set."""
    cfg.check(topo.n)
    clock = _Clock(cfg.time_limit_s)
    groups = group_cells(topo, cost, n_cells)
    if cfg.stage_sizes is not None:           # the given sizes dealt to the cells
        cell_sizes = split_sizes(cfg.stage_sizes, groups)
    else:                                     # every cell split by work, as a swarm of its size
        cell_sizes = [stage_sizes(len(g), cfg.n_stages, cfg.skip_ratio, cost, deep_ties=True) for g in groups]
    v = visits_per_route(cfg.skip_ratio, cfg.n_stages)
    quotas = deal_quotas(cfg.n_stages, v, [cs[0] * cfg.mb_per_originator for cs in cell_sizes])
    info: dict[str, Any] = {"cells_s": clock.used(), "n_cells": len(groups), "cells_requested": n_cells}
    cells = _Cells(topo, cost, cfg, search)
    jobs = [(g, sz, q, None) for g, sz, q in zip(groups, cell_sizes, quotas)]
    info["deepened_cells"] = _plan_all(cells, clock, jobs)
    info["within_s"] = clock.used()
    return _finish(cells, cost, cfg, clock, info)


def _nearest(d: np.ndarray, node_or_nodes: Sequence[int], cells: list[list[int]], skip: int = -1) -> int:
    """The cell (index, not ``skip``, not empty) with the least mean hop distance to the nodes."""
    idx = list(node_or_nodes)
    best = min((float(d[np.ix_(idx, c)].mean()), i) for i, c in enumerate(cells) if c and i != skip)
    return best[1]


def _survivor_cells(topo: Topology, cost: CostModel, in_force: Schedule, alive: set[int],
                    min_nodes: int) -> tuple[list[list[int]], set[int]]:
    """Cells after failures and joins: (nodes per cell, indices of the changed cells).  A joiner
    goes to the nearest cell; a cell left with fewer than ``min_nodes`` nodes merges into its
    nearest cell.  A swarm planned whole is one cell."""
    old = [list(c) for c in in_force.meta.get("planner", {}).get("cells", [in_force.nodes()])]
    cells = [[n for n in c if n in alive] for c in old]
    changed = {i for i, c in enumerate(cells) if c != old[i]}
    d = hop_distance(topo, cost)
    for j in sorted(alive - {n for c in old for n in c}):
        i = _nearest(d, [j], cells)
        cells[i].append(j)
        changed.add(i)
    for i in range(len(cells)):
        if cells[i] and len(cells[i]) < min_nodes and sum(bool(c) for c in cells) > 1:
            k = _nearest(d, cells[i], cells, skip=i)
            cells[k] += cells[i]
            cells[i] = []
            changed.add(k)
    keep = [i for i, c in enumerate(cells) if c]
    return [sorted(cells[i]) for i in keep], {k for k, i in enumerate(keep) if i in changed}


def replan_regions(topo: Topology, cost: CostModel, cfg: Any, in_force: Schedule,
                   alive: Sequence[int], search: Search) -> Schedule:
    """Re-plan ``in_force`` (a schedule of :func:`~.planner.plan` on ``topo``) for the nodes
    ``alive`` (survivors and joiners, ids of ``topo``): the cells untouched keep their placement
    and routes; the nodes of the changed cells are cut into cells again (:func:`~.cells.group_cells`,
    the plan's cell size) and planned (placement and routes, as in :func:`plan_regions`), then
    step 3.  ``cfg.time_limit_s`` set: the same limit as a fresh plan."""
    clock = _Clock(cfg.time_limit_s)
    groups, changed = _survivor_cells(topo, cost, in_force, set(alive), 2 * cfg.n_stages)
    cells = _Cells(topo, cost, cfg, search)
    fixed = [0] * cfg.n_stages
    by_orig = in_force.by_originator()
    for i in sorted(set(range(len(groups))) - changed):     # untouched: the plan in force
        order = groups[i]
        pos = {n: k for k, n in enumerate(order)}
        pl = [[pos[n] for n in p if n in pos] for p in in_force.placement]
        mbs = [MicroBatch(mb.id, pos[mb.originator], [(s, pos[n]) for s, n in mb.route], mb.start_s)
               for o in pl[0] for mb in by_orig.get(order[o], [])]
        for mb in mbs:
            for s in mb.stages:
                fixed[s] += 1
        cell = Cell(topo.subset(order), Schedule(pl, mbs, in_force.memory, in_force.skip_ratio, in_force.max_swaps,
                                                 in_force.policy), [order])
        _cell_time(cell, cost, cfg.contention)
        cells.cells.append(cell)
    pool = sorted(n for i in changed for n in groups[i])   # the changed cells' nodes, cut again
    size = sum(len(g) for g in groups) / max(1, len(groups))
    todo = [[pool[n] for n in c] for c in group_cells(topo.subset(pool), cost, max(1, round(len(pool) / size)))] \
        if pool else []
    sizes = [stage_sizes(len(g), cfg.n_stages, cfg.skip_ratio, cost, deep_ties=len(groups) > 1)   # (a swarm
             for g in todo]                                                       # planned whole: as plan())
    v = visits_per_route(cfg.skip_ratio, cfg.n_stages)
    quotas = deal_quotas(cfg.n_stages, v, [sz[0] * cfg.mb_per_originator for sz in sizes], fixed)
    deepened = _plan_all(cells, clock, [(g, sz, q, None) for g, sz, q in zip(todo, sizes, quotas)])
    info: dict[str, Any] = {"deepened_cells": deepened, "n_cells": len(groups) - len(changed) + len(todo),
                            "replanned_cells": len(todo), "within_s": clock.used(),
                            "replanned_from": in_force.method}
    return _finish(cells, cost, cfg, clock, info)
