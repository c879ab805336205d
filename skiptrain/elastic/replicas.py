"""AutoDP: nodes freed by a shrink become replicas of the remaining stages.

:func:`assign_nodes` maps the ``N`` nodes onto the new stages (``N // S`` replicas each, as
many as fit): each new stage takes the nodes that already hold the largest part of its
tensors, so most nodes keep most of their bytes.  What then moves is the layout-change core's
business (:func:`skiptrain.layout.transfer.transfer_plan`), and the state travels in the one
wire format (:mod:`skiptrain.checkpoint.wire`).  Frozen layers travel without optimizer state
(they have none to update); the learning-rate schedule is a function of the step, and the
global batch is kept, so both stay continuous.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..layout import node_tensors, tensor_stage
from ..model.partition import Partition


def assign_nodes(sizes: Mapping[str, int], old_partition: Partition, old_placement: Sequence[Sequence[int]],
                 new_partition: Partition, n_nodes: int) -> list[list[int]]:
    """New placement: ``n_nodes // S`` nodes per new stage, maximising bytes already held.

    ``sizes``: tensor name -> bytes; ``old_placement`` may have nodes that serve several stages
    (in the new one each node serves one).  Greedy over (bytes held, node) pairs, largest first.
    """
    S = new_partition.n_stages
    per = n_nodes // S
    if per < 1:
        raise ValueError(f"{n_nodes} nodes cannot serve {S} stages")
    held = node_tensors(sizes, old_partition, old_placement)
    need: dict[int, set[str]] = {s: set() for s in range(S)}
    for n in sizes:
        need[tensor_stage(n, new_partition)].add(n)
    old_stages: dict[int, tuple[int, ...]] = {}     # (a node may serve several stages of the old layout)
    for s, nodes in enumerate(old_placement):
        for n in nodes:
            old_stages[n] = old_stages.get(n, ()) + (s,)
    held_bytes: dict[tuple[tuple[int, ...], int], int] = {}   # nodes of the same old stages hold the same
    pairs = []
    for node in range(n_nodes):
        for s in range(S):
            key = (old_stages.get(node, ()), s)
            if key not in held_bytes:
                held_bytes[key] = sum(sizes[t] for t in need[s] & held.get(node, set()))
            pairs.append((-held_bytes[key], node, s))
    pairs.sort()
    placement: list[list[int]] = [[] for _ in range(S)]
    used: set[int] = set()
    for _, node, s in pairs:
        if node in used or len(placement[s]) >= per:
            continue
        placement[s].append(node)
        used.add(node)
    return [sorted(p) for p in placement]
