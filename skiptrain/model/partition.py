"""Split the layers of a decoder into pipeline stages by a cost model.

Layers are the unit: a cut always falls between two layers, never inside a residual block.
Stage 0 holds the embedding and the LM head + loss besides its layers, so it needs fewer layers
than a body stage to cost the same.  :func:`partition_layers` minimises the cost of the most
expensive stage (the pipeline's bottleneck) by dynamic programming over contiguous splits, and
among equally good splits prefers the most even one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config import ModelConfig


@dataclass(frozen=True)
class Partition:
    """``counts[s]`` layers in stage ``s``; stages hold consecutive layers in stage order."""

    counts: tuple[int, ...]

    @property
    def n_stages(self) -> int:
        return len(self.counts)

    @property
    def n_layers(self) -> int:
        return sum(self.counts)

    def layers(self, stage: int) -> range:
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def stage_of_layer(self, layer: int) -> int:
        end = 0
        for s, c in enumerate(self.counts):   # a stage of 0 layers holds none
            end += c
            if 0 <= layer < end:
                return s
        raise IndexError(f"layer {layer} is not in this partition ({self.n_layers} layers)")

    def to_list(self) -> list[int]:
        return list(self.counts)


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one transformer layer (matmuls and causal attention)."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    proj = 2 * (d * d + 2 * d * kv + d * d)
    attn = 2 * cfg.seq_len * d  # QK^T and AV, halved by the causal mask
    ffn = 2 * 3 * d * cfg.hidden
    return float(proj + attn + ffn)


def head_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of stage 0's extra work: final norm, LM head and the loss."""
    return float(2 * cfg.d_model * cfg.vocab_size + 5 * cfg.vocab_size)


def layer_bytes(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Parameter bytes of one layer (optimizer state and gradients scale with it)."""
    d, kv, h = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.hidden
    return dtype_bytes * (2 * d * d + 2 * d * kv + 3 * d * h + 2 * d)


def best_partition(layer_costs: Sequence[float], n_stages: int, stage0_extra: float = 0.0,
                   stage0_layers: int | None = None) -> Partition:
    """Contiguous split minimising (max stage cost, sum of squared stage costs).

    Body stages get at least one layer; stage 0 may get none (it still runs embedding and head).
    ``stage0_layers`` pins stage 0's layer count.
    """
    n = len(layer_costs)
    if n_stages < 1:
        raise ValueError("need at least one stage")
    if n_stages == 1:
        return Partition((n,))
    if n < n_stages - 1:
        raise ValueError(f"{n} layers cannot fill {n_stages - 1} body stages")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def seg(a: int, b: int) -> float:
        return prefix[b] - prefix[a]

    inf = (float("inf"), float("inf"))
    # best[s][j]: best (max, sumsq, counts) for body stages 1..s covering layers [n0, j) ... built
    # from the end: tail[k][i] = best split of layers [i, n) into k body stages.
    tail: list[dict[int, tuple[float, float, tuple[int, ...]]]] = [dict() for _ in range(n_stages)]
    tail[0][n] = (0.0, 0.0, ())
    for k in range(1, n_stages):
        for i in range(n - k, -1, -1):
            best = None
            for j in range(i + 1, n - (k - 1) + 1):
                if j not in tail[k - 1]:
                    continue
                mx, sq, cnt = tail[k - 1][j]
                c = seg(i, j)
                cand = (max(mx, c), sq + c * c, (j - i,) + cnt)
                if best is None or cand[:2] < best[:2]:
                    best = cand
            if best is not None:
                tail[k][i] = best
    best_total = None
    choices = range(0, n - (n_stages - 1) + 1) if stage0_layers is None else [stage0_layers]
    for n0 in choices:
        if n0 not in tail[n_stages - 1]:
            continue
        mx, sq, cnt = tail[n_stages - 1][n0]
        c0 = stage0_extra + seg(0, n0)
        cand = (max(mx, c0), sq + c0 * c0, (n0,) + cnt)
        if best_total is None or cand[:2] < best_total[:2]:
            best_total = cand
    if best_total is None or best_total[:2] == inf:
        raise ValueError(f"no valid partition of {n} layers into {n_stages} stages "
                         f"with stage0_layers={stage0_layers}")
    return Partition(best_total[2])


def partition_layers(cfg: ModelConfig) -> Partition:
    """The partition for ``cfg``: by FLOPs, stage 0 charged for its head and loss."""
    per_layer = layer_flops_per_token(cfg)
    pinned = None if cfg.stage0_layers < 0 else cfg.stage0_layers
    return best_partition([per_layer] * cfg.n_layers, cfg.n_stages,
                          stage0_extra=head_flops_per_token(cfg), stage0_layers=pinned)
