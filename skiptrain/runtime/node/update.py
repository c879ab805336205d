"""The update of one iteration on one node: the data-parallel sync and the one optimizer step
(:func:`~skiptrain.runtime.step.optimizer_step`, in its two halves) for the stages this node
serves, then every pipeline send finished, and the iteration's events in its record.

The sync runs as soon as this node's pipeline tasks are done (:func:`exchange_early`, before
the commit) unless its strategy clips before it (DeMo: the global norm needs every node's
gradients, so its sync follows the commit, in :func:`step`)."""

from __future__ import annotations

import time

import torch

from ...dp.transport import NonFiniteContribution
from ...schedule.timeline import Event
from ..recovery import blame_sender, stage_grad_norms
from ..step import HostedStage, apply_step, exchange_first, exchange_stages, optimizer_step
from .state import Attempt, PhaseState


def step_and_record(node, st: PhaseState, a: Attempt, t0: float) -> list:
    """The step, then every send finished; the iteration's events (pipeline, sync, sends) in
    its record.  Returns the events."""
    events = list(a.res.events) + step(node, st, a, t0)
    a.stepped = True
    node.tr.wait_sent(node.job.rt.timeout_s)
    events += node.tr.take_events()
    a.entry["events"] = [e.to_dict() for e in events]
    a.entry["t_end"] = max((e.end for e in events), default=0.0)
    a.entry["pipe_end"] = max((e.end for e in a.res.events), default=0.0)
    return events


def exchange(node, st: PhaseState, a: Attempt, t0: float) -> None:
    """The first half of the step (:func:`~skiptrain.runtime.step.exchange_stages`): every
    served stage's sync, held in ``a.exchanged`` until :func:`step` applies it.  In recovery mode
    the strategies' state is kept first (``a.sync_state``): a sync of an iteration that turns out
    not committed anywhere is rewound (:meth:`~.healing.Healer.rewind_sync`)."""
    model = st.model
    if model is None or a.exchanged is not None:
        return
    if st.ph.dump and st.it == 0:
        dump_gradients(node, st, a)
    node.healer.last_gnorm = stage_grad_norms(model, st.stages)   # CheckFree's weights
    node.ckpt.wait_snapshot()          # (an overlapped snapshot reads the strategies' state)
    a.sync_t0 = time.time() - t0
    hosted = [HostedStage(s, strat, a.res.processed.get(s, 0), len(st.sched.placement[s])) for s, strat in
              sorted(st.strats.items())]
    for h in hosted:                   # (a strategy with local steps syncs at the phase's end)
        h.sync.end_step = h.sync.step_count + st.ph.iterations - st.it
    if node.job.rt.recover:
        a.sync_state = {s: strat.state_dict() for s, strat in st.strats.items()}
    try:
        a.exchanged = exchange_stages(hosted, a.lr, node.cfg.train.grad_clip, node.control.sum_across,
                                      evidence=st.elastic is not None)
    except NonFiniteContribution as e:
        raise blame_sender(e, node.control.alive, node.rank) from e
    a.sync_t1 = time.time() - t0


def exchange_early(node, st: PhaseState, a: Attempt, t0: float) -> None:
    """:func:`exchange` now, right after this node's pipeline tasks and before the commit, where
    the strategy allows (:func:`~skiptrain.runtime.step.exchange_first`): each stage's sync then
    overlaps the backward passes still running elsewhere in the swarm."""
    if st.model is not None and exchange_first(st.strats.values()):
        node.control.sync_abandonable = True
        try:
            exchange(node, st, a, t0)
        finally:
            node.control.sync_abandonable = False


def step(node, st: PhaseState, a: Attempt, t0: float) -> list:
    """The one optimizer step for the stages ``node`` serves (their sync first, unless
    :func:`exchange_early` ran it); a node without a stage still takes part in the global clip's
    sum.  Returns the sync events for the timeline (one per served stage that has replicas)."""
    model, clip = st.model, node.cfg.train.grad_clip
    if model is None:
        a.outcome = optimizer_step([], None, a.lr, clip, node.control.sum_across)
        return []
    exchange(node, st, a, t0)
    a.outcome = apply_step(a.exchanged, st.opt, a.lr, clip, node.control.sum_across,
                           inspect=st.elastic.observe if st.elastic is not None else None)
    hosted = a.exchanged.hosted
    stats = [a.outcome.stats[h.stage] for h in hosted]
    a.entry["sync"] = {"payload": sum(x.payload_bytes for x in stats),
                       "received": sum(x.received_bytes for x in stats),
                       "comm_s": round(sum(x.comm_s for x in stats), 6), "synced": all(x.synced for x in stats),
                       "dense": sum(x.dense_fp32_bytes for h, x in zip(hosted, stats) if h.replicas > 1),
                       "n_total": sum(x.n_total for x in stats)}
    for p in model.parameters():
        p.grad = None
    return [Event(node.rank, "sync", None, h.stage, a.sync_t0, a.sync_t1, x.payload_bytes)
            for h, x in zip(hosted, stats) if h.replicas > 1]


def dump_gradients(node, st: PhaseState, a: Attempt) -> None:
    """The phase's ``dump``: the first iteration's pre-sync summed gradients of this node's stages."""
    torch.save({"n": a.res.n_processed, "stage": st.stage, "processed": a.res.processed,
                "grads": {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                          for n, p in st.model.named_parameters()}},
               st.out_dir / f"grads_node{node.rank}.pt")
