"""AutoPipe: repartition the active layers and shrink the pipeline as the frozen prefix grows.

Units.  Compute is in forward-layer units per sample: an active layer costs ``1 + backward_factor``
(forward and backward; 2.5 with the cost model's 1.5), a frozen layer costs 1 (forward only,
no backward) times the fraction of samples the activation cache is expected to miss (0 when
every sample's prefix output is read from the cache).  Memory is in active-layer
units: a frozen layer costs ``frozen_memory`` (1/6: it keeps its weights but no activations for
the backward, no gradients and no optimizer state); stage 0 also holds the embedding and the
head (``stage0_memory`` layer units, derived from the parameter counts); the embedding freezes
with the first layer and then costs ``frozen_memory`` of its share (``embedding_memory``).
When the activation cache holds every training sample's prefix output (``prefix_cached``: it was
prefilled at the freeze) the frozen layers and the embedding never run in a step, so they cost
no device memory either: they stay in host memory for validation, checkpoints and an undo.

:func:`autopipe` implements the paper's rule:

* the frozen prefix stays on stage 0 (it needs the embedding and feeds the first active layer);
* the active layers are split by :func:`skiptrain.model.partition.best_partition` (min-max
  stage cost, then the most even), cuts only between layers, so never inside a residual block;
* the stage count is re-picked among the counts whose largest stage still fits the memory of
  the largest node at the start of training (its stage, or all the stages of a node that served
  several: ``start_groups``) (so the pipeline shrinks as frozen layers free
  memory, and grows back when an undo needs it): the fastest by a cost estimate wins, ties to
  the fewest stages.  The estimate is :func:`iteration_units` (the ``n_nodes`` nodes as
  ``n_nodes // S`` replicas, the global batch split over them, a 1F1B pipeline paced by its
  slowest stage) unless the caller profiles layouts itself (``seconds``: the bench uses the
  event simulator with measured costs).  The paper halves the count (its GPU counts are powers
  of two); trying every count also finds 3 -> 2 stages, and an estimate that knows the nodes
  avoids a count that leaves nodes idle or splits the batch unevenly.

An :class:`ElasticLayout` is one point of the layout history: frozen count, stage partition, stage
count, replicas per stage, micro-batches and node placement.  It is JSON for checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..config import ModelConfig
from ..layout import Layout
from ..model.partition import Partition, best_partition, head_flops_per_token, layer_bytes, layer_flops_per_token

FROZEN_MEMORY = 1 / 6
BACKWARD_FACTOR = 1.5


@dataclass
class ElasticLayout(Layout):
    """One point of the elastic run's layout history (see the module docstring): a
    :class:`~skiptrain.layout.Layout` plus its replicas per stage, micro-batches per iteration,
    whether the frozen prefix is served from the activation cache, and the first step trained
    under it.  Stage 0 holds the frozen prefix first."""
    replicas: int = 1
    n_micro: int = 1
    cached: bool = False
    step: int = 0

    @classmethod
    def of(cls, frozen: int, counts, replicas: int = 1, n_micro: int = 1, placement=None, cached: bool = False,
           step: int = 0) -> "ElasticLayout":
        return cls(Partition(tuple(int(c) for c in counts)), [list(p) for p in (placement or [])], int(frozen),
                   None, int(replicas), int(n_micro), bool(cached), int(step))

    @property
    def counts(self) -> list[int]:
        return list(self.partition.counts)

    def to_dict(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "counts": self.counts, "replicas": self.replicas, "n_micro": self.n_micro,
                "placement": self.placement, "cached": self.cached, "step": self.step}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ElasticLayout":
        return cls.of(d["frozen"], d["counts"], d["replicas"], d["n_micro"],
                      [[int(n) for n in p] for p in d["placement"]], d["cached"], d.get("step", 0))


def stage0_units(cfg: ModelConfig, backward_factor: float = BACKWARD_FACTOR) -> tuple[float, float]:
    """(compute, memory) of stage 0's embedding + final norm + head + loss, in layer units.

    The head trains throughout (forward and backward); its memory is counted as active."""
    compute = (1 + backward_factor) * head_flops_per_token(cfg) / layer_flops_per_token(cfg)
    emb_head_params = 2 * cfg.vocab_size * cfg.d_model + cfg.d_model
    memory = emb_head_params * 4 / layer_bytes(cfg)
    return compute, memory


def embedding_units(cfg: ModelConfig) -> float:
    """Memory of the token embedding in layer units: part of stage 0's, and frozen with the
    first frozen layer (so it then costs ``FROZEN_MEMORY`` of that, like a frozen layer)."""
    return cfg.vocab_size * cfg.d_model * 4 / layer_bytes(cfg)


def layer_compute(n_layers: int, frozen: int, cached: bool | float, backward_factor: float = BACKWARD_FACTOR
                  ) -> list[float]:
    """Per-layer compute: active 1 + bf, frozen 1 - hit (forward only, skipped when the cache hits).

    ``cached`` is the expected cache hit fraction of the frozen prefix (True = 1: every sample
    read from the cache, False = 0: recomputed), so a prefix that will mostly miss is not
    balanced as if it were free."""
    hit = min(max(float(cached), 0.0), 1.0)
    return [1.0 - hit if l < frozen else 1.0 + backward_factor for l in range(n_layers)]


def stage_memory(counts: Sequence[int], frozen: int, stage0_memory: float = 0.0,
                 frozen_memory: float = FROZEN_MEMORY, embedding_memory: float = 0.0,
                 prefix_cached: bool = False) -> list[float]:
    """Memory per stage in active-layer units (frozen layers at ``frozen_memory``).

    ``stage0_memory`` is stage 0's embedding + head + norm, of which ``embedding_memory`` is the
    embedding: once anything is frozen it is frozen too, and costs ``frozen_memory`` of that.
    ``prefix_cached``: every training sample's prefix output is in the activation cache, so the
    frozen layers and the embedding never run in a step and are not resident (0)."""
    out, start = [], 0
    gone = frozen > 0 and prefix_cached
    s0 = stage0_memory - (embedding_memory * (1 if gone else 1 - frozen_memory) if frozen > 0 else 0.0)
    per_frozen = 0.0 if gone else frozen_memory
    for s, c in enumerate(counts):
        n_frozen = max(0, min(c, frozen - start))
        out.append(n_frozen * per_frozen + (c - n_frozen) + (s0 if s == 0 else 0.0))
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


def stage_costs(counts: Sequence[int], frozen: int, cached: bool | float, stage0_compute: float = 0.0,
                backward_factor: float = BACKWARD_FACTOR) -> list[float]:
    """Compute per stage and sample in forward-layer units (stage 0 adds the head's)."""
    costs = layer_compute(sum(counts), frozen, cached, backward_factor)
    out, i = [], 0
    for s, c in enumerate(counts):
        out.append(sum(costs[i:i + c]) + (stage0_compute if s == 0 else 0.0))
        i += c
    return out


def iteration_units(stage_cost: Sequence[float], n_nodes: int, global_batch: int, n_micro: int) -> float:
    """Estimated iteration time (forward-layer units) of a layout on ``n_nodes`` nodes.

    ``S = len(stage_cost)`` stages, ``R = n_nodes // S`` replicas each (the rest idle); a replica
    gets ``ceil(global_batch / R)`` samples in ``M = min(n_micro, samples)`` micro-batches, and a
    1F1B pipeline takes ``M + S - 1`` micro-batch slots of its slowest stage."""
    S = len(stage_cost)
    R = n_nodes // S
    if R < 1:
        return math.inf
    n = math.ceil(global_batch / R)
    M = max(1, min(n_micro, n))
    return (M + S - 1) * math.ceil(n / M) * max(stage_cost)


def neighbour_splits(counts: Sequence[int], frozen: int) -> list[list[int]]:
    """``counts`` with one cut moved by one layer, keeping the frozen prefix on stage 0 and a
    layer on every body stage."""
    out = []
    for k in range(len(counts) - 1):
        for d in (-1, 1):
            c = list(counts)
            c[k] += d
            c[k + 1] -= d
            if c[0] >= frozen and all(x >= 1 for x in c[1:]):
                out.append(c)
    return out


def autopipe(n_layers: int, frozen: int, start_stages: int, current_stages: int, cached: bool | float,
             stage0_compute: float = 0.0, stage0_memory: float = 0.0,
             backward_factor: float = BACKWARD_FACTOR, *, embedding_memory: float = 0.0,
             prefix_cached: bool = False, n_nodes: int | None = None,
             global_batch: int | None = None, n_micro: int = 1,
             seconds: Callable[[list[int]], float] | None = None,
             start_groups: Sequence[Sequence[int]] | None = None) -> tuple[list[int], dict[str, Any]]:
    """(layers per stage, evidence): repartition and re-pick the stage count (module docstring).

    The memory budget is the largest node's of the all-active partition with ``start_stages``:
    its largest stage, or with ``start_groups`` (the stages each node served at the start, some
    serving several) the most any node held.
    Candidates are the counts ``1 .. min(start_stages, active layers + 1, n_nodes)`` that fit it,
    each count's balanced split (and, with ``start_groups``, the start's own grouping: each node's
    stages as one); each is scored by ``seconds(counts)`` when given (then each balanced split's
    :func:`neighbour_splits` are profiled too), else by :func:`iteration_units` on ``n_nodes``
    nodes (default: ``current_stages``, one node per current stage) with ``global_batch``
    (default: one sample per node) split into at most ``n_micro`` micro-batches.  When none fits
    (nodes were lost), the one needing the least memory (``over_budget`` in the evidence).
    """
    start = split(n_layers, 0, start_stages, False, stage0_compute, backward_factor)
    per_stage = stage_memory(start, 0, stage0_memory)
    groups = [list(g) for g in start_groups] if start_groups else [[s] for s in range(start_stages)]
    budget = max(sum(per_stage[s] for s in g) for g in groups)
    merged = [sum(start[s] for s in g) for g in sorted(groups)] if start_groups else None
    nodes = n_nodes or current_stages
    batch = global_batch or nodes
    # body stages need an active layer each: too few active layers force a smaller count; a
    # stage needs a node of its own
    top = max(1, min(start_stages, n_layers - frozen + 1, n_nodes or start_stages))
    tried = []
    for S in range(top, 0, -1):
        balanced = split(n_layers, frozen, S, cached, stage0_compute, backward_factor)
        # a profile also tries moving each cut by one layer: the unit cost model does not see
        # everything (stage 0 originates every micro-batch; links differ)
        cands = [balanced] + (neighbour_splits(balanced, frozen) if seconds is not None else [])
        if merged is not None and len(merged) == S and merged not in cands and merged[0] >= frozen \
                and all(c >= 1 for c in merged[1:]):
            cands.append(merged)
        for cand in cands:
            mem = max(stage_memory(cand, frozen, stage0_memory, embedding_memory=embedding_memory,
                                   prefix_cached=prefix_cached))
            fits = mem <= budget + 1e-9
            est = None
            if fits:
                est = (seconds(cand) if seconds is not None else
                       iteration_units(stage_costs(cand, frozen, cached, stage0_compute, backward_factor),
                                       nodes, batch, n_micro))
            tried.append({"stages": S, "counts": cand, "max_memory": round(mem, 4), "fits": fits,
                          "estimate": None if est is None else round(est, 6)})
    ok = [t for t in tried if t["fits"] and math.isfinite(t["estimate"])]
    # the fastest; within 0.1% of it, the fewest stages (more replicas, fewer hops)
    if ok:
        best = min(t["estimate"] for t in ok)
        counts = min((t for t in ok if t["estimate"] <= best * 1.001 + 1e-12), key=lambda t: t["stages"])["counts"]
    else:  # nothing fits (fewer nodes than the start's): the least memory
        counts = min(tried, key=lambda t: (t["max_memory"], t["stages"]))["counts"]
    stage_cost = [round(c, 4) for c in stage_costs(counts, frozen, cached, stage0_compute, backward_factor)]
    evidence = {"memory_budget": round(budget, 4), "tried": tried, "stage_cost": stage_cost,
                "prefix_cached": prefix_cached, **({} if ok else {"over_budget": True}),
                "stage_memory": [round(m, 4) for m in stage_memory(counts, frozen, stage0_memory,
                                                                    embedding_memory=embedding_memory,
                                                                    prefix_cached=prefix_cached)]}
    return counts, evidence


def autopipe_for(cfg: ModelConfig, frozen: int, start_stages: int, current_stages: int, cached: bool | float,
                 n_nodes: int | None = None, global_batch: int | None = None, n_micro: int = 1,
                 prefix_cached: bool = False, start_groups: Sequence[Sequence[int]] | None = None
                 ) -> tuple[list[int], dict[str, Any]]:
    """:func:`autopipe` with stage 0's extra compute and memory taken from ``cfg``."""
    c0, m0 = stage0_units(cfg)
    return autopipe(cfg.n_layers, frozen, start_stages, current_stages, cached, c0, m0,
                    embedding_memory=embedding_units(cfg), prefix_cached=prefix_cached, n_nodes=n_nodes,
                    global_batch=global_batch, n_micro=n_micro, start_groups=start_groups)
