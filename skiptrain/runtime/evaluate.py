"""Validation loss of a model (or the stages a process holds), along the full route or a given one."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..data.loader import SampleSource
from ..model import StagedLM


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
