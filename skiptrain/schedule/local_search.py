"""Local search on a schedule's routes (:mod:`.planner`, step 3): balance-preserving moves
(re-pick a micro-batch's replicas by hop cost, change a hop's replica, trade a stage or a replica
between two micro-batches, exchange two routes, toggle a neighbour swap), half of them aimed at
the critical originator, each scored by the discrete-event simulator; a move is kept when the
score is no worse (descent with plateau moves).  Deadlocking schedules score infinity, so they
are never kept.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Sequence

from ..net.topology import Topology
from .construction import cheapest_replicas, stage_seconds
from .cost import CostModel
from .routes import count_swaps
from .schedule import MicroBatch, Schedule, keep_on_node
from .simulator import simulate

#: local-search move mix and objective (measured on the reference setup, docs/scheduler.md)
TARGET_P = 0.3     # first micro-batch drawn from the critical originator (latest last finish)
TRADE_REROUTE_P = 0.5  # stage trade / route exchange between originators: re-pick both by cost
REROUTE_P = 0.3    # move: re-pick one micro-batch's replicas by hop cost (best, or second best)
FINISH_WEIGHT = 0.05  # objective: + this x the mean over originators of their last finish


def _repick(H: list[list[float]], placement: list[list[int]], o: int, route: Sequence[tuple[int, int]],
            node_s: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """``route``'s stages with the replicas that are cheapest (hops + compute) from ``o``."""
    stages = [s for s, _ in route]
    return list(zip(stages, cheapest_replicas(H, placement, o, stages, node_s)[0][1]))


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
