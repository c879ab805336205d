"""What moves when the layout changes: name-keyed transfers from the old holders to the new.

:func:`transfer_plan` gives every node of the new layout the tensors of its stage it does not
hold yet, each from the least-loaded node that holds it under the old layout (so the sends
spread over the old replicas), with byte counts: the bill of a layout change.  It knows nothing
of why the layout changed (a freeze, a failure, a join, a resume on other hardware).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from . import Layout, node_tensors, tensor_stage


@dataclass
class Transfer:
    src: int
    dst: int
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


def transfer_plan(sizes: Mapping[str, int], old: Layout, new: Layout) -> list[Transfer]:
    """Messages that give every node of ``new`` the tensors of its stage (``sizes``: name -> bytes).

    Raises ``ValueError`` naming a tensor that no node of ``old`` holds."""
    held = node_tensors(sizes, old.partition, old.placement)
    who: dict[str, list[int]] = {}
    for node, names in held.items():
        for n in names:
            who.setdefault(n, []).append(node)
    of_stage: dict[int, list[str]] = {}
    for name in sorted(sizes):
        of_stage.setdefault(tensor_stage(name, new.partition), []).append(name)
    sent: dict[int, int] = {}
    out: dict[tuple[int, int], Transfer] = {}
    for s, nodes in enumerate(new.placement):
        for dst in nodes:
            have = held.get(dst, set())
            for name in of_stage.get(s, []):
                if name in have:
                    continue
                srcs = who.get(name)
                if not srcs:
                    raise ValueError(f"no node holds {name}")
                src = min(srcs, key=lambda n: (sent.get(n, 0), n))
                sent[src] = sent.get(src, 0) + sizes[name]
                tr = out.setdefault((src, dst), Transfer(src, dst))
                tr.names.append(name)
                tr.nbytes += sizes[name]
    return sorted(out.values(), key=lambda t: (t.src, t.dst))
