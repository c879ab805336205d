"""Baseline schedules, built from the same placement, cost model and simulator as the planner.

* :func:`full_pipeline` -- no skipping, fixed lanes (DT-FM-like lane placement; on large swarms
  lanes of nearby nodes placed cell by cell, :func:`~.cells.lanes_in_cells`, and ``sizes`` only
  gives the number of stages): lane ``i`` is the ``i``-th node of every stage; the global batch is split evenly over the lanes; ``order``
  ``"1f1b"`` or ``"gpipe"`` sets the task priority on nodes.
* :func:`random_skip` -- balanced random stage sets (ascending), replicas drawn at random with an
  equal share of visits per replica: every route constraint kept, the network ignored except
  that no hop uses an unusable link (slower than :meth:`CostModel.usable_hop_s`, e.g. geo12's
  NL-London link at 0.00024 GB/s: 132 s per hop), like SkipPipe's DT-FM-skip baseline.  One
  seed is one draw; compare reports the mean over several.
* :func:`swarm_greedy` -- SWARM-style wiring: micro-batches in injection order, each hop to the
  replica with the earliest expected finish (expected arrival vs. the replica's queue), with
  balanced random stage sets (``skip=True``) or the full pipeline (``skip=False``).
* ``planner_no_ca`` -- :func:`skiptrain.schedule.planner.plan` with ``collision_aware=False``.

All of them return a :class:`~.schedule.Schedule` with ``method`` set and the same micro-batch
count: ``mb_per_originator`` times the number of stage-0 nodes of the skip placement (the full
pipeline processes that same global batch on its lanes).
"""

from __future__ import annotations

import math
import random
from typing import Sequence

from ..net.topology import Topology
from .cells import default_cells, lanes_in_cells
from .cost import CostModel
from .placement import place
from .routes import balanced_routes
from .schedule import MicroBatch, Schedule


def full_pipeline(topo: Topology, cost: CostModel, sizes: Sequence[int], n_micro: int, memory: int,
                  order: str = "1f1b", dp_sync: bool = True, seed: int = 0,
                  placement: list[list[int]] | None = None) -> Schedule:
    """Fixed lanes without skipping; ``n_micro`` micro-batches spread over ``min(sizes)`` lanes."""
    S = len(sizes)
    cells = default_cells(topo.n)
    if placement is None and cells > 1:      # a large swarm: lanes placed cell by cell, like the planner
        placement = lanes_in_cells(topo, S, cost, memory, max(1, n_micro // max(1, min(sizes))), cells, seed)
    pl = placement or place(topo, sizes, cost, 0.0, memory, max(1, n_micro // max(1, sizes[0])),
                            dp_sync, mode="lanes", seed=seed)
    L = min(len(p) for p in pl)
    mbs = []
    per_lane = [n_micro // L + (1 if i < n_micro % L else 0) for i in range(L)]
    k = 0
    for w in range(max(per_lane)):
        for i in range(L):
            if w < per_lane[i]:
                mbs.append(MicroBatch(k, pl[0][i], [(s, pl[s][i]) for s in range(1, S)], 0.0))
                k += 1
    return Schedule(placement=pl, micro_batches=mbs, memory=memory, skip_ratio=0.0, max_swaps=0,
                    policy=order, method=f"full_pipeline_{order}",
                    meta={"lanes": L, "per_lane": per_lane}).keep_on_nodes()


def _spread(reps: Sequence[int], count: int, rng: random.Random) -> list[int]:
    """``count`` replicas, each replica used ``count / len(reps)`` times (+-1), in random order."""
    out = [reps[i % len(reps)] for i in range(count)]
    rng.shuffle(out)
    return out


def slow_hops(topo: Topology, cost: CostModel, originator: int, route: Sequence[tuple[int, int]],
              limit_s: float) -> int:
    """Hops of one micro-batch's round trip (either direction) slower than ``limit_s``."""
    path = [originator, *(n for _, n in route), originator]
    return sum(max(cost.hop_s(topo, a, b), cost.hop_s(topo, b, a)) > limit_s for a, b in zip(path, path[1:]))


def _avoid_slow_hops(topo: Topology, cost: CostModel, origins: Sequence[int], routes: list[list[tuple[int, int]]],
                     limit_s: float, rng: random.Random) -> None:
    """Trade replicas of a shared stage between random micro-batches until no hop is slower
    than ``limit_s`` (or the tries run out); per-replica visit counts do not change."""
    M = len(routes)
    bad = lambda j: slow_hops(topo, cost, origins[j], routes[j], limit_s)  # noqa: E731
    for _ in range(200 * M):
        worst = [j for j in range(M) if bad(j)]
        if not worst:
            return
        j = rng.choice(worst)
        s, _ = routes[j][rng.randrange(len(routes[j]))]
        others = [k for k in range(M) if k != j and any(x == s for x, _ in routes[k])]
        if not others:
            continue
        k = rng.choice(others)
        before = bad(j) + bad(k)
        nj, nk = dict(routes[j])[s], dict(routes[k])[s]
        old = routes[j], routes[k]
        routes[j] = [(x, nk if x == s else n) for x, n in routes[j]]
        routes[k] = [(x, nj if x == s else n) for x, n in routes[k]]
        if bad(j) + bad(k) > before:
            routes[j], routes[k] = old


def random_skip(topo: Topology, cost: CostModel, placement: list[list[int]], mb_per_originator: int,
                skip_ratio: float, memory: int, seed: int = 0, max_hop_s: float | None = None) -> Schedule:
    """Constraint-keeping random routes that avoid unusable links (see module doc);
    ``max_hop_s`` defaults to :meth:`CostModel.usable_hop_s` (``math.inf``: the network ignored)."""
    rng = random.Random(seed)
    S = len(placement)
    origs = placement[0]
    M = len(origs) * mb_per_originator
    stage_sets = balanced_routes(S, skip_ratio, M, rng, max_swaps=0)
    need = {s: sum(s in r for r in stage_sets) for s in range(1, S)}
    pools = {s: _spread(placement[s], need[s], rng) for s in range(1, S)}
    origins = [origs[j % len(origs)] for j in range(M)]
    routes = [[(s, pools[s].pop()) for s in r] for r in stage_sets]
    limit = cost.usable_hop_s(topo) if max_hop_s is None else max_hop_s
    if math.isfinite(limit):
        _avoid_slow_hops(topo, cost, origins, routes, limit, rng)
    mbs = [MicroBatch(j, o, r, 0.0) for j, (o, r) in enumerate(zip(origins, routes))]
    return Schedule(placement=[list(p) for p in placement], micro_batches=mbs, memory=memory,
                    skip_ratio=skip_ratio, max_swaps=0, method="random_skip", meta={"max_hop_s": limit}).keep_on_nodes()


def swarm_greedy(topo: Topology, cost: CostModel, placement: list[list[int]], mb_per_originator: int,
                 skip_ratio: float, memory: int, skip: bool = True, seed: int = 0) -> Schedule:
    """SWARM-style earliest-expected-finish wiring (see module doc)."""
    rng = random.Random(seed)
    S = len(placement)
    origs = placement[0]
    M = len(origs) * mb_per_originator
    k = skip_ratio if skip else 0.0
    stage_sets = balanced_routes(S, k, M, rng, max_swaps=0) if skip else [list(range(1, S))] * M
    stage_of = {n: s for s, p in enumerate(placement) for n in p}
    f = {n: cost.fwd_s(s, topo.speed(n)) for n, s in stage_of.items()}
    b = {n: cost.bwd_s(s, topo.speed(n)) for n, s in stage_of.items()}
    free = {n: 0.0 for n in stage_of}
    inject = {o: 0.0 for o in origs}
    done: dict[int, list[float]] = {o: [] for o in origs}
    mbs = []
    for j, r in enumerate(stage_sets):
        o = origs[j % len(origs)]
        w = len(done[o])
        t = max(inject[o], free[o])
        if w >= memory:
            t = max(t, done[o][w - memory])
        t += f[o]
        inject[o] = t
        free[o] = t
        prev, route, back = o, [], 0.0
        for s in r:
            best = min(placement[s], key=lambda n: (max(t + cost.hop_s(topo, prev, n), free[n]) + f[n], n))
            t = max(t + cost.hop_s(topo, prev, best), free[best]) + f[best]
            free[best] = t + b[best]
            back += cost.hop_s(topo, best, prev) + b[best]
            route.append((s, best))
            prev = best
        t += cost.hop_s(topo, prev, o) + cost.loss_s(topo.speed(o)) + back + b[o]
        done[o].append(t)
        mbs.append(MicroBatch(j, o, route, 0.0))
    name = "swarm_skip" if skip else "swarm_full"
    return Schedule(placement=[list(p) for p in placement], micro_batches=mbs, memory=memory,
                    skip_ratio=k, max_swaps=0, method=name).keep_on_nodes()


def data_parallel(n_nodes: int, n_micro: int) -> Schedule:
    """Plain data parallelism: one stage (the whole model) on every node, ``n_micro``
    micro-batches per iteration dealt round-robin over the nodes (micro-batch ``i`` on node
    ``i % n_nodes``; with fewer micro-batches than nodes some replicas idle), no hops."""
    if n_nodes < 1 or n_micro < 1:
        raise ValueError(f"data parallelism needs at least one node and one micro-batch (got {n_nodes}, {n_micro})")
    mbs = [MicroBatch(i, i % n_nodes, []) for i in range(n_micro)]
    return Schedule(placement=[list(range(n_nodes))], micro_batches=mbs, memory=max(1, math.ceil(n_micro / n_nodes)),
                    method="data_parallel")


def one_node(routes: Sequence[Sequence[int]], n_stages: int) -> Schedule:
    """Every stage on node 0 (one process hosting the whole model): micro-batch ``i`` follows
    body route ``routes[i]``.  Memory credits cover every hop of every micro-batch, so the one
    node never waits on itself."""
    mbs = [MicroBatch(i, 0, [(s, 0) for s in r]) for i, r in enumerate(routes)]
    return Schedule(placement=[[0] for _ in range(n_stages)], micro_batches=mbs,
                    memory=max(1, sum(len(r) + 1 for r in routes)), method="one_node")
