"""Network-aware skip-and-reorder route planner (SkipPipe's scheduling problem, in seconds).

:func:`plan` returns a :class:`~.schedule.Schedule` for one iteration:

1. **Placement** (:func:`~.placement.place`): stage sizes by work (stage 0 larger when
   skipping), nodes onto stages by local search on an estimate of the iteration time.  The
   estimate ranks placements only roughly, so the local optima of the search's restarts (up
   to ``PLACEMENTS_SMALL`` for <= 32 nodes, one above) all become candidates (step 4).
2. **Construction** (:func:`construct_routes`): micro-batches are taken wave by wave, round-robin
   over originators; each picks the stage set, order (ascending up to ``max_swaps`` neighbour
   swaps) and replicas whose estimated finish is earliest given the load already reserved on
   every node (list scheduling; replicas by dynamic programming along the visit order).
   Balance holds by construction: every body stage has a quota of visits (``M * visits /
   (S - 1)``, +-1), and a stage whose quota equals the number of micro-batches still to plan
   must be taken, so the quotas always stay satisfiable.  Lane-like constructions
   (:func:`construct_affinity`) are tried too; the simulator keeps the best start.
3. **Local search** (:func:`improve_routes`): balance-preserving moves (re-pick a micro-batch's
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
import heapq
import itertools
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..net.topology import Topology
from .cells import default_cells
from .regional import Search, plan_regions, replan_regions
from .cost import CostModel
from .placement import check_sizes, place, stage_sizes
from .routes import count_swaps, skip_count, visits_per_route
from .schedule import MicroBatch, Schedule, ScheduleError, keep_on_node
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


def route_orders(n_stages: int, visits: int, max_swaps: int) -> list[tuple[int, ...]]:
    """Every allowed visit order: a ``visits``-subset of body stages, ascending up to
    ``max_swaps`` disjoint neighbour swaps."""
    out = []
    for sub in itertools.combinations(range(1, n_stages), visits):
        for k in range(0, min(max_swaps, visits // 2) + 1):
            for pos in itertools.combinations(range(visits - 1), k):
                if any(b - a < 2 for a, b in zip(pos, pos[1:])):
                    continue
                r = list(sub)
                for i in pos:
                    r[i], r[i + 1] = r[i + 1], r[i]
                out.append(tuple(r))
    return out


def stage_quotas(n_mb: int, n_stages: int, visits: int, rng: random.Random) -> dict[int, int]:
    """Visits per body stage summing to ``n_mb * visits``, differing by at most one."""
    body = list(range(1, n_stages))
    if not body:
        return {}
    total = n_mb * visits
    q = {s: total // len(body) for s in body}
    extra = body[:]
    rng.shuffle(extra)
    for s in extra[:total % len(body)]:
        q[s] += 1
    return q


def stage_seconds(topo: Topology, cost: CostModel, placement: list[list[int]],
                  backward: bool = False) -> list[list[float]]:
    """Forward (or forward + backward) seconds ``T[s][n]`` of stage ``s`` on node ``n`` at its
    speed; 0 where ``n`` does not serve ``s``.  Indexed by stage too, since a node may serve several."""
    out = [[0.0] * topo.n for _ in placement]
    for s, nodes in enumerate(placement):
        for n in nodes:
            sp = topo.nodes[n].speed
            out[s][n] = cost.fwd_s(s, sp) + (cost.bwd_s(s, sp) if backward else 0.0)
    return out


class RouteContext:
    """What the route constructions read for one placement: hop seconds ``H[a][b]``, forward
    ``f[s][n]`` and backward ``b[s][n]`` seconds of stage ``s`` on node ``n``, and loss seconds
    per originator, at each node's speed."""

    def __init__(self, topo: Topology, cost: CostModel, placement: list[list[int]]):
        self.topo, self.cost, self.placement = topo, cost, placement
        self.H = cost.hop_seconds(topo)
        self.f = stage_seconds(topo, cost, placement)
        self.b = [[0.0] * topo.n for _ in placement]
        for s, nodes in enumerate(placement):
            for n in nodes:
                self.b[s][n] = cost.bwd_s(s, topo.nodes[n].speed)
        self.loss = {o: cost.loss_s(topo.nodes[o].speed) for o in placement[0]}


def _best_replicas(ctx: RouteContext, o: int, order: Sequence[int], t0: float, free: Sequence[float],
                   allowed: dict[int, list[int]] | None) -> tuple[float, list[int], list[float]]:
    """Replicas for visit ``order`` from originator ``o`` starting its forward at ``t0``.

    Dynamic programming along the order; state value = estimated forward finish on the node
    (respecting ``free``) plus the accumulated return cost (hops back and backward compute).
    A stage of more than :data:`ROUTE_CANDIDATES` replicas offers only that many, those that
    could start earliest if the micro-batch came straight from the originator (effort stays
    linear in the stage size).  Returns (estimated finish at the originator, nodes, forward
    start per hop).
    """
    H, f, b = ctx.H, ctx.f, ctx.b
    # entries: node -> (score, fwd_finish, back_cost, path, starts)
    t_o = t0 + f[0][o]
    layer = {o: (t_o, t_o, 0.0, [], [])}
    for s in order:
        reps = allowed[s] if allowed is not None else ctx.placement[s]
        if len(reps) > ROUTE_CANDIDATES:
            reps = heapq.nsmallest(ROUTE_CANDIDATES, reps, key=lambda n: (max(free[n], t_o + H[o][n]), n))
        nxt = {}
        fs, bs = f[s], b[s]
        for n in reps:
            best = None
            for p, (_, tf, bc, path, starts) in layer.items():
                arr = tf + H[p][n]
                st = arr if arr > free[n] else free[n]
                fin = st + fs[n]
                bc2 = bc + H[n][p] + bs[n]
                sc = fin + bc2
                if best is None or sc < best[0]:
                    best = (sc, fin, bc2, path + [n], starts + [st])
            nxt[n] = best
        layer = nxt
    best = None
    for p, (_, tf, bc, path, starts) in layer.items():
        tot = tf + H[p][o] + ctx.loss[o] + bc + b[0][o]
        if best is None or tot < best[0]:
            best = (tot, path, starts)
    return best


def construct_routes(ctx: RouteContext, originators: Sequence[int], mb_per_originator: int, n_stages: int,
                     visits: int, max_swaps: int, memory: int, rng: random.Random,
                     aware: bool = True, quotas: dict[int, int] | None = None) -> list[MicroBatch]:
    """Greedy list-scheduling construction (see module doc, step 2).  Micro-batch ids are
    assigned wave by wave: id = wave * len(originators) + originator index.  ``quotas``: visits
    per body stage (default :func:`stage_quotas`)."""
    orders = route_orders(n_stages, visits, max_swaps)
    M = len(originators) * mb_per_originator
    quota = dict(quotas) if quotas is not None else stage_quotas(M, n_stages, visits, rng)
    N = ctx.topo.n
    free = [0.0] * N
    node_quota = None
    if not aware:
        node_quota = {}
        for s in range(1, n_stages):
            reps = ctx.placement[s]
            tot_speed = sum(ctx.topo.nodes[n].speed for n in reps)
            for n in reps:
                node_quota[s, n] = math.ceil(NO_CA_SHARE_CAP * quota[s] * ctx.topo.nodes[n].speed / tot_speed)
    fwd_free = {o: 0.0 for o in originators}
    finish: dict[int, list[float]] = {o: [] for o in originators}
    mbs: list[MicroBatch] = []
    left = M
    zero = [0.0] * N
    for w in range(mb_per_originator):
        for oi, o in enumerate(originators):
            must = {s for s, q in quota.items() if q >= left}
            t0 = fwd_free[o] if aware else 0.0
            if aware and w >= memory:
                t0 = max(t0, finish[o][w - memory])
            allowed = None
            if node_quota is not None:
                allowed = {s: [n for n in ctx.placement[s] if node_quota[s, n] > 0] for s in range(1, n_stages)}
            best = None
            for order in orders:
                if any(quota[s] <= 0 for s in order) or not must.issubset(order):
                    continue
                if allowed is not None and any(not allowed[s] for s in order):
                    continue
                tot, nodes, starts = _best_replicas(ctx, o, order, t0, free if aware else zero, allowed)
                key = (tot, count_swaps(order), order)
                if best is None or key < best[0]:
                    best = (key, order, nodes, starts)
            if best is None:
                raise ScheduleError("no route satisfies the stage quotas; this is a planner bug")
            _, order, nodes, starts = best
            for s in order:
                quota[s] -= 1
            if node_quota is not None:
                for s, n in zip(order, nodes):
                    node_quota[s, n] -= 1
            left -= 1
            if aware:
                fwd_free[o] = t0 + ctx.f[0][o]
                for s, n, st in zip(order, nodes, starts):   # a node's second stage adds its backward
                    free[n] = max(free[n], st + ctx.f[s][n]) + ctx.b[s][n]
            finish[o].append(best[0][0])
            mbs.append(MicroBatch(w * len(originators) + oi, o, list(zip(order, nodes)), 0.0))
    # injection order: per originator in wave order (list order already is)
    return mbs


def construct_affinity(ctx: RouteContext, originators: Sequence[int], mb_per_originator: int, n_stages: int,
                       visits: int, max_swaps: int, rng: random.Random, penalty: float,
                       order_of_originators: Sequence[int], quotas: dict[int, int] | None = None) -> list[MicroBatch]:
    """Lane-like construction: originators one after another (in ``order_of_originators``),
    each micro-batch taking the cheapest round trip (hops both ways + compute) where a node
    already used by *another* originator costs ``penalty`` extra, under the stage quotas and
    per-node quotas (visits shared by speed).  With ``penalty > 0`` an originator's
    micro-batches keep to their own nodes, like SkipPipe's lanes; the quotas keep balance."""
    orders = route_orders(n_stages, visits, max_swaps)
    M = len(originators) * mb_per_originator
    quota = dict(quotas) if quotas is not None else stage_quotas(M, n_stages, visits, rng)
    H, f, b = ctx.H, ctx.f, ctx.b
    cap = {}
    for s in range(1, n_stages):
        reps = ctx.placement[s]
        tot = sum(ctx.topo.nodes[n].speed for n in reps)
        for n in reps:
            cap[s, n] = math.ceil(quota[s] * ctx.topo.nodes[n].speed / tot)
    owners: dict[int, set] = {}
    routes: dict[int, list] = {o: [] for o in originators}
    left = M
    for o in order_of_originators:
        for _ in range(mb_per_originator):
            must = {s for s, q in quota.items() if q >= left}
            best = None
            for order in orders:
                if any(quota[s] <= 0 for s in order) or not must.issubset(order):
                    continue
                # Viterbi over replicas with additive cost
                layer = {o: (f[0][o] + b[0][o] + ctx.loss[o], [])}
                ok = True
                for s in order:
                    nxt = {}
                    for n in ctx.placement[s]:
                        if cap[s, n] <= 0:
                            continue
                        pen = penalty if owners.get(n, {o}) - {o} else 0.0
                        c_n = f[s][n] + b[s][n] + pen
                        bb = min(((c + H[p][n] + H[n][p] + c_n, path) for p, (c, path) in layer.items()),
                                 key=lambda x: x[0])
                        nxt[n] = (bb[0], bb[1] + [n])
                    if not nxt:
                        ok = False
                        break
                    layer = nxt
                if not ok:
                    continue
                tot, path = min(((c + H[p][o] + H[o][p], path) for p, (c, path) in layer.items()),
                                key=lambda x: x[0])
                key = (tot, count_swaps(order), order)
                if best is None or key < best[0]:
                    best = (key, order, path)
            if best is None:
                raise ScheduleError("no route satisfies the stage and node quotas; this is a planner bug")
            _, order, path = best
            for s_, n in zip(order, path):
                quota[s_] -= 1
                cap[s_, n] -= 1
                owners.setdefault(n, set()).add(o)
            left -= 1
            routes[o].append(list(zip(order, path)))
    mbs = []
    for w in range(mb_per_originator):
        for oi, o in enumerate(originators):
            mbs.append(MicroBatch(w * len(originators) + oi, o, routes[o][w], 0.0))
    return mbs


def cheapest_replicas(H: list[list[float]], placement: list[list[int]], o: int,
                       order: Sequence[int], node_s: Sequence[Sequence[float]] | None = None
                       ) -> list[tuple[float, list[int]]]:
    """Replica paths for visit ``order`` from originator ``o`` by hop cost there and back plus
    each replica's compute ``node_s[s][n]`` (stage ``s``'s forward + backward on node ``n`` at
    its speed, :func:`stage_seconds`; none when omitted), Viterbi over the replicas of each
    stage, cheapest first: at most one path per last node."""
    layer: dict[int, tuple[float, list[int]]] = {o: (0.0, [])}
    for s in order:
        nxt = {}
        for n in placement[s]:
            own = node_s[s][n] if node_s is not None else 0.0
            c, path = min(((c + H[p][n] + H[n][p] + own, path) for p, (c, path) in layer.items()),
                          key=lambda x: x[0])
            nxt[n] = (c, path + [n])
        layer = nxt
    return sorted(((c + H[p][o] + H[o][p], path) for p, (c, path) in layer.items()), key=lambda x: x[0])


def _repick(H: list[list[float]], placement: list[list[int]], o: int, route: Sequence[tuple[int, int]],
            node_s: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """``route``'s stages with the replicas that are cheapest (hops + compute) from ``o``."""
    stages = [s for s, _ in route]
    return list(zip(stages, cheapest_replicas(H, placement, o, stages, node_s)[0][1]))


#: local-search move mix and objective (measured on the reference setup, docs/scheduler.md)
TARGET_P = 0.3     # first micro-batch drawn from the critical originator (latest last finish)
TRADE_REROUTE_P = 0.5  # stage trade / route exchange between originators: re-pick both by cost
REROUTE_P = 0.3    # move: re-pick one micro-batch's replicas by hop cost (best, or second best)
FINISH_WEIGHT = 0.05  # objective: + this x the mean over originators of their last finish
SCREEN_SHARE = 0.4  # share of the search budget spent screening placement candidates
PLACEMENT_SHARE = 0.5  # share of the time cap the placement search may use
ROUTE_CANDIDATES = 16  # replicas per stage a route construction weighs (the earliest to start)
PENALTIES = (0.0, 2.0, 5.0, 10.0)  # construct_affinity penalties tried in turn
PLACEMENTS_SMALL = 4  # placement candidates screened for topologies of <= 32 nodes (1 above)
NO_CA_SHARE_CAP = 2.0  # collision-unaware ablation: a replica takes <= 2x its share of visits


def _propose_move(routes: list[list[tuple[int, int]]], j1: int, mbs: Sequence[MicroBatch],
                  pl: list[list[int]], H: list[list[float]], node_s: Sequence[Sequence[float]], rng: random.Random,
                  max_swaps: int) -> list[tuple[int, list[tuple[int, int]]]] | None:
    """Apply one random balance-preserving move to ``routes`` (see :func:`improve_routes`),
    starting from micro-batch ``j1``; returns the changed micro-batches' old routes, or None
    when the drawn move is impossible (nothing changed)."""
    move = rng.random()
    old = None
    if move < REROUTE_P:  # re-pick replicas by hop cost
        r = routes[j1]
        paths = cheapest_replicas(H, pl, mbs[j1].originator, [s for s, _ in r], node_s)
        path = paths[0][1] if len(paths) < 2 or rng.random() < 0.7 else paths[1][1]
        cand = [(s, n) for (s, _), n in zip(r, path)]
        if cand == r:
            return None
        old = [(j1, r)]
        routes[j1] = cand
    else:
        move = rng.random()
        if move < 0.25:  # change the replica of one hop
            r = routes[j1]
            if not r:
                return None
            i = rng.randrange(len(r))
            s, n = r[i]
            if len(pl[s]) < 2:
                return None
            n2 = rng.choice([x for x in pl[s] if x != n])
            old = [(j1, r)]
            routes[j1] = r[:i] + [(s, n2)] + r[i + 1:]
        elif move < 0.5:  # two micro-batches trade replicas of a stage they share
            j2 = rng.randrange(len(routes))
            d1, d2 = dict(routes[j1]), dict(routes[j2])
            common = [s for s in d1 if s in d2 and d1[s] != d2[s]]
            if j1 == j2 or not common:
                return None
            s = rng.choice(common)
            old = [(j1, routes[j1]), (j2, routes[j2])]
            routes[j1] = [(x, d2[s] if x == s else n) for x, n in routes[j1]]
            routes[j2] = [(x, d1[s] if x == s else n) for x, n in routes[j2]]
        elif move < 0.75:  # trade a stage: j1 takes j2's stage and node, and vice versa
            j2 = rng.randrange(len(routes))
            d1, d2 = dict(routes[j1]), dict(routes[j2])
            only1 = [s for s in d1 if s not in d2]
            only2 = [s for s in d2 if s not in d1]
            if j1 == j2 or not only1 or not only2:
                return None
            s1, s2 = rng.choice(only1), rng.choice(only2)
            old = [(j1, routes[j1]), (j2, routes[j2])]
            r1 = sorted([(s, n) for s, n in routes[j1] if s != s1] + [(s2, d2[s2])])
            r2 = sorted([(s, n) for s, n in routes[j2] if s != s2] + [(s1, d1[s1])])
            if rng.random() < TRADE_REROUTE_P:  # the traded stages' nodes suit the other originator
                r1 = _repick(H, pl, mbs[j1].originator, r1, node_s)
                r2 = _repick(H, pl, mbs[j2].originator, r2, node_s)
            routes[j1], routes[j2] = r1, r2
        elif move < 0.9:  # exchange whole body routes of two micro-batches
            j2 = rng.randrange(len(routes))
            if j1 == j2 or routes[j1] == routes[j2]:
                return None
            old = [(j1, routes[j1]), (j2, routes[j2])]
            routes[j1], routes[j2] = routes[j2], routes[j1]
            o1, o2 = mbs[j1].originator, mbs[j2].originator
            if o1 != o2 and rng.random() < TRADE_REROUTE_P:  # stage sets trade, nodes re-picked
                routes[j1] = _repick(H, pl, o1, routes[j1], node_s)
                routes[j2] = _repick(H, pl, o2, routes[j2], node_s)
        else:  # toggle a neighbour swap
            r = routes[j1]
            if len(r) < 2 or max_swaps == 0:
                return None
            i = rng.randrange(len(r) - 1)
            cand = r[:i] + [r[i + 1], r[i]] + r[i + 2:]
            try:
                if count_swaps([s for s, _ in cand]) > max_swaps:
                    return None
            except Exception:
                return None
            old = [(j1, r)]
            routes[j1] = cand
    return old


def improve_routes(schedule: Schedule, topo: Topology, cost: CostModel, contention: bool, dp_sync: bool,
                   rng: random.Random, max_evals: int, time_limit_s: float | None = None,
                   anneal: float = 0.0) -> tuple[Schedule, dict]:
    """Local search on ``schedule``'s routes (see module doc, step 3); returns the best found.

    Every move keeps every route constraint and the stage balance.  A move is kept when the
    search score is no worse (plateau moves included); ``anneal > 0`` also keeps worse moves
    with a simulated-annealing probability (start temperature ``anneal`` x the start score).
    Measured on the reference setup: plain descent beats annealing for budgets of a few
    thousand simulations (docs/scheduler.md).  Search score: the simulated score
    (:meth:`SimResult.score`) plus ``FINISH_WEIGHT`` x the mean over originators of their last
    micro-batch's finish, so that moves which help a non-critical originator count too.
    Moves: re-pick one micro-batch's replicas by hop cost and compute (``REROUTE_P``); change
    one hop's replica; trade the replicas of a shared stage between two micro-batches; trade a
    stage (with its node) between two micro-batches; exchange two micro-batches' routes
    (between micro-batches of one originator this changes the injection order); toggle a
    neighbour swap.  A stage trade, and a route exchange between two originators, re-picks
    both micro-batches' replicas by cost from their own originators with probability
    ``TRADE_REROUTE_P``.  With probability ``TARGET_P`` the first micro-batch is one of the critical
    originator's (the one whose last micro-batch finishes last).
    """
    mbs = schedule.micro_batches
    M = len(mbs)
    routes = [list(mb.route) for mb in mbs]
    pl = schedule.placement
    stages_of = schedule.stages_of() if schedule.hosts_several() else None
    H = cost.hop_seconds(topo)
    node_s = stage_seconds(topo, cost, pl, backward=True)
    same_orig: dict[int, list[int]] = {}
    for j, mb in enumerate(mbs):
        same_orig.setdefault(mb.originator, []).append(j)

    def run() -> tuple[float, Any]:
        for mb, r in zip(mbs, routes):
            mb.route = r
        res = simulate(schedule, topo, cost, contention=contention, dp_sync=dp_sync, record=False)
        sc_ = res.score()
        if FINISH_WEIGHT and math.isfinite(sc_):
            fin: dict[int, float] = {}
            for mb in mbs:
                d = res.mb_done_s[mb.id]
                if d > fin.get(mb.originator, -1.0):
                    fin[mb.originator] = d
            sc_ += FINISH_WEIGHT * sum(fin.values()) / len(fin)
        return sc_, res

    cur, res = run()
    start = cur
    best_score, best_routes = cur, [list(r) for r in routes]
    t_start = time.perf_counter()
    c_start = time.process_time()
    evals = accepted = 0
    temp0 = anneal * cur if math.isfinite(cur) else 0.0
    late: list[int] = []

    def refresh_late() -> None:
        if res is None or res.deadlock:
            late[:] = []
        else:
            fin: dict[int, float] = {}
            for mb in mbs:
                fin[mb.originator] = max(fin.get(mb.originator, 0.0), res.mb_done_s.get(mb.id, 0.0))
            worst = min(fin, key=lambda o: (-fin[o], o))
            late[:] = same_orig[worst]

    refresh_late()
    tries = 0
    capped = False
    while evals < max_evals and tries < 20 * max_evals + 100:  # moves can be impossible (1 replica)
        tries += 1
        if time_limit_s is not None and time.process_time() - c_start > time_limit_s:
            capped = True
            break
        j1 = rng.choice(late) if late and rng.random() < TARGET_P else rng.randrange(M)
        old = _propose_move(routes, j1, mbs, pl, H, node_s, rng, schedule.max_swaps)
        if old is None:
            continue
        for j, _ in old if stages_of else ():      # a node serving several stages keeps its micro-batches
            routes[j] = keep_on_node(mbs[j].originator, routes[j], stages_of)
        new, nres = run()
        evals += 1
        temp = temp0 * (1.0 - evals / max_evals)
        if new <= cur or (temp > 0 and math.isfinite(new) and rng.random() < math.exp((cur - new) / temp)):
            if new < cur:
                accepted += 1
            cur, res = new, nres
            refresh_late()
            if cur < best_score:
                best_score, best_routes = cur, [list(r) for r in routes]
        else:
            for j, r in old:
                routes[j] = r
    for mb, r in zip(mbs, best_routes):
        mb.route = r
    return schedule, {"evals": evals, "accepted": accepted, "start_score": start, "score": best_score,
                      "search_s": time.perf_counter() - t_start, "time_capped": capped}


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
