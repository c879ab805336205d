"""Cells: a large swarm cut into small groups of nearby nodes, each a whole pipeline.

The planner's decomposition for large topologies (:mod:`skiptrain.schedule.regional`):

* :func:`group_cells` groups the nodes into regions by hop distance (latency + one fp32
  activation over the bandwidth, both ways; regions smaller than 3/4 of a cell merge with the
  nearest), then cuts each region into cells of about the requested size, grown by complete
  linkage, so a cell holds nodes that are close to each other (part of one geo12 location, or
  neighbouring locations) and never straddles two far-apart regions by accident.
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

from ..net.topology import Topology, near_components
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


def regions(d: np.ndarray, min_size: int) -> list[list[int]]:
    """Nodes grouped into regions: :func:`~skiptrain.net.topology.near_components` of ``d``
    (geo12: one location; a uniform cluster: everything), then, while a region has fewer than
    ``min_size`` nodes, it merges with the region nearest by complete linkage (the largest
    distance between their nodes)."""
    out = near_components(d)
    while len(out) > 1 and min(len(r) for r in out) < min_size:
        i = min(range(len(out)), key=lambda k: (len(out[k]), k))
        j = min((k for k in range(len(out)) if k != i), key=lambda k: (d[np.ix_(out[i], out[k])].max(), k))
        out[j] = sorted(out[j] + out[i])
        del out[i]
    return out


def _grow(d: np.ndarray, nodes: list[int], k: int) -> list[list[int]]:
    """``nodes`` cut into ``k`` cells (sizes differing by at most one), grown one after another by
    complete linkage: each starts at the free node nearest to the previous start and adds the free
    node whose farthest member is nearest."""
    sub = d[np.ix_(nodes, nodes)]
    free = np.ones(len(nodes), dtype=bool)
    bounds = [round(i * len(nodes) / k) for i in range(k + 1)]
    cells, start = [], 0
    for i in range(k):
        if not free[start]:
            start = int(np.argmin(np.where(free, sub[start], np.inf)))
        members, far = [start], sub[start].copy()
        free[start] = False
        while len(members) < bounds[i + 1] - bounds[i]:
            nxt = int(np.argmin(np.where(free, far, np.inf)))
            members.append(nxt)
            free[nxt] = False
            np.maximum(far, sub[nxt], out=far)
        cells.append(sorted(nodes[m] for m in members))
    return cells


def group_cells(topo: Topology, cost: CostModel, n_cells: int) -> list[list[int]]:
    """About ``n_cells`` cells of nearby nodes (see module doc): the :func:`regions` (none smaller
    than 3/4 of a cell), each cut into cells of about ``topo.n / n_cells`` nodes."""
    n = topo.n
    if not 1 <= n_cells <= n:
        raise ScheduleError(f"cannot cut {n} nodes into {n_cells} cells")
    d = hop_distance(topo, cost)
    size = n / n_cells
    cells: list[list[int]] = []
    for r in regions(d, max(1, math.ceil(0.75 * size))):
        cells += _grow(d, r, max(1, round(len(r) / size)))
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
    could not take, then visits go to the stage furthest below the cell's share of its need (never
    more visits of a stage than the cell has micro-batches), so the difference is spread."""
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
        ideal = [x * m / rest for x in need]              # this cell's share of every stage's need
        rest -= m
        q = [max(0, x - rest) for x in need]              # what the later cells cannot take
        for _ in range(m * visits - sum(q)):              # then the stage furthest below its share
            i = max((i for i in range(body) if q[i] < min(m, need[i])), key=lambda i: (ideal[i] - q[i], -i))
            q[i] += 1
        need = [x - y for x, y in zip(need, q)]
        out.append({s + 1: q[s] for s in range(body)})
    return out


def default_cells(n_nodes: int) -> int:
    """Cells for ``n_nodes`` nodes: one up to ``4 * CELL_NODES`` nodes (the planner searches the whole
    swarm), else about ``CELL_NODES`` nodes each."""
    return 1 if n_nodes <= 4 * CELL_NODES else max(1, math.floor(n_nodes / CELL_NODES))


def lanes_in_cells(topo: Topology, n_stages: int, cost: CostModel, memory: int, mb_per_lane: int,
                   n_cells: int, seed: int = 0) -> list[list[int]]:
    """A full-pipeline (fixed lanes) placement of ``n_stages`` stages placed region by region:
    each :func:`regions` region is cut into cells as the planner cuts it, each cell holds
    ``len // n_stages`` lanes placed by :func:`~.placement.place` (``"lanes"`` mode) on its own
    nodes, and the cells' leftover nodes form more lanes within their region.  So every lane stays
    inside one region; fewer than ``n_stages`` nodes per region stay unused.  Lane ``i`` is the
    ``i``-th node of every stage."""
    d = hop_distance(topo, cost)
    size = topo.n / n_cells
    lanes: list[list[int]] = []

    def add(nodes: list[int], k: int) -> list[int]:
        L = len(nodes) // n_stages
        if L == 0:
            return list(nodes)
        pl = place(topo.subset(nodes), [L] * n_stages, cost, 0.0, memory, mb_per_lane, False, mode="lanes",
                   seed=seed + k)
        lanes.extend([nodes[pl[s][i]] for s in range(n_stages)] for i in range(L))
        used = {nodes[n] for p in pl for n in p}
        return [n for n in nodes if n not in used]

    for r in regions(d, max(1, math.ceil(0.75 * size))):
        pool: list[int] = []
        for g in _grow(d, r, max(1, round(len(r) / size))):
            pool += add(g, len(lanes))
        add(sorted(pool), len(lanes))
    return [[lane[s] for lane in lanes] for s in range(n_stages)]
