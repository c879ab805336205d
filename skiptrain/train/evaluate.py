"""Validation loss and perplexity, along the full route or with body stages removed."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ..data.loader import SampleSource
from ..model import StagedLM


@torch.no_grad()
def evaluate(model: StagedLM, source: SampleSource, batches: int, micro_batch: int,
             route: Sequence[int] | None = None) -> float:
    """Mean next-token loss over the first ``batches * micro_batch`` samples of ``source`` (in order)."""
    was_training = model.training
    model.eval()
    n = min(batches * micro_batch, source.n)
    total, count = 0.0, 0
    for start in range(0, n, micro_batch):
        idx = list(range(start, min(n, start + micro_batch)))
        x, y = source.batch(idx)
        _, loss = model(x, y, route=route)
        total += loss.item() * len(idx)
        count += len(idx)
    model.train(was_training)
    return total / count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def unigram_loss(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy of ``eval_tokens`` under the add-one-smoothed unigram distribution of the training text.

    The loss a model that ignores context would reach: training must go well below it.
    """
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(eval_tokens)].mean())
