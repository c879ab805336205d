"""Elastic freezing's decisions, made the same way wherever a run freezes: on every node of a
swarm (:mod:`skiptrain.runtime.freezing`; a one-process run is a swarm of one node serving every
stage) and in the elastic bench's one-process harness, which plans for emulated nodes.

:class:`Freezer` feeds the freeze rule (:mod:`.freeze`) each step's per-layer norms of the synced
update and, at the end of a window, asks it for the frozen depth (its guard given the validation
loss the caller measures, its clock the learning rate summed so far); :func:`plan_layout` turns
a new depth into the next layout (AutoPipe, then AutoDP) and :func:`layout_routes` draws the
routes through it; :func:`stage0_forward` and
:func:`prefix_input` are what stage 0 runs once a prefix is frozen.  How a layout is then put in
force is the caller's: a swarm moves state between nodes by name; the bench's harness
re-partitions its own model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..model.partition import Partition
from ..optim import lr_clock
from ..schedule.routes import balanced_routes, full_route
from .freeze import Decision, FreezeRule
from .repartition import ElasticLayout, autopipe_for
from .replicas import assign_nodes


def layer_sq_norms(updates: Mapping[str, torch.Tensor]) -> dict[int, float]:
    """Per layer, the squared norm of its parameters' updates (by global parameter name)."""
    sq: dict[int, float] = {}
    for n, g in updates.items():
        if n.startswith("layers."):
            layer = int(n.split(".", 2)[1])
            sq[layer] = sq.get(layer, 0.0) + float(torch.linalg.vector_norm(g)) ** 2
    return sq


class Freezer:
    """The freeze rule of a run's config, fed and asked the same way by every caller."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.rule = FreezeRule.from_config(cfg.model.n_layers, cfg.elastic, cfg.train.warmup_steps)

    def observe(self, sq: Mapping[int, float], frozen: int) -> None:
        """One step's squared per-layer norms (:func:`layer_sq_norms`, summed over the stages);
        the rule sees the active layers' norms in layer order."""
        self.rule.observe({l: v ** 0.5 for l, v in sorted(sq.items()) if l >= frozen})

    def decide(self, step: int, guard: Callable[[], float] | None) -> Decision | None:
        """At the end of a window (``step`` steps done), the rule's decision; ``guard`` measures
        the validation loss when the rule asks for it (``elastic.guard``; None: it cannot be
        measured now, and the rule decides without it).  None mid-window."""
        if not self.rule.window_done(step):
            return None
        return self.rule.decide(step, val_loss=guard if self.cfg.elastic.guard else None,
                                clock=lr_clock(step, self.cfg.train))


def plan_layout(model_cfg, frozen: int, counts: list[int], placement: list[list[int]], alive: list[int],
                sizes: dict[str, int], start_stages: int, global_batch: int, n_micro: int, step: int,
                hit: float = 0.0, prefix_cached: bool = False, cached: bool | None = None,
                start_groups: list[list[int]] | None = None) -> tuple[ElasticLayout, dict[str, Any]]:
    """The layout for ``frozen`` frozen layers on the nodes ``alive`` (node ids), from the one in
    force (``counts``, ``placement``): AutoPipe repartitions the active layers over the stage
    count it picks, AutoDP gives the freed nodes to the remaining stages as replicas, keeping
    each node on the bytes it holds where it can.  ``prefix_cached``: AutoPipe may plan without
    the prefix in device memory (every window's prefix output is cached); the layout records
    ``cached`` (default ``prefix_cached``: whether the prefix is served from the cache at all).
    ``start_groups``: the stages each node served at the start, where some served several (the
    memory budget is then the most a node held).  Returns it and AutoPipe's evidence."""
    new_counts, evidence = autopipe_for(model_cfg, frozen, start_stages, len(placement), hit, len(alive),
                                        global_batch, n_micro, prefix_cached=prefix_cached,
                                        start_groups=start_groups)
    pos = {n: i for i, n in enumerate(alive)}
    old_pos = [[pos[n] for n in p if n in pos] for p in placement]
    new_pos = assign_nodes(sizes, Partition(tuple(counts)), old_pos, Partition(tuple(new_counts)), len(alive))
    new_pl = [[alive[i] for i in p] for p in new_pos]
    cached = prefix_cached if cached is None else cached
    return ElasticLayout.of(frozen, new_counts, len(new_pl[0]), n_micro, new_pl, cached, step), evidence


def layout_routes(n_stages: int, skip_ratio: float, n: int, rng: random.Random, max_swaps: int) -> list[list[int]]:
    """The body-stage routes of ``n`` micro-batches through a layout of ``n_stages`` stages:
    full routes without skipping or with fewer than three stages (nothing left to skip), else
    balanced skip routes drawn from ``rng``."""
    if skip_ratio <= 0 or n_stages <= 2:
        return [full_route(n_stages) for _ in range(n)]
    return balanced_routes(n_stages, skip_ratio, n, rng, max_swaps)


def stage0_forward(model, frozen: int, h: torch.Tensor) -> torch.Tensor:
    """Stage 0's forward: the embedding and its layers, or after a freeze its layers after the
    frozen prefix, on the prefix's output ``h``."""
    if frozen == 0:
        return model.embed(h)
    return model.run_layers(h, range(frozen, model.partition.layers(0).stop))


def prefix_input(runner, src, x: torch.Tensor, indices, frozen: int) -> torch.Tensor:
    """What stage 0 starts the global samples ``indices`` (tokens ``x``) from: the tokens, or the
    frozen prefix's output computed without autograd by ``runner`` (a
    :class:`~.cache.PrefixRunner`, from its activation cache when on)."""
    return runner(x, [src.window(g) for g in indices]) if frozen > 0 else x


def append_log(path: Path, rec: dict[str, Any]) -> None:
    """One decision or transition appended to a run's ``elastic.jsonl``."""
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
