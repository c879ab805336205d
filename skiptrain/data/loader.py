"""Samples by global index: deterministic, resumable, shardable over any number of replicas.

A *sample* is a window of ``seq_len + 1`` tokens (inputs and shifted targets).  The split is cut
into ``n = (len - 1) // seq_len`` non-overlapping windows; global sample index ``g`` maps to
window ``perm_e[g mod n]`` of epoch ``e = g // n``, where ``perm_e`` is a permutation seeded by
``(seed, e)``.  So the whole data order is a pure function of (data, seq_len, seed), and the
only state a run must keep is the **cursor**: the global index of the next sample.

Sharding: an iteration consumes global indices ``[cursor, cursor + global_batch)``; replica ``r``
of ``R`` takes those ``i`` with ``(i - cursor) % R == r``.  Changing ``R`` between iterations (a
node joins or leaves, a checkpoint is loaded under another layout) never repeats or skips a
sample, because the cursor is global.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..errors import DataError


class SampleSource:
    """Fixed-length windows over one token array, in a seeded per-epoch order."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True, name: str = "split"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"{name} has {len(tokens)} tokens, fewer than one sample of {seq_len + 1}; "
                            "use more text or a shorter model.seq_len")
        self._perm = lru_cache(maxsize=2)(self._make_perm)

    def _make_perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def window(self, g: int) -> int:
        epoch, pos = divmod(int(g), self.n)
        return int(self._perm(epoch)[pos]) if self.shuffle else pos

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (len(indices), seq_len), int64."""
        return self.window_batch([self.window(g) for g in indices])

    def window_batch(self, windows) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows with these ids (not global sample indices)."""
        t = self.seq_len
        rows = np.stack([np.asarray(self.tokens[w * t: w * t + t + 1], dtype=np.int64) for w in windows])
        x = torch.from_numpy(rows)
        return x[:, :-1], x[:, 1:]


def shard_indices(cursor: int, global_batch: int, rank: int = 0, world: int = 1) -> list[int]:
    """Global sample indices of replica ``rank`` of ``world`` for the batch starting at ``cursor``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    return [cursor + i for i in range(rank, global_batch, world)]


class ShardedLoader:
    """Hands replica ``rank`` its share of each global batch; the cursor is the whole state."""

    def __init__(self, source: SampleSource, global_batch: int, rank: int = 0, world: int = 1,
                 cursor: int = 0):
        self.source = source
        self.global_batch = global_batch
        self.rank, self.world = rank, world
        self.cursor = cursor

    def indices(self) -> list[int]:
        return shard_indices(self.cursor, self.global_batch, self.rank, self.world)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.batch(self.indices())
        self.cursor += self.global_batch
        return x, y

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "global_batch": self.global_batch, "seed": self.source.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.source.seed) != self.source.seed:
            raise DataError(f"loader state was saved with data seed {state['seed']}, "
                            f"this run uses {self.source.seed}; resume with the same train.seed")
        self.cursor = int(state["cursor"])
