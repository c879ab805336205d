"""Perplexity and the unigram baseline loss (validation itself: :mod:`skiptrain.runtime.evaluate`)."""

from __future__ import annotations

import math
import numpy as np


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def unigram_loss(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy of ``eval_tokens`` under the add-one-smoothed unigram distribution of the training text.

    The loss a model that ignores context would reach: training must go well below it.
    """
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(eval_tokens)].mean())
