"""Cells: a large swarm cut into small groups of nearby nodes, each a whole pipeline.

The planner's decomposition for large topologies (:mod:`skiptrain.schedule.regional`):

* :func:`group_cells` grows cells of about equal size one after another by complete linkage
  over the hop distance (latency + one fp32 activation over the bandwidth, both ways), so a cell
  holds nodes that are close to each other (one region of geo12, or neighbouring regions).
* :func:`split_sizes` deals the global stage sizes to the cells in proportion to their node
  counts (every stage's slots interleaved, then cut), so every cell serves every stage.
* :func:`deal_quotas` deals the global body-stage visit counts to the cells the same way: each
  cell's visits sum to its micro-batches x visits per route, and the global counts stay within
  one of each other (the balance constraint holds for the whole swarm, not per cell).

A route never leaves its cell, so two cells share no node and no link: each cell's pipeline
can be simulated alone, and the swarm's pipeline is the union of the cells'
(``tests/unit/test_schedule_cells.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..net.topology import Topology
from .cost import CostModel
from .placement import place
from .schedule import ScheduleError

#: nodes per cell the decomposition aims at (the size the planner searches well in about a second)
CELL_NODES = 20


def hop_distance(topo: Topology, cost: CostModel) -> np.ndarray:
    """Symmetric hop seconds ``d[a][b]``: latency + one fp32 activation over the bandwidth, there
    and back (vectorised: no codec, no per-hop overhead, which is the same for every pair)."""
    lat = np.asarray(topo.latency_s, dtype=float)
    one = lat + cost.activation_bytes / np.asarray(topo.bandwidth_Bps, dtype=float)
    return one + one.T


def group_cells(topo: Topology, cost: CostModel, n_cells: int) -> list[list[int]]:
    """``n_cells`` groups of nearby nodes, sizes differing by at most one (see module doc).

    Cells grow one after another: a cell starts at the free node nearest to the previous cell's
    start (node 0 first) and adds, while it has room, the free node whose farthest member is
    nearest (complete linkage), so a cell takes a distant node only when nothing nearer is left."""
    n = topo.n
    if not 1 <= n_cells <= n:
        raise ScheduleError(f"cannot cut {n} nodes into {n_cells} cells")
    d = hop_distance(topo, cost)
    free = np.ones(n, dtype=bool)
    bounds = [round(i * n / n_cells) for i in range(n_cells + 1)]
    cells, start = [], 0
    for i in range(n_cells):
        start = int(np.argmin(np.where(free, d[start], np.inf))) if not free[start] else start
        members, far = [start], d[start].copy()
        free[start] = False
        while len(members) < bounds[i + 1] - bounds[i]:
            nxt = int(np.argmin(np.where(free, far, np.inf)))
            members.append(nxt)
            free[nxt] = False
            np.maximum(far, d[nxt], out=far)
        cells.append(sorted(members))
    return cells


def _deal(counts: Sequence[int], takes: Sequence[int]) -> list[list[int]]:
    """Labels ``i`` (``counts[i]`` of each) interleaved by their fractional position, then cut
    into consecutive runs of ``takes[c]``: ``out[c][i]`` labels ``i`` in run ``c``."""
    slots = sorted(((k + 0.5) / cnt, i) for i, cnt in enumerate(counts) for k in range(cnt))
    out, pos = [], 0
    for t in takes:
        row = [0] * len(counts)
        for _, i in slots[pos:pos + t]:
            row[i] += 1
        out.append(row)
        pos += t
    return out


def split_sizes(sizes: Sequence[int], cells: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per cell, nodes per stage: the global ``sizes`` dealt in proportion to the cells' node
    counts (a cell's sizes sum to at most its nodes).  Raises when a cell would miss a stage."""
    total = sum(sizes)
    n = sum(len(c) for c in cells)
    takes = [len(c) for c in cells]
    if total < n:                               # unused nodes: fewer slots than nodes
        bounds = [round(i * total / len(cells)) for i in range(len(cells) + 1)]
        takes = [min(len(c), bounds[i + 1] - bounds[i]) for i, c in enumerate(cells)]
        takes[-1] += total - sum(takes)
    out = _deal(sizes, takes)
    if any(min(row) < 1 for row in out):
        raise ScheduleError(f"stage sizes {list(sizes)} leave a cell of {min(takes)} nodes without a stage; "
                            "use fewer cells")
    return out


def deal_quotas(n_stages: int, visits: int, cell_micro_batches: Sequence[int],
                fixed: Sequence[int] | None = None) -> list[dict[int, int]]:
    """Body-stage visit quotas per cell: cell ``c`` plans ``cell_micro_batches[c]`` micro-batches
    of ``visits`` body stages each.  ``fixed[s]``: visits of stage ``s`` already made by cells that
    are not re-planned; the dealt quotas bring every stage's total within one of the others when
    the new visits can make up the difference.  Cell by cell, each stage gets what the later cells
    could not take, then the stage with the largest remaining need first (never more visits of a
    stage than the cell has micro-batches)."""
    body = n_stages - 1
    fixed = list(fixed) if fixed is not None else [0] * n_stages
    new = sum(cell_micro_batches) * visits
    total = new + sum(fixed[1:])
    target = [total // body] * body
    for i in sorted(range(body), key=lambda i: (fixed[i + 1], i))[:total % body]:
        target[i] += 1
    need = [max(0, target[i] - fixed[i + 1]) for i in range(body)]
    cap = sum(cell_micro_batches)                 # a stage is visited at most once per micro-batch
    need = [min(x, cap) for x in need]
    while sum(need) > new:                  # fixed visits above a target: take from the largest need
        need[max(range(body), key=lambda i: need[i])] -= 1
    while sum(need) < new:
        need[min((i for i in range(body) if need[i] < cap), key=lambda i: fixed[i + 1] + need[i])] += 1
    out, rest = [], sum(cell_micro_batches)
    for m in cell_micro_batches:
        rest -= m
        q = [max(0, x - rest) for x in need]              # what the later cells cannot take
        for _ in range(m * visits - sum(q)):              # then the largest remaining need first
            i = max((i for i in range(body) if q[i] < min(m, need[i])), key=lambda i: (need[i] - q[i], -i))
            q[i] += 1
        need = [x - y for x, y in zip(need, q)]
        out.append({s + 1: q[s] for s in range(body)})
    return out


def default_cells(n_nodes: int) -> int:
    """Cells for ``n_nodes`` nodes: one up to ``4 * CELL_NODES`` nodes (the planner searches the whole
    swarm), else about ``CELL_NODES`` nodes each."""
    return 1 if n_nodes <= 4 * CELL_NODES else max(1, math.floor(n_nodes / CELL_NODES))


def lanes_in_cells(topo: Topology, sizes: Sequence[int], cost: CostModel, memory: int, mb_per_lane: int,
                   n_cells: int, seed: int = 0) -> list[list[int]]:
    """A full-pipeline (fixed lanes) placement of ``sizes`` placed cell by cell: each cell's lanes
    by :func:`~.placement.place` in ``"lanes"`` mode on its own nodes, so every lane stays among
    nearby nodes.  Lane ``i`` is the ``i``-th node of every stage: the cells' lanes first, cell
    after cell, then their spare nodes."""
    groups = group_cells(topo, cost, n_cells)
    cell_sizes = split_sizes(sizes, groups)
    lanes: list[list[int]] = [[] for _ in sizes]
    spare: list[list[int]] = [[] for _ in sizes]
    for i, (nodes, sz) in enumerate(zip(groups, cell_sizes)):
        pl = place(topo.subset(nodes), sz, cost, 0.0, memory, mb_per_lane, False, mode="lanes", seed=seed + i)
        L = min(sz)
        for s, p in enumerate(pl):
            lanes[s] += [nodes[n] for n in p[:L]]
            spare[s] += [nodes[n] for n in p[L:]]
    return [a + b for a, b in zip(lanes, spare)]
