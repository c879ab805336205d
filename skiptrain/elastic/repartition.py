"""AutoPipe: repartition the active layers and shrink the pipeline as the frozen prefix grows.

Units.  Compute is in forward-layer units per sample: an active layer costs ``1 + backward_factor``
(forward and backward; 2.5 with the cost model's 1.5), a frozen layer costs 1 (forward only,
no backward) times the fraction of samples the activation cache is expected to miss (0 when
every sample's prefix output is read from the cache).  Memory is in active-layer
units: a frozen layer costs ``frozen_memory`` (1/6: it keeps its weights but no activations for
the backward, no gradients and no optimizer state); stage 0 also holds the embedding and the
head (``stage0_memory`` layer units, derived from the parameter counts).

:func:`autopipe` implements the paper's rule:

* the frozen prefix stays on stage 0 (it needs the embedding and feeds the first active layer);
* the active layers are split by :func:`skiptrain.model.partition.best_partition` (min-max
  stage cost, then the most even), cuts only between layers, so never inside a residual block;
* starting from the current stage count, the count is halved while the largest stage of the
  new partition still fits the memory of the largest stage at the start of training.

A :class:`Layout` is one point of the layout history: frozen count, stage partition, stage
count, replicas per stage, micro-batches and node placement.  It is JSON for checkpoints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..config import ModelConfig
from ..model.partition import Partition, best_partition, head_flops_per_token, layer_bytes, layer_flops_per_token

FROZEN_MEMORY = 1 / 6
BACKWARD_FACTOR = 1.5


@dataclass
class Layout:
    """One layout of the elastic run (see the module docstring)."""
    frozen: int
    counts: list[int]                 # layers per stage; stage 0 holds the frozen prefix first
    replicas: int = 1                 # nodes per stage
    n_micro: int = 1
    placement: list[list[int]] = field(default_factory=list)   # stage -> node ids
    cached: bool = False
    step: int = 0                     # first step trained under this layout

    @property
    def n_stages(self) -> int:
        return len(self.counts)

    @property
    def partition(self) -> Partition:
        return Partition(tuple(self.counts))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Layout":
        return cls(frozen=int(d["frozen"]), counts=[int(c) for c in d["counts"]], replicas=int(d["replicas"]),
                   n_micro=int(d["n_micro"]), placement=[[int(n) for n in p] for p in d["placement"]],
                   cached=bool(d["cached"]), step=int(d.get("step", 0)))


def stage0_units(cfg: ModelConfig, backward_factor: float = BACKWARD_FACTOR) -> tuple[float, float]:
    """(compute, memory) of stage 0's embedding + final norm + head + loss, in layer units.

    The head trains throughout (forward and backward); its memory is counted as active."""
    compute = (1 + backward_factor) * head_flops_per_token(cfg) / layer_flops_per_token(cfg)
    emb_head_params = 2 * cfg.vocab_size * cfg.d_model + cfg.d_model
    memory = emb_head_params * 4 / layer_bytes(cfg)
    return compute, memory


def layer_compute(n_layers: int, frozen: int, cached: bool | float, backward_factor: float = BACKWARD_FACTOR
                  ) -> list[float]:
    """Per-layer compute: active 1 + bf, frozen 1 - hit (forward only, skipped when the cache hits).

    ``cached`` is the expected cache hit fraction of the frozen prefix (True = 1: every sample
    read from the cache, False = 0: recomputed), so a prefix that will mostly miss is not
    balanced as if it were free."""
    hit = min(max(float(cached), 0.0), 1.0)
    return [1.0 - hit if l < frozen else 1.0 + backward_factor for l in range(n_layers)]


def stage_memory(counts: Sequence[int], frozen: int, stage0_memory: float = 0.0,
                 frozen_memory: float = FROZEN_MEMORY) -> list[float]:
    """Memory per stage in active-layer units (frozen layers at ``frozen_memory``)."""
    out, start = [], 0
    for s, c in enumerate(counts):
        n_frozen = max(0, min(c, frozen - start))
        out.append(n_frozen * frozen_memory + (c - n_frozen) + (stage0_memory if s == 0 else 0.0))
        start += c
    return out


def split(n_layers: int, frozen: int, n_stages: int, cached: bool | float, stage0_compute: float,
          backward_factor: float = BACKWARD_FACTOR) -> list[int]:
    """Layers per stage: the frozen prefix on stage 0, active layers split by the cost model."""
    active = n_layers - frozen
    costs = layer_compute(n_layers, frozen, cached, backward_factor)
    extra = stage0_compute + sum(costs[:frozen])
    p = best_partition(costs[frozen:], n_stages, stage0_extra=extra)
    counts = list(p.counts)
    counts[0] += frozen
    assert sum(counts) == n_layers and active >= n_stages - 1
    return counts


def autopipe(n_layers: int, frozen: int, start_stages: int, current_stages: int, cached: bool | float,
             stage0_compute: float = 0.0, stage0_memory: float = 0.0,
             backward_factor: float = BACKWARD_FACTOR) -> tuple[list[int], dict[str, Any]]:
    """(layers per stage, evidence): repartition, halving the stage count while memory allows.

    The memory budget is the largest stage of the all-active partition with ``start_stages``.
    """
    start = split(n_layers, 0, start_stages, False, stage0_compute, backward_factor)
    budget = max(stage_memory(start, 0, stage0_memory))
    # body stages need an active layer each: too few active layers force a smaller count
    S = min(current_stages, n_layers - frozen + 1)
    counts = split(n_layers, frozen, S, cached, stage0_compute, backward_factor)
    tried = []
    while S > 1:
        S2 = S // 2
        if n_layers - frozen < S2 - 1:
            break
        cand = split(n_layers, frozen, S2, cached, stage0_compute, backward_factor)
        mem = max(stage_memory(cand, frozen, stage0_memory))
        tried.append({"stages": S2, "counts": cand, "max_memory": round(mem, 4)})
        if mem > budget + 1e-9:
            break
        counts, S = cand, S2
    costs = layer_compute(n_layers, frozen, cached, backward_factor)
    stage_cost, i = [], 0
    for s, c in enumerate(counts):
        stage_cost.append(round(sum(costs[i:i + c]) + (stage0_compute if s == 0 else 0.0), 4))
        i += c
    evidence = {"memory_budget": round(budget, 4), "tried": tried, "stage_cost": stage_cost,
                "stage_memory": [round(m, 4) for m in stage_memory(counts, frozen, stage0_memory)]}
    return counts, evidence


def autopipe_for(cfg: ModelConfig, frozen: int, start_stages: int, current_stages: int, cached: bool | float,
                 ) -> tuple[list[int], dict[str, Any]]:
    """:func:`autopipe` with stage 0's extra compute and memory taken from ``cfg``."""
    c0, m0 = stage0_units(cfg)
    return autopipe(cfg.n_layers, frozen, start_stages, current_stages, cached, c0, m0)
