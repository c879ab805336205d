"""Placement: which nodes serve which stage.

:func:`stage_sizes` splits N nodes over S stages in proportion to each stage's work per
iteration: stage 0 runs forward + loss + backward for every micro-batch, a body stage only for
the fraction ``visits / (S - 1)`` of them, so stage 0 gets more nodes when skipping
(SkipPipe's 20 nodes, 6 stages, k=33%: 5/3/3/3/3/3).

:func:`place` assigns nodes by local search (seeded restarts, then pairwise node swaps
between stages, first improvement) on a fast estimate of the iteration time:

* ``mode="skip"`` (routes may skip and pick any replica): per body stage, every originator's
  visits are transported to the stage's replicas nearest first (each replica takes an equal
  share), which gives each originator a load-aware mean hop cost and compute per micro-batch;
  its round trip times the number of memory "waves" ``ceil(M_o / m)`` (or its own stage-0 work
  if larger) estimates its finish; the estimate mixes the worst and the mean originator.
* ``mode="lanes"`` (fixed full-pipeline lanes, DT-FM-like): lane ``i`` is the ``i``-th node of
  every stage; its round trip over all stages times its waves; nodes past the shortest stage's
  size are spare.
* plus, when ``dp_sync`` is on, the slowest stage's ring-sync time (:meth:`CostModel.dp_sync_s`).

Typical cost: a few hundred milliseconds for 20 nodes, a few seconds for 64.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import Sequence

import numpy as np

from ..net.topology import Topology
from .cost import CostModel
from .routes import skip_count, visits_per_route
from .schedule import ScheduleError


def stage_sizes(n_nodes: int, n_stages: int, skip_ratio: float, cost: CostModel | None = None,
                deep_ties: bool = False) -> list[int]:
    """Nodes per stage, proportional to work per iteration (largest remainder, at least 1 each).
    Equal remainders (body stages of equal work) go to the first stages, or with ``deep_ties`` to
    the last (the planner's cells: a spare replica of the deepest body stages shortens the
    pipeline more than one of the first, measured in docs/scheduler.md)."""
    if n_stages < 1:
        raise ScheduleError("need at least one stage")
    if n_nodes < n_stages:
        raise ScheduleError(f"{n_nodes} nodes cannot serve {n_stages} stages: every stage needs at "
                            "least one node; add nodes or lower the number of stages")
    if n_stages == 1:
        return [n_nodes]
    v = visits_per_route(skip_ratio, n_stages)
    if cost is None:
        per = [2.5] * n_stages                      # forward 1 + backward 1.5 per visit
        per[0] += 0.25                              # + the loss
    else:
        per = [(cost.fwd_s(s) + cost.bwd_s(s)) or 1e-9 for s in range(n_stages)]
        per[0] += cost.loss_s()
    work = [per[0]] + [per[s] * v / (n_stages - 1) for s in range(1, n_stages)]
    spare = n_nodes - n_stages
    total = sum(work)
    raw = [spare * w / total for w in work]
    sizes = [1 + int(x) for x in raw]
    rest = n_nodes - sum(sizes)
    # ties: stage 0 first, then the body stages in order, or with ``deep_ties`` the deepest first
    tie = (lambda s: (n_stages - s) % n_stages) if deep_ties else (lambda s: s)
    order = sorted(range(n_stages), key=lambda s: (-(raw[s] - int(raw[s])), tie(s)))
    for s in order[:rest]:
        sizes[s] += 1
    return sizes


def check_sizes(sizes: Sequence[int], n_nodes: int) -> None:
    if any(x < 1 for x in sizes):
        raise ScheduleError(f"stage sizes {list(sizes)}: every stage needs at least one node")
    if sum(sizes) > n_nodes:
        raise ScheduleError(f"stage sizes {list(sizes)} need {sum(sizes)} nodes, topology has {n_nodes}")


class _Estimator:
    """Fast iteration-time estimate of a placement (see module doc)."""

    def __init__(self, topo: Topology, cost: CostModel, sizes: Sequence[int], skip_ratio: float,
                 memory: int, mb_per_originator: int, dp_sync: bool, mode: str):
        self.topo, self.cost, self.sizes = topo, cost, list(sizes)
        self.S = len(sizes)
        self.mode = mode
        H = np.array(cost.hop_seconds(topo))
        self.RT = H + H.T  # there and back
        self.speed = np.array([nd.speed for nd in topo.nodes])
        self.memory = max(1, memory)
        self.mbo = mb_per_originator
        self.dp_sync = dp_sync and cost.dp_mode != "none"
        self._sync_cache: dict[tuple[int, frozenset], float] = {}
        if mode == "skip":
            v = visits_per_route(skip_ratio, self.S)
            self.subsets = list(itertools.combinations(range(1, self.S), v))
        else:
            self.subsets = [tuple(range(1, self.S))]
        self.total_mb = sizes[0] * mb_per_originator

    def work(self, stage: int, nodes: np.ndarray) -> np.ndarray:
        c = self.cost
        return np.array([c.fwd_s(stage, sp) + c.bwd_s(stage, sp) for sp in self.speed[nodes]])

    def round0(self, o: int) -> float:
        """Stage 0's forward + loss + backward on originator ``o`` at its speed."""
        c, sp = self.cost, self.speed[o]
        return c.fwd_s(0, sp) + c.loss_s(sp) + c.bwd_s(0, sp)

    def work1(self, stage: int, n: int) -> float:
        """Forward + backward of ``stage`` on node ``n`` at its speed."""
        c, sp = self.cost, self.speed[n]
        return c.fwd_s(stage, sp) + c.bwd_s(stage, sp)

    def sync(self, placement: list[list[int]]) -> float:
        if not self.dp_sync:
            return 0.0
        worst = 0.0
        for s, reps in enumerate(placement):
            key = (s, frozenset(reps))
            t = self._sync_cache.get(key)
            if t is None:
                t = self.cost.dp_sync_s(self.topo, reps, s)
                self._sync_cache[key] = t
            worst = max(worst, t)
        return worst

    def __call__(self, placement: list[list[int]]) -> float:
        if self.mode == "lanes":
            L = min(len(p) for p in placement)
            per_lane = math.ceil(self.total_mb / L)
            waves = math.ceil(per_lane / self.memory)
            T = []
            for i in range(L):
                lane = [placement[s][i] for s in range(self.S)]
                o = lane[0]
                rt = self.round0(o)
                rt += sum(self.work(s, np.array([lane[s]]))[0] for s in range(1, self.S))
                ring = lane + [o]
                rt += sum(self.RT[ring[k], ring[k + 1]] for k in range(len(ring) - 1))
                T.append(max(waves * rt, per_lane * self.round0(o)))
            return max(T) + 0.1 * sum(T) / len(T) + self.sync(placement)
        origs = placement[0]
        n0 = len(origs)
        waves = math.ceil(self.mbo / self.memory)
        own = [self.round0(o) for o in origs]
        v = len(self.subsets[0])
        frac = v / (self.S - 1) if self.S > 1 else 0.0
        RT = self.RT
        # per body stage: transport each originator's demand (its micro-batches' visits) to the
        # replicas, nearest first, each replica taking an equal share
        hop = [0.0] * n0
        work = [0.0] * n0
        for s in range(1, self.S):
            reps = placement[s]
            cap = [self.mbo * n0 * frac / len(reps)] * len(reps)
            dem = [self.mbo * frac] * n0
            pairs = sorted((RT[o, r], i, k) for i, o in enumerate(origs) for k, r in enumerate(reps))
            for d, i, k in pairs:
                x = min(dem[i], cap[k])
                if x <= 0:
                    continue
                dem[i] -= x
                cap[k] -= x
                hop[i] += x * d
                work[i] += x * self.work1(s, reps[k])
        T = []
        for i in range(n0):
            per_mb_hop = hop[i] / self.mbo * (v + 1) / max(v, 1)
            per_mb_work = work[i] / self.mbo
            rt = own[i] + per_mb_work + per_mb_hop
            T.append(max(waves * rt, self.mbo * own[i]))
        return float(max(T) + 0.5 * sum(T) / len(T)) + self.sync(placement)


def place(topo: Topology, sizes: Sequence[int], cost: CostModel, skip_ratio: float = 0.0,
          memory: int = 3, mb_per_originator: int = 6, dp_sync: bool = True, mode: str = "skip",
          seed: int = 0, restarts: int = 4, max_evals: int | None = None,
          return_all: bool = False, deadline: float | None = None) -> list[list[int]] | list[list[list[int]]]:
    """Network-aware placement of ``topo``'s nodes onto stages of ``sizes`` (see module doc).

    Deterministic for a given ``seed``.  Nodes beyond ``sum(sizes)`` stay unused (the search
    may swap them in).  With ``return_all`` the local optimum of every restart is returned,
    best estimate first, duplicates removed (the planner screens them with real routes).
    ``deadline`` (a ``time.process_time()`` value) ends the search early: the first restart's
    start is always estimated, every restart stops at its best so far once the deadline passed,
    and no further restart begins.
    """
    sizes = list(sizes)
    check_sizes(sizes, topo.n)
    if mode not in ("skip", "lanes"):
        raise ValueError(f"placement mode {mode!r}")
    if mode == "skip":
        skip_count(skip_ratio, len(sizes))
    est = _Estimator(topo, cost, sizes, skip_ratio, memory, mb_per_originator, dp_sync, mode)
    rng = random.Random(seed)
    N, S = topo.n, len(sizes)
    if max_evals is None:
        max_evals = 4000 if N <= 24 else 2500
    per_restart = max(1, max_evals // restarts)
    found: list[tuple[float, int, list[list[int]]]] = []
    def late() -> bool:
        return deadline is not None and time.process_time() > deadline

    for r in range(restarts):
        if r and late():
            break
        nodes = list(range(N))
        rng.shuffle(nodes)
        pl, k = [], 0
        for sz in sizes:
            pl.append(nodes[k:k + sz])
            k += sz
        spare = nodes[k:]
        v = est(pl)
        evals = 1
        improved = True
        while improved and evals < per_restart:
            improved = False
            slots = [(s, i) for s in range(S) for i in range(len(pl[s]))] + [(-1, i) for i in range(len(spare))]
            pairs = [(x, y) for x, y in itertools.combinations(slots, 2)
                     if x[0] != y[0] or (mode == "lanes" and x[0] != -1)]
            rng.shuffle(pairs)
            for (s1, i1), (s2, i2) in pairs:
                if evals >= per_restart or late():
                    improved = False
                    break
                g1 = spare if s1 == -1 else pl[s1]
                g2 = spare if s2 == -1 else pl[s2]
                g1[i1], g2[i2] = g2[i2], g1[i1]
                nv = est(pl)
                evals += 1
                if nv < v - 1e-12:
                    v, improved = nv, True
                else:
                    g1[i1], g2[i2] = g2[i2], g1[i1]
        found.append((v, r, [list(p) for p in pl]))
    found.sort(key=lambda x: (x[0], x[1]))
    if not return_all:
        return found[0][2]
    out: list[list[list[int]]] = []
    seen: set = set()
    for _, _, pl in found:
        key = tuple(tuple(sorted(p)) for p in pl)
        if key not in seen:
            seen.add(key)
            out.append(pl)
    return out
