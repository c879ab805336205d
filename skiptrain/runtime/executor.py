"""Executes one node's share of a :class:`~skiptrain.schedule.schedule.Schedule`, one iteration
at a time, with the simulator's rules (see :mod:`skiptrain.schedule.simulator`):

* one compute task at a time; ready tasks wait in two classes, backward (``bwd`` and ``loss``)
  and forward; policy ``1f1b`` runs backward first, ``gpipe`` forward first; each class is
  first come, first served (ties by micro-batch order);
* memory credits: a forward starts only while fewer than ``schedule.memory`` micro-batches are
  held; the credit returns when that micro-batch's backward on this node ends;
* an originator injects its micro-batches in schedule order, each not before ``start_s``, the
  next one becoming eligible when the previous one's forward starts.

Tasks.  Originator, position 0: ``fwd`` = embedding + stage 0's layers on the micro-batch's
samples (autograd graph kept), activations to the first hop; ``loss`` = final norm + head +
cross-entropy + its backward when the activations come back, gradient to the last hop;
``bwd`` = backward through stage 0's layers and the embedding.  Body hop at position ``p``:
``fwd`` = the stage's layers on the received activations (kept with their graph), ``bwd`` =
backward with the received gradient, the input's gradient to the previous hop.  Parameter
gradients accumulate (a sum over the micro-batches this node processed), which is what the
data-parallel sync strategies expect.

Every message a node will receive in an iteration follows from the schedule, so the executor
announces their number to the transport up front and knows at any time what it still waits for;
a wait longer than ``timeout_s`` raises :class:`~skiptrain.runtime.failure.NodeFailure` naming
the node(s) it was waiting on.  A transport error (peer died) is raised as ``NodeFailure`` for
that peer, a payload rejected by ``check`` (wrong shape, non-finite values: a bad peer) as
``NodeFailure`` for its sender.  The executor never re-routes inside an iteration: on any
failure the node abandons the iteration and :mod:`.recovery` re-plans the next attempt.
"""

from __future__ import annotations

import heapq
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..schedule.schedule import Schedule
from ..schedule.timeline import Event
from .failure import NodeFailure
from .transport import ACT, GRAD, KIND_NAMES, Message, P2PTransport, TransportError
from .wan import ComputePadding

FWD, LOSS, BWD = 0, 1, 2
_NAMES = ("fwd", "loss", "bwd")


@dataclass
class NodePlan:
    """This node's part of one iteration, derived from the schedule alone."""
    rank: int
    stage: int | None
    inject: list[int]                       # indices j of micro-batches this node originates
    n_tasks: int
    incoming: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (kind, j, pos) -> src
    paths: list[list[int]] = field(default_factory=list)
    stages: list[list[int]] = field(default_factory=list)

    @property
    def n_incoming(self) -> int:
        return len(self.incoming)


def node_plan(schedule: Schedule, rank: int) -> NodePlan:
    """What ``rank`` computes and receives in one iteration of ``schedule``.

    Messages (``kind``, micro-batch index ``j``, ``pos``): activations with ``pos = p`` run the
    forward at path position ``p`` (``p = v + 1``: back at the originator for the loss);
    gradients with ``pos = p`` run the backward at position ``p``."""
    stage = schedule.stage_of().get(rank)
    paths = [[mb.originator, *mb.nodes] for mb in schedule.micro_batches]
    stages = [[0, *mb.stages] for mb in schedule.micro_batches]
    inject = [j for j, mb in enumerate(schedule.micro_batches) if mb.originator == rank]
    n_tasks = 3 * len(inject)
    incoming: dict[tuple[int, int, int], int] = {}
    for j, path in enumerate(paths):
        v = len(path) - 1
        for p in range(1, v + 1):
            if path[p] == rank:
                n_tasks += 2
                incoming[(ACT, j, p)] = path[p - 1]
                incoming[(GRAD, j, p)] = path[0] if p == v else path[p + 1]
        if v > 0 and path[0] == rank:
            incoming[(ACT, j, v + 1)] = path[v]
            incoming[(GRAD, j, 0)] = path[1]
    return NodePlan(rank, stage, inject, n_tasks, incoming, paths, stages)


@dataclass
class IterationResult:
    loss_sum: float = 0.0
    n_loss: int = 0
    n_processed: int = 0            # backward passes on this node (the DP weight)
    events: list[Event] = field(default_factory=list)
    max_in_flight: int = 0


class Executor:
    """Runs iterations for one node.  ``model`` holds this node's stage (a
    :class:`~skiptrain.model.transformer.StagedLM` built with ``stages=[stage]``); ``cost`` gives
    the emulated task durations when ``padding.enabled``; ``describe(node)`` names nodes in
    errors."""

    def __init__(self, rank: int, transport: P2PTransport, model=None, stage: int | None = None,
                 cost=None, speed: float = 1.0, padding: ComputePadding | None = None,
                 timeout_s: float = 30.0, describe: Callable[[int], str] = lambda n: f"node {n}",
                 check: Callable[[Message], None] | None = None):
        self.rank, self.tr, self.model, self.stage = rank, transport, model, stage
        self.check = check              # payload check (raises NodeFailure naming the sender)
        self.cost, self.speed = cost, speed
        self.padding = padding or ComputePadding(False)
        self.timeout_s = timeout_s
        self.describe = describe

    # ---- durations -------------------------------------------------------------------------

    def _emulated(self, kind: int, stage: int) -> float:
        if self.cost is None:
            return 0.0
        if kind == FWD:
            return self.cost.fwd_s(stage, self.speed)
        if kind == BWD:
            return self.cost.bwd_s(stage, self.speed)
        return self.cost.loss_s(self.speed)

    # ---- one iteration -------------------------------------------------------------------

    def run_iteration(self, iteration: int, schedule: Schedule, t0: float,
                      batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> IterationResult:
        """Run this node's tasks of ``schedule``; ``batch_fn(mb_id)`` gives (inputs, targets).
        ``t0`` is the common iteration start (``time.time()`` clock)."""
        plan = node_plan(schedule, self.rank)
        mbs = schedule.micro_batches
        id_to_j = {mb.id: j for j, mb in enumerate(mbs)}
        res = IterationResult()
        if plan.n_tasks == 0:
            return res
        self.tr.expect(plan.n_incoming)
        waiting = dict(plan.incoming)              # messages still to come
        hi: list = []                              # (ready_t, j, seq, kind, pos, tensor)
        lo: list = []
        seq = 0
        credits = schedule.memory
        held = 0
        state: dict[tuple[int, int], tuple] = {}   # (j, pos) -> saved tensors
        fwd_first = schedule.policy == "gpipe"
        inj_ptr = 0
        inj_at = t0 + mbs[plan.inject[0]].start_s if plan.inject else None
        remaining = plan.n_tasks
        last_progress = time.time()

        def push(kind: int, j: int, pos: int, ready: float, tensor) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(lo if kind == FWD else hi, (ready, j, seq, kind, pos, tensor))

        def accept(m: Message | TransportError) -> None:
            if isinstance(m, TransportError):
                raise NodeFailure(str(m), node=m.peer)
            if m.iteration != iteration:
                raise NodeFailure(f"node {self.rank}: got a message of iteration {m.iteration} during "
                                  f"iteration {iteration} from node {m.src}", node=m.src)
            if self.check is not None:
                self.check(m)
            j = id_to_j.get(m.mb, -1)
            key = (m.kind, j, m.pos)
            if waiting.pop(key, None) is None:
                raise NodeFailure(f"node {self.rank}: unexpected {KIND_NAMES[m.kind]} for micro-batch "
                                  f"{m.mb} (pos {m.pos}) from node {m.src}",
                                  node=m.src)
            ready = m.arrived - t0
            v = len(plan.paths[j]) - 1
            if m.kind == ACT:
                push(LOSS if m.pos == v + 1 else FWD, j, m.pos, ready, m.tensor)
            else:
                push(BWD, j, m.pos, ready, m.tensor)

        while remaining:
            # 1. everything that has arrived
            while True:
                try:
                    accept(self.tr.inbox.get_nowait())
                    last_progress = time.time()
                except queue.Empty:
                    break
            now = time.time()
            if inj_at is not None and now >= inj_at:
                j = plan.inject[inj_ptr]
                push(FWD, j, 0, inj_at - t0, None)
                inj_at = None
            # 2. pick a task by policy
            can_fwd = bool(lo) and credits > 0
            q = None
            if fwd_first:
                q = lo if can_fwd else (hi or None)
            else:
                q = hi if hi else (lo if can_fwd else None)
            if not q:
                wait = self.timeout_s - (now - last_progress)
                if inj_at is not None:
                    wait = min(wait, max(inj_at - now, 0.0))
                if wait <= 0 and inj_at is None:
                    raise self._timeout(waiting, plan, mbs)
                try:
                    accept(self.tr.inbox.get(timeout=max(wait, 1e-4)))
                    last_progress = time.time()
                except queue.Empty:
                    if inj_at is None and time.time() - last_progress >= self.timeout_s:
                        raise self._timeout(waiting, plan, mbs) from None
                continue
            _, j, _, kind, pos, tensor = heapq.heappop(q)
            follow = self._run(kind, j, pos, tensor, plan, mbs, state, res, t0, batch_fn)
            if follow is not None:
                push(follow[0], follow[1], follow[2], follow[3], follow[4])
            remaining -= 1
            last_progress = time.time()
            if kind == FWD:
                credits -= 1
                held += 1
                res.max_in_flight = max(res.max_in_flight, held)
                if pos == 0:
                    inj_ptr += 1
                    if inj_ptr < len(plan.inject):
                        inj_at = max(res.events[-1].start + t0, t0 + mbs[plan.inject[inj_ptr]].start_s)
            elif kind == BWD:
                credits += 1
                held -= 1
                res.n_processed += 1
        return res

    def _timeout(self, waiting: dict, plan: NodePlan, mbs) -> NodeFailure:
        srcs = sorted(set(waiting.values()))
        items = sorted(waiting.items(), key=lambda kv: (kv[0][1], kv[0][0]))[:4]
        what = ", ".join(f"{KIND_NAMES[k]} of micro-batch {mbs[j].id} from node {src}"
                         for (k, j, _), src in items)
        culprit = srcs[0] if len(srcs) == 1 else None
        names = ", ".join(self.describe(s) for s in srcs)
        return NodeFailure(f"node {self.rank}: nothing arrived for {self.timeout_s:g} s; still waiting for "
                           f"{len(waiting)} message(s) ({what}) from {names}", node=culprit)

    def _run(self, kind: int, j: int, pos: int, tensor, plan: NodePlan, mbs, state, res: IterationResult,
             t0: float, batch_fn) -> tuple | None:
        """Run one task; return a follow-up task on this node ``(kind, j, pos, ready, tensor)``
        (only for routes without body hops), else None."""
        mb = mbs[j]
        path = plan.paths[j]
        v = len(path) - 1
        stage = plan.stages[j][pos] if kind != LOSS else 0
        m = self.model
        start = time.time()
        out_msgs: list[tuple[int, int, int, torch.Tensor]] = []  # (dst, kind, pos, tensor)
        local: tuple | None = None
        if kind == FWD and pos == 0:
            x, y = batch_fn(mb.id)
            h = m.embed(x)
            state[(j, 0)] = (h, y)
            if v > 0:
                out_msgs.append((path[1], ACT, 1, h.detach()))
            else:
                local = (LOSS, v + 1, h.detach())
        elif kind == FWD:
            h_in = tensor.requires_grad_(True)
            out = m.run_stage(stage, h_in)
            state[(j, pos)] = (h_in, out)
            out_msgs.append((path[pos + 1] if pos < v else path[0], ACT, pos + 1, out.detach()))
        elif kind == LOSS:
            h = tensor.requires_grad_(True)
            _, y = state[(j, 0)]
            loss = m.loss(m.logits(h), y)
            loss.backward()
            res.loss_sum += float(loss.detach())
            res.n_loss += 1
            if v > 0:
                out_msgs.append((path[v], GRAD, v, h.grad))
            else:
                local = (BWD, 0, h.grad)
        else:  # BWD
            a, b = state.pop((j, pos))
            if pos == 0:
                a.backward(tensor)           # a = stage-0 output h, b = targets
            else:
                b.backward(tensor)           # a = received input (leaf), b = this stage's output
                out_msgs.append((path[pos - 1], GRAD, pos - 1, a.grad))
        end = self.padding.pad(start, self._emulated(kind, stage))
        res.events.append(Event(self.rank, _NAMES[kind], mb.id, stage, start - t0, end - t0))
        for dst, k, p, t in out_msgs:
            self.tr.send(dst, k, mb.id, p, t)
        return None if local is None else (local[0], j, local[1], end - t0, local[2])
