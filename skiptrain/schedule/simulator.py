"""Discrete-event simulator of one training iteration of a :class:`~.schedule.Schedule`.

Model (DESIGN.md section 5; the runtime implements the same rules):

* Every node runs one compute task at a time, of :meth:`CostModel.fwd_s` / ``bwd_s`` / ``loss_s``
  seconds at its speed (compute plus the per-task overhead).  Ready tasks wait in two classes: backward
  (``bwd`` and ``loss``) and forward; with policy ``1f1b`` backward goes first, with ``gpipe``
  forward goes first; within a class first come, first served (ties by micro-batch order).
* Memory credits: a node starts a forward only while it holds fewer than ``schedule.memory``
  micro-batches; the credit comes back when that micro-batch's backward on the node ends.  A
  later visit of a node the micro-batch already holds (a node serving several stages) takes
  none and runs ahead of a forward that waits for a credit (``schedule.pop_next_task``, shared
  with the runtime's executor).
* Originators start their micro-batches in schedule order, each not before its ``start_s``.
* Messages: a hop ``a -> b`` of ``B`` bytes (:meth:`CostModel.hop_bytes`: fp32, or int8/int4
  on slow links with activation compression) occupies the directed link for ``B / bandwidth``
  seconds and is delivered ``latency + hop_overhead_s`` (+ ``act_codec_s`` when compressed)
  after it leaves the link.  With
  ``contention=True`` every directed link is a FIFO: a message waits until earlier ones have
  left the link.  With ``contention=False`` transfers never wait for each other.
* With ``dp_sync=True`` each stage syncs its replicas as soon as the last backward of the stage
  finished, in the phases of rings :meth:`CostModel.sync_phases` gives (one ring over all
  replicas, or with ``dp_topology`` hierarchical: the regions' rings, one ring per shard across
  regions, the regions' rings again; each phase starts when the previous one ended); every ring
  runs its chains of messages (:meth:`~skiptrain.schedule.sync_rings.SyncRing.chains`: a ring
  all-reduce for dense gradients, a ring all-gather for compressed payloads, a region's
  reduce-scatter and all-gather in the hierarchical sum), each hop after the one before it; its
  messages use the same link FIFOs.
  The iteration ends when every micro-batch is done and every stage is synced.

``simulate(..., contention=False, dp_sync=False)`` is the SkipPipe reference simulator's
simplified model (no link contention, no DP sync), for like-for-like comparisons.

If the memory credits deadlock (possible only with reordered routes) the result has
``iteration_s = inf`` and ``deadlock = True``, or :class:`SimulationError` is raised with
``on_deadlock="raise"``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from ..net.topology import Topology
from .cost import CostModel
from .schedule import Schedule, ScheduleError, pop_next_task
from .timeline import Event

_ARRIVE, _DONE, _SYNC = 0, 1, 2
_FWD, _LOSS, _BWD = 0, 1, 2
_KIND_NAMES = ("fwd", "loss", "bwd")


class SimulationError(UserError, RuntimeError):
    """The schedule cannot finish (memory credits deadlock) or does not fit the topology."""


@dataclass
class SimResult:
    """What one simulated iteration produced; times in seconds, bytes as counted on links."""
    iteration_s: float
    pipeline_s: float                      # last micro-batch done (before the DP sync tail)
    mb_done_s: dict[int, float]
    node_busy_s: dict[int, float]
    node_idle_s: dict[int, float]
    bytes_pipeline: int
    bytes_sync: int
    max_in_flight: dict[int, int]
    sync_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # stage -> (start, end)
    timeline: list[Event] = field(default_factory=list)
    deadlock: bool = False

    @property
    def bytes_on_wire(self) -> int:
        return self.bytes_pipeline + self.bytes_sync

    def score(self) -> float:
        """Planner objective: iteration time, ties broken by the mean micro-batch finish."""
        if self.deadlock or not self.mb_done_s:
            return math.inf if self.deadlock else self.iteration_s
        return self.iteration_s + 1e-3 * sum(self.mb_done_s.values()) / len(self.mb_done_s)

    def summary(self) -> dict[str, Any]:
        busy = [v for v in self.node_busy_s.values()]
        return {"iteration_s": self.iteration_s, "pipeline_s": self.pipeline_s,
                "bytes_on_wire": self.bytes_on_wire, "bytes_pipeline": self.bytes_pipeline,
                "bytes_sync": self.bytes_sync,
                "mean_utilisation": (sum(busy) / (len(busy) * self.iteration_s)
                                     if busy and self.iteration_s > 0 and math.isfinite(self.iteration_s) else 0.0),
                "max_in_flight": max(self.max_in_flight.values(), default=0),
                "deadlock": self.deadlock}


def simulate(schedule: Schedule, topo: Topology, cost: CostModel, contention: bool = True,
             dp_sync: bool = True, record: bool = True, on_deadlock: str = "inf") -> SimResult:
    """Simulate one iteration of ``schedule`` on ``topo`` under ``cost``; see the module doc.

    ``record=False`` skips building the timeline (the planner's fast path).
    """
    sim = _Run(schedule, topo, cost, contention, dp_sync, record)
    sim.run()
    return sim.result(on_deadlock)


class _Run:
    """One simulated iteration: the tables (:meth:`__init__`), the event loop (:meth:`run`, its
    handlers built over local variables for speed) and the result (:meth:`result`)."""

    def __init__(self, schedule: Schedule, topo: Topology, cost: CostModel, contention: bool, dp_sync: bool,
                 record: bool):
        S = schedule.n_stages
        if cost.n_stages != S:
            raise ScheduleError(f"cost model has {cost.n_stages} stages, schedule has {S}")
        self.stage_of = stage_of = schedule.stage_of()
        N = topo.n
        if any(n >= N or n < 0 for n in stage_of):
            raise ScheduleError(f"schedule uses nodes outside the topology's 0..{N - 1}")
        self.schedule, self.topo, self.cost = schedule, topo, cost
        self.contention, self.dp_sync, self.record = contention, dp_sync, record
        self.free = schedule.credit_free()
        self.loss_t = {n: cost.loss_s(topo.nodes[n].speed) for n in schedule.placement[0]}
        self.mbs = mbs = schedule.micro_batches
        self.paths = [[mb.originator, *mb.nodes] for mb in mbs]
        self.stages = [[0, *mb.stages] for mb in mbs]
        fwd = {}                                         # (stage, node) -> forward seconds
        self.fwd_jp = [[fwd.get((s, n)) or fwd.setdefault((s, n), cost.fwd_s(s, topo.nodes[n].speed))
                        for s, n in zip(st, path)] for st, path in zip(self.stages, self.paths)]
        bwd = {}                                         # (stage, node) -> backward seconds
        self.bwd_jp = [[bwd.get((s, n)) or bwd.setdefault((s, n), cost.bwd_s(s, topo.nodes[n].speed))
                        for s, n in zip(st, path)] for st, path in zip(self.stages, self.paths)]
        self.mb_ids = [mb.id for mb in mbs]
        self.inject: dict[int, list[int]] = {}          # injection order per originator
        for j, mb in enumerate(mbs):
            self.inject.setdefault(mb.originator, []).append(j)
        for o in self.inject:
            if 0 not in schedule.stages_of().get(o, ()):
                raise ScheduleError(f"originator {o} is not a stage-0 node")
        self.credits = [schedule.memory] * N
        self.held = [0] * N
        self.max_held = [0] * N
        self.busy_s = [0.0] * N
        self.ev: list = []
        self.counts = [0, 0, 0]                         # event sequence, pipeline bytes, sync bytes
        self.timeline: list[Event] = []
        self.done_at: dict[int, float] = {}
        self.stage_left = [0] * S                       # visits still to finish per stage
        for st in self.stages:
            for s in st:
                self.stage_left[s] += 1
        self.sync_span: dict[int, tuple[float, float]] = {}
        self.sync_state: dict[int, dict[str, Any]] = {}

    def _links(self):
        """``push(t, event...)`` and ``send(a, b, bytes, t) -> (start, delivery)`` over the links."""
        ev, counts, link_free = self.ev, self.counts, {}
        lat, inv_bw = self.topo.lat_rows, self.topo.inv_bw_rows
        contention = self.contention

        def push(t: float, etype: int, a: Any, b: Any = None, c: Any = None, d: Any = None) -> None:
            counts[0] += 1
            heapq.heappush(ev, (t, counts[0], etype, a, b, c, d))

        def send(a: int, b: int, nbytes: float, t: float) -> tuple[float, float]:
            """Queue ``nbytes`` on link a->b at ``t``; (time it starts on the link, delivery time)."""
            ser = nbytes * inv_bw[a][b]
            if contention:
                key = (a, b)
                st = link_free.get(key, 0.0)
                if st < t:
                    st = t
                link_free[key] = st + ser
            else:
                st = t
            return st, st + ser + lat[a][b]
        return push, send

    def _tasks(self, push, send):
        """``hop``, ``enqueue`` and ``dispatch``: messages between nodes and one task at a time."""
        N = self.topo.n
        hop_bytes, hop_fixed = self.cost.hop_table(self.topo)
        hi: list[list] = [[] for _ in range(N)]   # heaps of (ready_t, j, seq, kind, pos)
        lo: list[list] = [[] for _ in range(N)]
        busy = [False] * N
        counts, record, timeline, mb_ids, stage_of = self.counts, self.record, self.timeline, self.mb_ids, self.stage_of
        credits, held, max_held, busy_s, fwd_jp, bwd_jp, loss_t = (self.credits, self.held, self.max_held, self.busy_s,
                                                                   self.fwd_jp, self.bwd_jp, self.loss_t)
        stages, inject, mbs, free = self.stages, self.inject, self.mbs, self.free
        inj_ptr = {o: 0 for o in inject}
        fwd_first = self.schedule.policy == "gpipe"

        def hop(a: int, b: int, t: float, j: int, kind: int, pos: int) -> None:
            if a == b:                  # between two stages of one node: no link
                push(t, _ARRIVE, b, j, kind, pos)
                return
            nb = hop_bytes[a][b]
            st, arr = send(a, b, nb, t)
            arr += hop_fixed[a][b]
            counts[1] += nb
            if record:
                timeline.append(Event(a, "send", mb_ids[j], stage_of[a], st, arr, nb, b))
                timeline.append(Event(b, "recv", mb_ids[j], stage_of[b], arr, arr, nb, a))
            push(arr, _ARRIVE, b, j, kind, pos)

        def enqueue(node: int, t: float, j: int, kind: int, pos: int) -> None:
            counts[0] += 1
            heapq.heappush(lo[node] if kind == _FWD else hi[node], (t, j, counts[0], kind, pos))

        def dispatch(node: int, now: float) -> None:
            if busy[node]:
                return
            task = pop_next_task(hi[node], lo[node], credits[node], free, fwd_first)
            if task is None:
                return
            _, j, _, kind, pos = task
            if kind == _FWD:
                dur = fwd_jp[j][pos]
                if not free or (j, pos) not in free:
                    credits[node] -= 1
                    held[node] += 1
                    if held[node] > max_held[node]:
                        max_held[node] = held[node]
                if pos == 0:  # injection: the originator's next micro-batch becomes eligible
                    inj_ptr[node] += 1
                    if inj_ptr[node] < len(inject[node]):
                        nj = inject[node][inj_ptr[node]]
                        push(max(now, mbs[nj].start_s), _ARRIVE, node, nj, _FWD, 0)
            else:
                dur = loss_t[node] if kind == _LOSS else bwd_jp[j][pos]
            busy[node] = True
            busy_s[node] += dur
            if record:
                timeline.append(Event(node, _KIND_NAMES[kind], mb_ids[j], stages[j][pos], now, now + dur))
            push(now + dur, _DONE, node, j, kind, pos)
        return hop, enqueue, dispatch, busy

    def _syncs(self, push, send):
        """``start_sync(stage, t)`` and ``sync_arrive``: each stage's sync, phase by phase
        (:meth:`CostModel.sync_phases`: one ring, or region rings, the shard rings across
        regions, region rings); a phase's rings run at once and the next phase starts when all of them ended."""
        schedule, cost, topo, sync_state, sync_span, counts = (self.schedule, self.cost, self.topo,
                                                               self.sync_state, self.sync_span, self.counts)

        def start_sync(s: int, t: float) -> None:
            reps, nbytes = schedule.placement[s], cost.sync_bytes(s)
            if cost.dp_mode == "none" or len(reps) < 2:
                sync_span[s] = (t, t)
                return
            sync_state[s] = {"phases": cost.sync_phases(topo, reps, nbytes), "phase": -1, "nbytes": nbytes,
                             "start": t, "end": {}, "sent": {}, "nodes": sorted(reps)}
            start_phase(s, t)

        def start_phase(s: int, t: float) -> None:
            stt = sync_state[s]
            stt["phase"] += 1
            rings, share = stt["phases"][stt["phase"]]
            chains = [ring.chains(cost.sync_steps(len(ring))) for ring in rings]
            stt["rings"] = [(ring.nodes, hops, share * frac) for ring, (_, hops, frac) in zip(rings, chains)]
            stt["left"] = sum(len(starts) for starts, hops, _ in chains if hops)
            for i, (starts, hops, _) in enumerate(chains):
                for r in starts if hops else ():
                    sync_send(s, i, r, 0, t)
            if stt["left"] == 0 and stt["phase"] + 1 < len(stt["phases"]):    # (a phase with nothing to send)
                start_phase(s, t)

        def sync_send(s: int, i: int, r: int, k: int, t: float) -> None:
            stt = sync_state[s]
            ring, _, frac = stt["rings"][i]
            a, b = ring[r], ring[(r + 1) % len(ring)]
            nb = stt["nbytes"] * frac
            _, arr = send(a, b, nb, t)
            counts[2] += int(nb)
            stt["sent"][a] = stt["sent"].get(a, 0) + int(nb)
            push(arr, _SYNC, s, i, (r + 1) % len(ring), k)

        def sync_arrive(s: int, i: int, r: int, k: int, t: float) -> None:
            """Ring ``i`` of stage ``s``'s phase: position ``r`` received step ``k`` at ``t``."""
            stt = sync_state[s]
            ring, steps, _ = stt["rings"][i]
            stt["end"][ring[r]] = max(t, stt["end"].get(ring[r], t))
            if k + 1 < steps:
                sync_send(s, i, r, k + 1, t)
                return
            stt["left"] -= 1
            if stt["left"] == 0 and stt["phase"] + 1 < len(stt["phases"]):
                start_phase(s, t)
        return start_sync, sync_arrive

    def run(self) -> None:
        """The event loop: arrivals queue tasks, finished tasks send along the route (forward out,
        loss at the originator, backward back), the last visit of a stage starts its sync."""
        push, send = self._links()
        hop, enqueue, dispatch, busy = self._tasks(push, send)
        start_sync, sync_arrive = self._syncs(push, send)
        ev, paths, stages, credits, held, free = self.ev, self.paths, self.stages, self.credits, self.held, self.free
        stage_left, done_at, mb_ids, dp_sync = self.stage_left, self.done_at, self.mb_ids, self.dp_sync
        for o, js in self.inject.items():            # the first micro-batch of every originator
            push(self.mbs[js[0]].start_s, _ARRIVE, o, js[0], _FWD, 0)
        while ev:
            now, _, etype, a, j, kind, pos = heapq.heappop(ev)
            if etype == _ARRIVE:
                enqueue(a, now, j, kind, pos)
                dispatch(a, now)
            elif etype == _DONE:
                node = a
                busy[node] = False
                path = paths[j]
                v = len(path) - 1
                if kind == _FWD:
                    if pos < v:
                        hop(node, path[pos + 1], now, j, _FWD, pos + 1)
                    elif v == 0:
                        enqueue(node, now, j, _LOSS, 0)
                    else:
                        hop(node, path[0], now, j, _LOSS, 0)
                elif kind == _LOSS:
                    if v == 0:
                        enqueue(node, now, j, _BWD, 0)
                    else:
                        hop(node, path[v], now, j, _BWD, v)
                else:
                    if not free or (j, pos) not in free:
                        credits[node] += 1
                        held[node] -= 1
                    s = stages[j][pos]
                    stage_left[s] -= 1
                    if pos > 0:
                        hop(node, path[pos - 1], now, j, _BWD, pos - 1)
                    else:
                        done_at[mb_ids[j]] = now
                    if stage_left[s] == 0 and dp_sync:
                        start_sync(s, now)
                dispatch(node, now)
            else:  # _SYNC arrival: stage a, ring j of its phase, position kind received step pos
                sync_arrive(a, j, kind, pos, now)

    def result(self, on_deadlock: str) -> SimResult:
        M, done_at, timeline = len(self.mbs), self.done_at, self.timeline
        deadlock = len(done_at) < M
        if deadlock and on_deadlock == "raise":
            raise SimulationError(
                f"schedule deadlocked: {M - len(done_at)} of {M} micro-batches never finished "
                f"(memory credits {self.schedule.memory} exhausted in a cycle; use ascending routes or more memory)")
        pipeline_s = max(done_at.values(), default=0.0)
        iteration_s = pipeline_s
        for s, stt in self.sync_state.items():
            end = max(stt["end"].values(), default=stt["start"])
            self.sync_span[s] = (stt["start"], end)
            iteration_s = max(iteration_s, end)
            if self.record:
                for node in stt["nodes"]:
                    timeline.append(Event(node, "sync", None, s, stt["start"], stt["end"].get(node, end),
                                          stt["sent"].get(node, 0)))
        if deadlock:
            iteration_s = math.inf
        placed = self.schedule.nodes()
        busy_s = self.busy_s
        node_idle = {n: (iteration_s - busy_s[n]) if math.isfinite(iteration_s) else math.inf for n in placed}
        if self.record:
            timeline.sort(key=lambda e: (e.start, e.node))
        return SimResult(iteration_s=iteration_s, pipeline_s=pipeline_s, mb_done_s=done_at,
                         node_busy_s={n: busy_s[n] for n in placed}, node_idle_s=node_idle,
                         bytes_pipeline=self.counts[1], bytes_sync=self.counts[2],
                         max_in_flight={n: self.max_held[n] for n in placed}, sync_s=self.sync_span,
                         timeline=timeline, deadlock=deadlock)
