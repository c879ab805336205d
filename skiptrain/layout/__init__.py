"""Layouts and the one layout-change core.

A :class:`Layout` is pure data: the partition of layers into stages, the placement of nodes on
stages, the frozen depth and (optionally) the schedule of routes.  Every tensor of the training
state has a global name (``layers.7.attn.wq.weight``, ``optim.exp_avg.<param>``, ...) and lives
on the stage :func:`tensor_stage` says; so a layout says which node holds which tensor, and
:func:`skiptrain.layout.transfer.transfer_plan` says what must move, from whom, when the layout
changes.  Freeze transitions (AutoDP), joins and takeovers in the swarm, and checkpoint
resharding all plan their moves here; the state itself travels in one wire format,
:mod:`skiptrain.checkpoint.wire`.

This package imports no torch (checkpoint writer processes use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


def tensor_stage(name: str, partition) -> int:
    """The pipeline stage holding tensor ``name`` under ``partition`` (a model.partition.Partition).

    Optimizer and sync-strategy state (``optim.<key>.<param>``, ``sync.<key>.<param>``) lives
    with its parameter; ``layers.{i}.*`` with the
    stage holding layer i; everything else (embedding, final norm, head, RNG, ...) on stage 0.
    """
    if name.startswith(("optim.", "sync.")):
        name = name.split(".", 2)[2]
    if name.startswith("layers."):
        return partition.stage_of_layer(int(name.split(".", 2)[1]))
    return 0


def is_frozen(name: str, frozen: int) -> bool:
    """Whether parameter ``name`` is frozen at depth ``frozen``: layers ``0..frozen-1``, and the
    token embedding with the first of them."""
    if name.startswith("layers."):
        return int(name.split(".", 2)[1]) < frozen
    return frozen > 0 and name.startswith("tok_emb.")


def holders(names: Iterable[str], partition, placement: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    """tensor name -> the nodes holding it, from ``placement[stage] = [nodes]``."""
    return {n: list(placement[tensor_stage(n, partition)]) for n in names}


def node_tensors(names: Iterable[str], partition, placement: Sequence[Sequence[int]]) -> dict[int, set[str]]:
    """node -> the tensor names it holds under ``partition`` and ``placement``."""
    of_stage: dict[int, set[str]] = {}
    for name in names:
        of_stage.setdefault(tensor_stage(name, partition), set()).add(name)
    out: dict[int, set[str]] = {n: set() for nodes in placement for n in nodes}
    for s, nodes in enumerate(placement):
        for node in nodes:
            out[node] |= of_stage.get(s, set())
    return out


@dataclass
class Layout:
    """Partition + placement + frozen depth (+ routes): what a run's nodes hold and do."""
    partition: Any                       # skiptrain.model.partition.Partition
    placement: list[list[int]]
    frozen: int = 0
    schedule: Any = None                 # skiptrain.schedule.schedule.Schedule, when routes matter

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    def holders(self, names: Iterable[str]) -> dict[str, list[int]]:
        return holders(names, self.partition, self.placement)

    def node_tensors(self, names: Iterable[str]) -> dict[int, set[str]]:
        return node_tensors(names, self.partition, self.placement)


__all__ = ["Layout", "holders", "is_frozen", "node_tensors", "tensor_stage"]
