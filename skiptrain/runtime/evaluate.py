"""Validation loss of a model (or the stages a process holds), along the full route or a given
one; in a swarm, through the pipeline of the nodes that hold the stages."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ..data.loader import SampleSource
from ..model import StagedLM

EVAL_TAG = 14          # activations of an in-loop validation pass (the guard uses 13, state moves 11, 12)


@torch.no_grad()
def evaluate_sum(model: StagedLM, source: SampleSource, micro_batches: Iterable[int], micro_batch: int,
                 route: Sequence[int] | None = None) -> tuple[float, int]:
    """(sum of per-sample mean losses, samples) over the fixed validation micro-batches
    ``micro_batches`` (micro-batch ``i`` = samples ``i * micro_batch ...`` of ``source``, in order);
    the pieces of :func:`evaluate`, for a swarm that splits the micro-batches over its nodes."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for i in micro_batches:
        idx = list(range(i * micro_batch, min(source.n, (i + 1) * micro_batch)))
        if not idx:
            continue
        x, y = source.batch(idx)
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y, route=route)
        total += loss.item() * len(idx)
        count += len(idx)
    model.train(was_training)
    return total, count


def evaluate(model: StagedLM, source: SampleSource, batches: int, micro_batch: int,
             route: Sequence[int] | None = None) -> float:
    """Mean next-token loss over the first ``batches * micro_batch`` samples of ``source`` (in order)."""
    total, count = evaluate_sum(model, source, range(batches), micro_batch, route)
    return total / count


def validation_path(placement: Sequence[Sequence[int]], batch: int) -> list[int]:
    """The nodes validation micro-batch ``batch`` visits: replica ``batch mod R_s`` of each stage
    ``s`` in order (stage 0 first; it also computes the loss)."""
    return [p[batch % len(p)] for p in placement]


@torch.no_grad()
def pipelined_evaluate_sum(model: StagedLM | None, rank: int, placement: Sequence[Sequence[int]],
                           source: SampleSource, micro_batches: Iterable[int], micro_batch: int,
                           send: Callable[[torch.Tensor, int], None],
                           recv: Callable[[tuple[int, ...], int], torch.Tensor]) -> tuple[float, int]:
    """This node's part of the validation of fixed micro-batches ``micro_batches`` through the
    stages of ``placement`` (every node of the swarm calls it with the same arguments): micro-batch
    ``b`` runs along :func:`validation_path`; a node runs the stages it holds on that path, hands
    the activations to the next node with ``send(h, node)`` (``recv(shape, node)`` on the other
    side; a node holding the next stage too keeps them), and the path's stage-0 node adds the
    loss.  Returns (sum of per-sample mean losses, samples) of the micro-batches this node
    finished; the caller sums them over the swarm.  One stage: each micro-batch on one node."""
    total, count, S = 0.0, 0, len(placement)
    if model is None:
        return total, count
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    for b in micro_batches:
        idx = list(range(b * micro_batch, min(source.n, (b + 1) * micro_batch)))
        path = validation_path(placement, b)
        if not idx or rank not in path:
            continue
        shape = (len(idx), source.seq_len, model.cfg.d_model)
        h = y = None
        for i, node in enumerate(path):
            if node != rank:
                continue
            if i == 0:
                x, y = source.batch(idx)
                h = model.embed(x.to(device))
            else:
                h = model.run_stage(i, recv(shape, path[i - 1]).to(device) if h is None else h)
            if path[(i + 1) % S] != rank:
                send(h.float().cpu(), path[(i + 1) % S])
                h = None
        if path[0] == rank:
            h = recv(shape, path[-1]).to(device) if h is None else h
            total += model.loss(model.logits(h), y.to(device)).item() * len(idx)
            count += len(idx)
    model.train(was_training)
    return total, count


def validate_in_loop(node, st) -> None:
    """Validation inside the loop, every ``train.eval_every`` iterations and after the last:
    the fixed ``train.eval_batches`` validation micro-batches through the layout in force
    (:func:`~skiptrain.runtime.evaluate.pipelined_evaluate_sum`: with one stage each node
    validates its share; through a pipeline each micro-batch visits one replica of every
    stage), summed over the swarm; rank 0 writes the ``val_loss`` line with the seconds it
    took.  A layout with a stage left without a node is not validated."""
    t, n_it = node.cfg.train, st.it + 1
    if not (n_it == st.ph.iterations or (t.eval_every and n_it % t.eval_every == 0)):
        return
    if any(not p for p in st.sched.placement):
        return
    from ..model.device import autocast
    from .transition import Activations

    t0 = time.perf_counter()
    p2p = Activations(node.control.rank_of, EVAL_TAG, node.control.check_generation)
    with autocast(node.device, t.precision):
        part = pipelined_evaluate_sum(st.model, node.rank, st.sched.placement, node.val_src,
                                      range(t.eval_batches), t.micro_batch, p2p.send, p2p.recv)
    tot = torch.tensor(part, dtype=torch.float64)
    node.control.sync(dist.all_reduce, tot)
    if node.control.is_root():
        row = {"phase": st.ph.name, "step": n_it, "time": round(time.time(), 3),
               "tokens": n_it * st.gb * node.cfg.model.seq_len,
               "val_loss": round(float(tot[0] / max(tot[1], 1)), 5),
               "seconds": round(time.perf_counter() - t0, 4)}
        node.report.write_row(row)
