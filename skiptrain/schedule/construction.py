"""Route construction for the planner (:mod:`.planner`, step 2): micro-batches are taken wave by
wave, round-robin over originators; each picks the stage set, order (ascending up to
``max_swaps`` neighbour swaps) and replicas whose estimated finish is earliest given the load
already reserved on every node (list scheduling; replicas by dynamic programming along the visit
order, :func:`construct_routes`).  Balance holds by construction: every body stage has a quota of
visits (``M * visits / (S - 1)``, +-1), and a stage whose quota equals the number of
micro-batches still to plan must be taken, so the quotas always stay satisfiable.  Lane-like
constructions (:func:`construct_affinity`) are tried too.  ``aware=False`` is the
collision-unaware ablation: every micro-batch takes its individually cheapest route
(:func:`cheapest_replicas`) under the quotas and one static load rule (no replica takes more than
``NO_CA_SHARE_CAP`` times its speed-weighted share of its stage's visits).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from typing import Sequence

from ..net.topology import Topology
from .cost import CostModel
from .routes import count_swaps
from .schedule import MicroBatch, ScheduleError

ROUTE_CANDIDATES = 16  # replicas per stage a route construction weighs (the earliest to start)
PENALTIES = (0.0, 2.0, 5.0, 10.0)  # construct_affinity penalties tried in turn
NO_CA_SHARE_CAP = 2.0  # collision-unaware ablation: a replica takes <= 2x its share of visits


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
