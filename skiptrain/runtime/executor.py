"""Executes one node's share of a :class:`~skiptrain.schedule.schedule.Schedule`, one iteration
at a time, with the simulator's rules (see :mod:`skiptrain.schedule.simulator`):

* one compute task at a time; ready tasks wait in two classes, backward (``bwd`` and ``loss``)
  and forward; policy ``1f1b`` runs backward first, ``gpipe`` forward first; each class is
  first come, first served (ties by micro-batch order);
* memory credits: a micro-batch's first forward on this node starts only while fewer than
  ``schedule.memory`` micro-batches are held; the credit returns when its last backward on this
  node ends (a node serving several stages holds a micro-batch once, whatever stages it visits,
  and such a later visit runs ahead of a forward that waits for a credit: the simulator's rule,
  ``schedule.pop_next_task``);
* an originator injects its micro-batches in schedule order, each not before ``start_s``, the
  next one becoming eligible when the previous one's forward starts.

Tasks.  Originator, position 0: ``fwd`` = embedding + stage 0's layers on the micro-batch's
samples (autograd graph kept; with a frozen prefix, ``embed`` runs stage 0's trainable layers
on the prefix's output), activations to the first hop; ``loss`` = final norm + head +
cross-entropy + its backward when the activations come back, gradient to the last hop;
``bwd`` = backward through stage 0's layers and the embedding.  Body hop at position ``p``:
``fwd`` = the stage's layers on the received activations (kept with their graph), ``bwd`` =
backward with the received gradient, the input's gradient to the previous hop.  Parameter
gradients accumulate (a sum over the micro-batches this node processed), which is what the
data-parallel sync strategies expect.  A node serving several stages runs each hop at the
stage the route names there; a message between two of its stages goes through its own
transport without a wire.

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

from ..schedule.schedule import Schedule, pop_next_task
from ..schedule.timeline import Event
from .failure import NodeFailure
from .transport import ACT, GRAD, KIND_NAMES, Message, P2PTransport, TransportError

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
    free: set[tuple[int, int]] = field(default_factory=set)   # (j, pos) taking no memory credit

    @property
    def n_wire(self) -> int:
        """Incoming messages from other nodes (not from this node's own other stages)."""
        return sum(src != self.rank for src in self.incoming.values())


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
    return NodePlan(rank, stage, inject, n_tasks, incoming, paths, stages, schedule.credit_free())


@dataclass
class IterationResult:
    loss_sum: float = 0.0
    n_loss: int = 0
    n_processed: int = 0            # backward passes on this node (the DP weight)
    processed: dict[int, int] = field(default_factory=dict)   # backward passes per stage
    events: list[Event] = field(default_factory=list)
    max_in_flight: int = 0


class _Run:
    """One iteration's task queues, memory credits and expected messages on one node."""

    def __init__(self, ex: "Executor", iteration: int, schedule: Schedule, t0: float):
        self.ex, self.iteration, self.t0 = ex, iteration, t0
        self.plan = node_plan(schedule, ex.rank)
        self.mbs = schedule.micro_batches
        self.id_to_j = {mb.id: j for j, mb in enumerate(self.mbs)}
        self.res = IterationResult()
        self.waiting = dict(self.plan.incoming)          # messages still to come
        self.hi: list = []                               # (ready_t, j, seq, kind, pos, tensor)
        self.lo: list = []
        self.seq = 0
        self.credits = schedule.memory
        self.held = 0
        self.state: dict[tuple[int, int], tuple] = {}    # (j, pos) -> saved tensors
        self.fwd_first = schedule.policy == "gpipe"
        self.inj_ptr = 0
        self.inj_at = t0 + self.mbs[self.plan.inject[0]].start_s if self.plan.inject else None
        self.remaining = self.plan.n_tasks
        self.last_progress = time.time()

    def push(self, kind: int, j: int, pos: int, ready: float, tensor) -> None:
        self.seq += 1
        heapq.heappush(self.lo if kind == FWD else self.hi, (ready, j, self.seq, kind, pos, tensor))

    def accept(self, m: "Message | TransportError") -> None:
        ex = self.ex
        if isinstance(m, TransportError):
            raise NodeFailure(str(m), node=m.peer)
        if m.iteration != self.iteration:
            raise NodeFailure(f"node {ex.rank}: got a message of iteration {m.iteration} during "
                              f"iteration {self.iteration} from node {m.src}", node=m.src)
        if ex.check is not None:
            ex.check(m)
        j = self.id_to_j.get(m.mb, -1)
        if self.waiting.pop((m.kind, j, m.pos), None) is None:
            raise NodeFailure(f"node {ex.rank}: unexpected {KIND_NAMES[m.kind]} for micro-batch "
                              f"{m.mb} (pos {m.pos}) from node {m.src}", node=m.src)
        ready = m.arrived - self.t0
        v = len(self.plan.paths[j]) - 1
        if m.kind == ACT:
            self.push(LOSS if m.pos == v + 1 else FWD, j, m.pos, ready, m.tensor)
        else:
            self.push(BWD, j, m.pos, ready, m.tensor)
        self.last_progress = time.time()

    def drain(self) -> None:
        """Accept everything that has arrived."""
        while True:
            try:
                self.accept(self.ex.tr.inbox.get_nowait())
            except queue.Empty:
                return

    def pick(self, now: float) -> tuple | None:
        """Inject the next own micro-batch when due; take the task to run next, by policy and
        memory credits (:func:`~skiptrain.schedule.schedule.pop_next_task`), or None."""
        if self.inj_at is not None and now >= self.inj_at:
            self.push(FWD, self.plan.inject[self.inj_ptr], 0, self.inj_at - self.t0, None)
            self.inj_at = None
        return pop_next_task(self.hi, self.lo, self.credits, self.plan.free, self.fwd_first)

    def wait(self) -> None:
        """Nothing runnable: wait for a message (or the next injection); time out naming the peers."""
        now = time.time()
        ex = self.ex
        wait = ex.timeout_s - (now - self.last_progress)
        if self.inj_at is not None:
            wait = min(wait, max(self.inj_at - now, 0.0))
        if wait <= 0 and self.inj_at is None:
            raise ex.timeout_error(self.waiting, self.plan, self.mbs)
        try:
            self.accept(ex.tr.inbox.get(timeout=max(wait, 1e-4)))
        except queue.Empty:
            if self.inj_at is None and time.time() - self.last_progress >= ex.timeout_s:
                raise ex.timeout_error(self.waiting, self.plan, self.mbs) from None

    def done(self, kind: int, j: int, pos: int) -> None:
        """Bookkeeping after a task: credits, the next injection, the DP weights."""
        self.remaining -= 1
        self.last_progress = time.time()
        res = self.res
        credit = (j, pos) not in self.plan.free
        if kind == FWD:
            if credit:
                self.credits -= 1
                self.held += 1
                res.max_in_flight = max(res.max_in_flight, self.held)
            if pos == 0:
                self.inj_ptr += 1
                if self.inj_ptr < len(self.plan.inject):
                    self.inj_at = max(res.events[-1].start + self.t0,
                                      self.t0 + self.mbs[self.plan.inject[self.inj_ptr]].start_s)
        elif kind == BWD:
            if credit:
                self.credits += 1
                self.held -= 1
            res.n_processed += 1
            stage = self.plan.stages[j][pos]
            res.processed[stage] = res.processed.get(stage, 0) + 1


class Executor:
    """Runs iterations for one node.  ``model`` holds this node's stages (a
    :class:`~skiptrain.model.transformer.StagedLM` built with those ``stages``); ``timer(kind,
    stage, start)`` says when a task that started at ``start`` ends (default: now, when its
    compute is done; :meth:`skiptrain.runtime.emulation.Emulation.finish` pads it to an emulated
    duration); ``describe(node)`` names nodes in errors; ``embed`` (default ``model.embed``) maps
    a micro-batch's inputs to stage 0's output."""

    def __init__(self, rank: int, transport: P2PTransport, model=None,
                 timer: Callable[[int, int, float], float] | None = None,
                 timeout_s: float = 30.0, describe: Callable[[int], str] = lambda n: f"node {n}",
                 check: Callable[[Message], None] | None = None,
                 embed: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.rank, self.tr, self.model = rank, transport, model
        self.embed = embed
        self.check = check              # payload check (raises NodeFailure naming the sender)
        self.timer = timer or (lambda kind, stage, start: time.time())
        self.timeout_s = timeout_s
        self.describe = describe

    # ---- one iteration -------------------------------------------------------------------

    def run_iteration(self, iteration: int, schedule: Schedule, t0: float,
                      batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> IterationResult:
        """Run this node's tasks of ``schedule``; ``batch_fn(mb_id)`` gives (inputs, targets).
        ``t0`` is the common iteration start (``time.time()`` clock)."""
        self.tr.begin_iteration(iteration, t0)
        run = _Run(self, iteration, schedule, t0)
        if run.plan.n_tasks == 0:
            return run.res
        self.tr.expect(run.plan.n_wire)
        while run.remaining:
            run.drain()
            task = run.pick(time.time())
            if task is None:
                run.wait()
                continue
            _, j, _, kind, pos, tensor = task
            follow = self._run(kind, j, pos, tensor, run.plan, run.mbs, run.state, run.res, t0, batch_fn)
            if follow is not None:
                run.push(*follow)
            run.done(kind, j, pos)
        return run.res

    def timeout_error(self, waiting: dict, plan: NodePlan, mbs) -> NodeFailure:
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
            h = (self.embed or m.embed)(x)
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
                if a.requires_grad:          # a = stage-0 output h (none trainable: frozen), b = targets
                    a.backward(tensor)
            else:
                b.backward(tensor)           # a = received input (leaf), b = this stage's output
                out_msgs.append((path[pos - 1], GRAD, pos - 1, a.grad))
        end = self.timer(kind, stage, start)
        res.events.append(Event(self.rank, _NAMES[kind], mb.id, stage, start - t0, end - t0))
        for dst, k, p, t in out_msgs:
            self.tr.send(dst, k, mb.id, p, t)
        return None if local is None else (local[0], j, local[1], end - t0, local[2])
