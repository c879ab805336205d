"""THE optimizer step: every way of training updates its parameters here.

After the forward and backward passes of an iteration (along whatever routes), each stage a
process hosts holds in ``param.grad`` the **sum** of the gradients of the micro-batches it
processed.  :func:`optimizer_step` then, in this order:

1. per hosted stage, the stage's data-parallel sync (:meth:`SyncStrategy.exchange
   <skiptrain.dp.strategy.SyncStrategy.exchange>`) turns the sums into the optimizer's input:
   the mean over every micro-batch that visited the stage, across its replicas (or, for DeMo,
   a direction);
2. **one global gradient-norm clip** (``train.grad_clip``): each stage's squared norm is divided
   by its replica count, summed over the stages this process hosts, and summed across the swarm
   by ``sum_across`` (an all-reduce over every node, once per iteration; identity in one
   process), so every stage of the model counts once and every node scales by the same factor.
   Strategies with ``clip_local`` (DeMo) are clipped the same way before the exchange instead,
   on their local mean gradients;
3. one optimizer step (:mod:`skiptrain.optim`) at the scheduled learning rate;
4. per hosted stage, the strategy's post-step (DiLoCo's outer step), consistency check and byte
   accounting.  ``param.grad`` then holds what the optimizer applied (the synced, clipped
   update; None where nothing was applied) until the caller clears it before the next backward.

So the single-process trainer (one node hosting every stage, groups of one) and a swarm of node
processes run the same arithmetic: with the same routes they produce the same parameters.

The step comes in two halves, :func:`exchange_stages` (1, and 2 before it for ``clip_local``)
and :func:`apply_step` (2-4): a swarm node runs the first as soon as its own pipeline tasks are
done, so each stage's sync overlaps the rest of the swarm's backward passes
(:func:`exchange_first`), and the second after the iteration's commit.

Failure semantics: an error inside a sync (a peer's bad payload, a dead peer) propagates before
the optimizer has touched any parameter; ``sum_across`` failing likewise.  Nothing is retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..dp.strategy import SyncStats, SyncStrategy
from ..optim import clip_coefficient, set_lr, squared_norm


@dataclass
class HostedStage:
    """One stage held by this process: its sync strategy (which knows the parameters), the
    micro-batches it processed this iteration, and how many replicas the stage has in all."""
    stage: int
    sync: SyncStrategy
    n_processed: int
    replicas: int = 1


@dataclass
class StepOutcome:
    grad_norm: float                    # global norm before the clip (of what was clipped)
    clip_coef: float                    # the factor applied (1.0: no clip)
    stats: dict[int, SyncStats]         # per hosted stage


def _local_norm_sq(tensors_by_stage: list[tuple[HostedStage, dict | None]]) -> float:
    return sum(squared_norm(t.values()) / max(h.replicas, 1) for h, t in tensors_by_stage if t)


def _scale(tensors: dict | None, coef: float) -> None:
    if tensors and coef < 1.0:
        for t in tensors.values():
            t.mul_(coef)


@dataclass
class Exchanged:
    """The first half of a step (:func:`exchange_stages`): every hosted stage's sync done, the
    optimizer not yet touched.  ``updates`` pairs each stage with its strategy's output; for a
    ``clip_local`` strategy ``coef`` and ``norm`` are the clip already applied before it."""
    hosted: list[HostedStage]
    updates: list[tuple[HostedStage, dict | None]]
    evidence: dict[str, torch.Tensor]
    pre: bool
    coef: float = 1.0
    norm: float = 0.0
    applied: bool = False       # the optimizer stepped on it (set by apply_step)


def exchange_first(syncs) -> bool:
    """Whether the sync strategies ``syncs`` may exchange before every node of the swarm is done
    with the iteration's pipeline (none ``clip_local``: its exchange needs the global norm first)."""
    return not any(x.clip_local for x in syncs)


def exchange_stages(hosted: list[HostedStage], lr: float, max_norm: float,
                    sum_across: Callable[[float], float] = lambda x: x, evidence: bool = False) -> Exchanged:
    """The first half of :func:`optimizer_step`: per hosted stage the sync (after the global clip
    of the local gradients for a ``clip_local`` strategy, whose ``sum_across`` is then this
    half's collective).  ``evidence``: keep the replica's own mean gradients of a stage whose
    update is a direction, for ``inspect``.  Nothing of the optimizer or the parameters changes."""
    local = [(h, h.sync.local_grads()) for h in hosted]
    # a direction (DeMo's signs) says nothing about how fast a layer still learns: ``inspect``
    # sees this replica's mean gradients of such a stage instead (copies: the exchange may
    # modify the gradients)
    kept = {n: t / max(h.n_processed, 1) for h, g in local if evidence
            and h.sync.update_rule == "direction" for n, t in g.items()}
    ex = Exchanged(hosted, [], kept, pre=not exchange_first(h.sync for h in hosted))
    if ex.pre:                  # clip the local mean gradients (the sums scale alike)
        sq = sum(squared_norm(g.values()) / max(h.n_processed, 1) ** 2 / max(h.replicas, 1)
                 for h, g in local if h.n_processed)
        ex.norm = sum_across(sq) ** 0.5
        ex.coef = clip_coefficient(ex.norm ** 2, max_norm)
        for _, g in local:
            _scale(g, ex.coef)
    ex.updates = [(h, h.sync.exchange(g, h.n_processed, lr)) for h, g in local]
    return ex


def apply_step(ex: Exchanged, optimizer: torch.optim.Optimizer, lr: float, max_norm: float,
               sum_across: Callable[[float], float] = lambda x: x,
               inspect: Callable[[dict[str, torch.Tensor]], None] | None = None) -> StepOutcome:
    """The second half of :func:`optimizer_step`: ``inspect``, the global clip of the synced
    updates (``sum_across``: this half's collective, unless the clip came before the exchange),
    the one optimizer step, and every strategy's post-step."""
    updates = ex.updates
    if inspect is not None:
        inspect({**{n: t for _, u in updates if u for n, t in u.items()}, **ex.evidence})
    coef, norm = ex.coef, ex.norm
    if not ex.pre:
        norm = sum_across(_local_norm_sq(updates)) ** 0.5
        coef = clip_coefficient(norm ** 2, max_norm)
        for _, u in updates:
            _scale(u, coef)
    for h, u in updates:
        for name, p in h.sync.named:
            p.grad = None if u is None else u[name].to(p.dtype)
    if optimizer is not None:
        set_lr(optimizer, lr)
        optimizer.step()
    ex.applied = True
    stats = {h.stage: h.sync.after_update(lr) for h in ex.hosted}
    return StepOutcome(norm, coef, stats)


def optimizer_step(hosted: list[HostedStage], optimizer: torch.optim.Optimizer, lr: float, max_norm: float,
                   sum_across: Callable[[float], float] = lambda x: x,
                   inspect: Callable[[dict[str, torch.Tensor]], None] | None = None) -> StepOutcome:
    """Sync, clip globally, step ``optimizer`` once, finish the syncs (see the module doc):
    :func:`exchange_stages` then :func:`apply_step`.

    Every process of a swarm must call it once per iteration (``sum_across`` is a collective),
    also one that hosts no stage (``hosted`` empty): it then only takes part in the sum.
    ``inspect`` sees the synced, not yet clipped updates of every hosted stage by name (the
    freeze rule reads per-layer gradient norms there); for a strategy whose update is a
    direction (DeMo: signs of equal norm whatever the layer's state) the replica's own mean
    gradients, not clipped.
    """
    ex = exchange_stages(hosted, lr, max_norm, sum_across, evidence=inspect is not None)
    return apply_step(ex, optimizer, lr, max_norm, sum_across, inspect)
