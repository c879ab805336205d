"""SkipPipe's published schedule for its 20-node geo12 reference setup, as baseline schedules.

The data (``schedule/data/skippipe_published_schedule.json``) is SkipPipe's own ``schedule.json``
(gensyn-ai/skippipe; see ``schedule/data/README.md``): a placement (``partitions``) and paths
as ``{from_node: to_node}`` hops starting at the originator.  Node ids are those of
:func:`skiptrain.net.topology.geo12` with 20 nodes (the same reference order).  Injection times
follow the file's ``how_to_read`` note:

* :func:`skippipe_ca` -- SkipPipe (collision-aware): one path per stage-0 node, each used by 6
  micro-batches injected at ``d * 2.5 + c * 1.0`` s (``d`` in 0..1, ``c`` in 0..2);
* :func:`skippipe_paths` with ``"non-ca-paths"`` (SkipPipe without collision awareness) or
  ``"random-paths"`` (DT-FM-skip): 3 paths per stage-0 node (path ``k + 3 * i`` belongs to
  stage-0 node ``i``), each used by 2 micro-batches injected at ``d * 2.5 + k * fwd_s``;
* :func:`skippipe_lanes` -- DT-FM* lanes, the full-pipeline baseline: the first 3 stage-0 nodes
  each send 9 micro-batches along the lane of same-rank nodes in every stage (27 in all).

SkipPipe's own simulator times (no contention, no DP sync) are in :func:`published_times`.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from .cost import CostModel
from .schedule import MicroBatch, Schedule, ScheduleError

PATH_KINDS = ("ca-paths", "non-ca-paths", "random-paths")
N_NODES = 20


def load_published() -> dict[str, Any]:
    """The published schedule file (package data)."""
    text = resources.files("skiptrain.schedule").joinpath("data/skippipe_published_schedule.json").read_text()
    return json.loads(text)


def published_times() -> dict[str, float]:
    """Iteration seconds in SkipPipe's own simulator, by method name of this project."""
    d = load_published()
    return {"skippipe_lanes": d["baseline-expected-time"], "skippipe_published": d["ca-expected-time"],
            "skippipe_published_no_ca": d["nonca-expected-time"],
            "skippipe_published_random": d["random-expected-time"]}


def walk(path: dict[str, int], placement: list[list[int]]) -> tuple[int, list[tuple[int, int]]]:
    """(originator, route) of one ``{from: to}`` path: the originator is the one stage-0 node
    that is a source but never a destination."""
    hops = {int(a): int(b) for a, b in path.items()}
    starts = [a for a in hops if a not in hops.values()]
    if len(starts) != 1 or starts[0] not in placement[0]:
        raise ScheduleError(f"path {path} does not start at exactly one stage-0 node")
    stage_of = {n: s for s, p in enumerate(placement) for n in p}
    o, route, cur = starts[0], [], starts[0]
    while cur in hops:
        cur = hops[cur]
        route.append((stage_of[cur], cur))
    return o, route


def _schedule(placement: list[list[int]], entries: list[tuple[float, int, list[tuple[int, int]]]],
              memory: int, method: str, skip_ratio: float) -> Schedule:
    entries = sorted(entries, key=lambda e: (e[1], e[0]))
    mbs = [MicroBatch(j, o, list(r), t) for j, (t, o, r) in enumerate(entries)]
    return Schedule(placement=[list(p) for p in placement], micro_batches=mbs, memory=memory,
                    skip_ratio=skip_ratio, max_swaps=2, method=method)


def skippipe_ca(skip_ratio: float = 0.33) -> Schedule:
    """SkipPipe's collision-aware schedule: 5 paths x 6 micro-batches (see module doc)."""
    d = load_published()
    pl = d["partitions"]
    entries = []
    for key in sorted(d["ca-paths"], key=int):
        o, route = walk(d["ca-paths"][key], pl)
        entries += [(dd * 2.5 + c * 1.0, o, route) for dd in range(2) for c in range(3)]
    return _schedule(pl, entries, d["memory"], "skippipe_published", skip_ratio)


def skippipe_paths(kind: str, cost: CostModel, skip_ratio: float = 0.33) -> Schedule:
    """SkipPipe's ``non-ca-paths`` or ``random-paths``: 15 paths x 2 micro-batches, injected at
    ``d * 2.5 + k * cost.fwd_s(0)`` (see module doc)."""
    if kind not in PATH_KINDS[1:]:
        raise ValueError(f"path kind {kind!r} is not one of {PATH_KINDS[1:]}")
    d = load_published()
    pl = d["partitions"]
    entries = []
    for key in sorted(d[kind], key=int):
        o, route = walk(d[kind][key], pl)
        k = int(key) % 3
        entries += [(dd * 2.5 + k * cost.fwd_s(0), o, route) for dd in range(2)]
    name = "skippipe_published_no_ca" if kind == "non-ca-paths" else "skippipe_published_random"
    return _schedule(pl, entries, d["memory"], name, skip_ratio)


def skippipe_lanes(per_lane: int = 9, lanes: int = 3) -> Schedule:
    """DT-FM* lanes on SkipPipe's placement: ``lanes`` x ``per_lane`` micro-batches, no skipping."""
    d = load_published()
    pl = d["partitions"]
    S = len(pl)
    mbs = []
    for w in range(per_lane):
        for i in range(lanes):
            mbs.append(MicroBatch(len(mbs), pl[0][i], [(s, pl[s][i]) for s in range(1, S)], 0.0))
    return Schedule(placement=[list(p) for p in pl], micro_batches=mbs, memory=d["memory"], skip_ratio=0.0,
                    max_swaps=0, method="skippipe_lanes", meta={"lanes": lanes, "per_lane": per_lane})
