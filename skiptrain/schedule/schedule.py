"""The :class:`Schedule`: what every planner and baseline produces and what the simulator and
the multi-process runtime execute.

A schedule fixes, for one iteration:

* ``placement[s]``: the node ids serving stage ``s`` (stage 0 first), each at most once.  A node
  usually serves one stage; one that serves several (one large device holding two stages) runs
  them all, one task at a time, and a hop between two of its stages stays on the node.  Nodes
  of the topology may be left out (unused).
* ``micro_batches``: for each micro-batch its ``id``, its ``originator`` (a stage-0 node: it
  embeds the batch, runs stage 0, and later the loss and stage 0's backward), its ``route``: the
  list of ``(stage, node)`` hops through the body stages in visit order (stage 0 is implicit at
  both ends; backward retraces the route in reverse), and ``start_s``, the earliest time the
  originator may start it.
* Injection order: on each originator, micro-batches start in the order they appear in
  ``micro_batches`` (never before ``start_s``, and only when a memory credit is free).
* ``memory``: at most ``memory`` micro-batches in flight per node.  A node takes a credit when it
  starts a micro-batch's first forward there and returns it when it finishes that micro-batch's
  last backward there (:meth:`Schedule.credit_free`: the hops that neither take nor return one).
* ``policy``: task priority on every node when several are ready.  ``"1f1b"`` (the default and
  what the runtime implements): backward and loss before forward, each class first-come
  first-served.  ``"gpipe"``: forward first (a GPipe-order baseline).

Execution semantics (simulator and runtime alike): a node runs one task at a time; it starts a
task as soon as its input has arrived and the node is free.  Route-level constraints
(:mod:`skiptrain.schedule.routes`) are checked by :meth:`Schedule.validate`.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import UserError
from .routes import RouteError, check_route, stage_visit_counts, visits_per_route

POLICIES = ("1f1b", "gpipe")
#: constraint names :meth:`Schedule.validate` understands (a method lists the ones it claims)
CONSTRAINTS = ("placement", "originators", "stage0_ends", "skip_count", "no_repeat", "swaps",
               "balanced", "memory", "full_route")
#: what a skip-and-reorder schedule claims (everything except ``full_route``)
SKIP_CLAIMS = tuple(c for c in CONSTRAINTS if c != "full_route")


class ScheduleError(UserError, ValueError):
    """A schedule (or a request for one) that breaks a constraint; the message says which."""


@dataclass
class MicroBatch:
    """One micro-batch: ``route`` is ``[(stage, node), ...]`` over body stages, in visit order."""
    id: int
    originator: int
    route: list[tuple[int, int]]
    start_s: float = 0.0

    @property
    def stages(self) -> list[int]:
        return [s for s, _ in self.route]

    @property
    def nodes(self) -> list[int]:
        return [n for _, n in self.route]

    def path(self) -> list[tuple[int, int]]:
        """Full forward path including the originator at stage 0 (not the return to it)."""
        return [(0, self.originator), *self.route]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "originator": self.originator,
                "route": [[s, n] for s, n in self.route], "start_s": self.start_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MicroBatch":
        return cls(int(d["id"]), int(d["originator"]), [(int(s), int(n)) for s, n in d["route"]],
                   float(d.get("start_s", 0.0)))


@dataclass
class Schedule:
    """Placement + routes + injection order of one iteration; see the module docstring."""
    placement: list[list[int]]
    micro_batches: list[MicroBatch]
    memory: int
    skip_ratio: float = 0.0
    max_swaps: int = 2
    policy: str = "1f1b"
    method: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    def stage_of(self) -> dict[int, int]:
        """``{node: stage}`` for every placed node (the lowest, for a node serving several)."""
        out: dict[int, int] = {}
        for s, nodes in enumerate(self.placement):
            for n in nodes:
                out.setdefault(n, s)
        return out

    def stages_of(self) -> dict[int, list[int]]:
        """``{node: [stages it serves, ascending]}`` for every placed node."""
        out: dict[int, list[int]] = {}
        for s, nodes in enumerate(self.placement):
            for n in nodes:
                out.setdefault(n, []).append(s)
        return out

    def keep_on_nodes(self) -> "Schedule":
        """Every route, in place, kept on its nodes (:func:`keep_on_node`); nothing changes when
        every node serves one stage.  Returns the schedule."""
        stages_of = self.stages_of()
        if any(len(ss) > 1 for ss in stages_of.values()):
            for mb in self.micro_batches:
                mb.route = keep_on_node(mb.originator, mb.route, stages_of)
        return self

    def hosts_several(self) -> bool:
        """Whether some node serves more than one stage."""
        return len(self.stages_of()) < sum(len(p) for p in self.placement)

    def credit_free(self) -> set[tuple[int, int]]:
        """``(j, pos)`` of the forward hops that take no memory credit (and of the backward hops
        that return none): micro-batch ``j``'s later visits of a node it already visited."""
        out: set[tuple[int, int]] = set()
        for j, mb in enumerate(self.micro_batches):
            seen = {mb.originator}
            for p, n in enumerate(mb.nodes, start=1):
                if n in seen:
                    out.add((j, p))
                seen.add(n)
        return out

    def nodes(self) -> list[int]:
        return sorted(n for nodes in self.placement for n in nodes)

    def by_originator(self) -> dict[int, list[MicroBatch]]:
        """Micro-batches per originator, in injection order."""
        out: dict[int, list[MicroBatch]] = {}
        for mb in self.micro_batches:
            out.setdefault(mb.originator, []).append(mb)
        return out

    def node_visits(self) -> Counter:
        """Micro-batches (forward passes) per node, originators included."""
        c: Counter = Counter()
        for mb in self.micro_batches:
            c[mb.originator] += 1
            for _, n in mb.route:
                c[n] += 1
        return c

    def stage_visits(self) -> list[int]:
        return stage_visit_counts([mb.stages for mb in self.micro_batches], self.n_stages)

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"format": "skiptrain.schedule/1", "placement": [list(p) for p in self.placement],
                "memory": self.memory, "skip_ratio": self.skip_ratio, "max_swaps": self.max_swaps,
                "policy": self.policy, "method": self.method, "meta": self.meta,
                "micro_batches": [mb.to_dict() for mb in self.micro_batches]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Schedule":
        try:
            return cls(placement=[[int(n) for n in p] for p in d["placement"]],
                       micro_batches=[MicroBatch.from_dict(x) for x in d["micro_batches"]],
                       memory=int(d["memory"]), skip_ratio=float(d.get("skip_ratio", 0.0)),
                       max_swaps=int(d.get("max_swaps", 2)), policy=d.get("policy", "1f1b"),
                       method=d.get("method", ""), meta=dict(d.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"not a schedule: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        return cls.from_dict(json.loads(Path(path).read_text()))

    # -- constraints ---------------------------------------------------------------------------

    def validate(self, claims: Iterable[str] = SKIP_CLAIMS, n_nodes: int | None = None) -> None:
        """Raise :class:`ScheduleError` if a claimed constraint is broken.

        ``placement``: a stage's nodes distinct, every stage non-empty, ids below ``n_nodes``.
        ``originators``/``stage0_ends``: every originator is a stage-0 node and no route hop is
        stage 0 (stage 0 is first and last, never inside a route).  ``skip_count``: every route
        visits ``visits_per_route(skip_ratio, S)`` body stages.  ``full_route``: every route is
        1..S-1 in order.  ``no_repeat``/``swaps``: no stage twice (so a node twice only when it
        serves several stages), ascending up to at most ``max_swaps`` disjoint neighbour swaps.  ``balanced``: body-stage visit counts differ
        by at most one.  ``memory``: ``memory >= 1`` and no originator could exceed it (the
        simulator checks the timeline).  Every hop's node must serve the hop's stage.
        """
        claims = set(claims)
        unknown = claims - set(CONSTRAINTS)
        if unknown:
            raise ValueError(f"unknown constraints {sorted(unknown)}")
        S = self.n_stages
        if self.policy not in POLICIES:
            raise ScheduleError(f"policy {self.policy!r} is not one of {POLICIES}")
        if self.memory < 1:
            raise ScheduleError(f"memory {self.memory}: every node needs at least one credit")
        all_nodes = [n for p in self.placement for n in p]
        if "placement" in claims:
            if S < 1 or any(not p for p in self.placement):
                raise ScheduleError(f"placement {self.placement}: every stage needs a node")
            dup = [(s, n) for s, p in enumerate(self.placement) for n, c in Counter(p).items() if c > 1]
            if dup:
                raise ScheduleError(f"placement: (stage, node) {dup} listed more than once")
            if n_nodes is not None and any(not 0 <= n < n_nodes for n in all_nodes):
                raise ScheduleError(f"placement names nodes outside 0..{n_nodes - 1}")
        stages_of = self.stages_of()
        ids = [mb.id for mb in self.micro_batches]
        if len(set(ids)) != len(ids):
            raise ScheduleError("micro-batch ids must be unique")
        n_visits = visits_per_route(self.skip_ratio, S) if "skip_count" in claims else None
        for mb in self.micro_batches:
            if ("originators" in claims or "stage0_ends" in claims) and 0 not in stages_of.get(mb.originator, ()):
                raise ScheduleError(f"micro-batch {mb.id}: originator {mb.originator} is not a stage-0 node")
            for s, n in mb.route:
                if s == 0:
                    raise ScheduleError(f"micro-batch {mb.id}: stage 0 inside the route {mb.route}; "
                                        "stage 0 is only first and last")
                if s not in stages_of.get(n, ()):
                    raise ScheduleError(f"micro-batch {mb.id}: hop ({s}, {n}) but node {n} serves "
                                        f"stage(s) {stages_of.get(n)}")
            try:
                check_route(mb.stages, S, n_visits,
                            self.max_swaps if "swaps" in claims else S)
            except RouteError as e:
                if "swaps" in claims or "no_repeat" in claims or "skip_count" in claims:
                    raise ScheduleError(f"micro-batch {mb.id}: {e}") from None
            if "full_route" in claims and mb.stages != list(range(1, S)):
                raise ScheduleError(f"micro-batch {mb.id}: route {mb.stages} is not the full pipeline")
        if "balanced" in claims and S > 1 and self.micro_batches:
            counts = self.stage_visits()[1:]
            if max(counts) - min(counts) > 1:
                raise ScheduleError(f"body-stage visit counts {counts} are unbalanced (max - min > 1)")


def keep_on_node(originator: int, route: Sequence[tuple[int, int]],
                 stages_of: dict[int, list[int]]) -> list[tuple[int, int]]:
    """``route`` with each hop moved onto the node of the hop before it (the originator for the
    first) when that node serves the hop's stage (``stages_of``: each node's stages): a
    micro-batch leaves a node only for a stage the node does not serve.  So two micro-batches
    never cross between two nodes that serve the same stages (2 -> 3 and 3 -> 2), each holding
    one node's credit and waiting for the other's.  With every node's stages consecutive
    (``runtime.node_stages``), ascending routes kept this way cannot deadlock the memory credits,
    whatever the timing: a micro-batch holding a node's credit while it waits elsewhere has left
    that node for a stage beyond every stage the node serves, so each wait is for a later stage
    than the waiter's own, and backward passes take no credit (``tests/unit/test_simulator.py``).  A
    node that serves a stage alone then gets only the micro-batches that reach the stage from a
    node that does not serve it."""
    out, prev = [], originator
    for s, n in route:
        if n != prev and s in stages_of.get(prev, ()):
            n = prev
        out.append((s, n))
        prev = n
    return out


def pop_next_task(hi: list, lo: list, credits: int, free: set, fwd_first: bool) -> tuple | None:
    """Take the task a node runs next from its heaps of backward (``hi``) and forward (``lo``)
    tasks, entries ``(ready_t, j, seq, kind, pos, ...)``; None when none can run.  The simulator
    and the runtime's executor both dispatch through this, so they agree task for task.

    The policy picks the heap (``fwd_first``: forwards first, GPipe; else backwards first,
    1F1B).  A forward needs a memory credit unless ``(j, pos)`` is in ``free`` (a later visit of
    a node the micro-batch already holds: a node serving several stages).  With no credit left,
    the earliest-ready credit-free forward runs: it never waits behind a forward that waits for a
    credit, since that credit may be held by the very micro-batch behind it."""
    i = None
    if lo:
        if credits > 0 or (lo[0][1], lo[0][4]) in free:
            i = 0
        elif free:
            runnable = [k for k, e in enumerate(lo) if (e[1], e[4]) in free]
            i = min(runnable, key=lambda k: lo[k][:3]) if runnable else None
    if fwd_first:
        q, i = (lo, i) if i is not None else (hi, 0)
    else:
        q, i = (hi, 0) if hi else (lo, i)
    if not q or i is None:
        return None
    if i == 0:
        return heapq.heappop(q)
    task, q[i] = q[i], q[-1]
    q.pop()
    heapq.heapify(q)
    return task
