"""The timeline format shared by the simulator and the runtime.

A timeline is a list of :class:`Event` (or the equivalent plain dicts, :func:`to_dicts`), one per
thing that happened on a node:

======  ==============================================================================
kind    meaning
======  ==============================================================================
fwd     forward of ``stage`` for micro-batch ``mb`` on ``node`` (compute)
bwd     backward of ``stage`` for ``mb`` (compute)
loss    final norm + head + loss (+ start of backward) on the originator (compute)
send    ``node`` sends ``bytes`` to ``peer``: ``start`` is when the message began to occupy the
        link (after queueing behind earlier messages), ``end`` is when it was fully delivered
recv    ``node`` has received a message of ``bytes`` from ``peer`` at ``end`` (``start == end``
        in the simulator; the runtime may record when it started reading)
sync    ``node`` takes part in the data-parallel sync of ``stage`` from ``start`` (the stage's
        last backward finished) to ``end`` (it holds the synced result); ``bytes`` it sent
======  ==============================================================================

Times are seconds from the start of the iteration.  ``mb`` is ``None`` for ``sync``.  The
compute kinds never overlap on one node (:func:`check_no_overlap`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

KINDS = ("fwd", "bwd", "loss", "send", "recv", "sync")
COMPUTE_KINDS = ("fwd", "bwd", "loss")


@dataclass
class Event:
    node: int
    kind: str
    mb: int | None
    stage: int
    start: float
    end: float
    bytes: int = 0
    peer: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def to_dicts(timeline: Iterable[Event]) -> list[dict[str, Any]]:
    return [e.to_dict() for e in timeline]


def from_dicts(items: Iterable[dict[str, Any]]) -> list[Event]:
    out = []
    for d in items:
        if d["kind"] not in KINDS:
            raise ValueError(f"unknown timeline event kind {d['kind']!r}; expected one of {KINDS}")
        out.append(Event(int(d["node"]), d["kind"], None if d.get("mb") is None else int(d["mb"]),
                         int(d.get("stage", -1)), float(d["start"]), float(d["end"]),
                         int(d.get("bytes", 0) or 0), d.get("peer")))
    return out


def save_timeline(timeline: Sequence[Event], path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dicts(timeline)))


def check_no_overlap(timeline: Iterable[Event], eps: float = 1e-9) -> None:
    """Raise ValueError if two compute events overlap on one node."""
    per: dict[int, list[Event]] = {}
    for e in timeline:
        if e.kind in COMPUTE_KINDS:
            per.setdefault(e.node, []).append(e)
    for node, evs in per.items():
        evs.sort(key=lambda e: (e.start, e.end))
        for a, b in zip(evs, evs[1:]):
            if b.start < a.end - eps:
                raise ValueError(f"node {node}: {a.kind} of mb {a.mb} [{a.start:.3f}, {a.end:.3f}] overlaps "
                                 f"{b.kind} of mb {b.mb} [{b.start:.3f}, {b.end:.3f}]")


def max_in_flight(timeline: Iterable[Event]) -> dict[int, int]:
    """Most micro-batches a node held at once: from its forward start to its backward end."""
    spans: dict[tuple[int, int], list[float]] = {}
    for e in timeline:
        if e.kind == "fwd":
            spans.setdefault((e.node, e.mb), [e.start, e.start])[0] = e.start
        elif e.kind == "bwd":
            spans.setdefault((e.node, e.mb), [e.end, e.end])[1] = e.end
    points: dict[int, list[tuple[float, int]]] = {}
    for (node, _), (a, b) in spans.items():
        points.setdefault(node, []).extend([(a, 1), (b, -1)])
    out = {}
    for node, pts in points.items():
        pts.sort(key=lambda p: (p[0], p[1]))  # a release at t happens before a take at t
        cur = best = 0
        for _, d in pts:
            cur += d
            best = max(best, cur)
        out[node] = best
    return out
