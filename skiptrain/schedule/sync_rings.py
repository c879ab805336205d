"""The rings of a data-parallel sync, and the chains of messages each one runs.

A ring is its members in ring order; a member sends only to the next one and receives only from
the one before.  What a ring does with the ``B`` bytes its phase gives it (``op``):

* ``"sum"``: an all-reduce.  Every member starts a chain; for a dense sync each chain makes
  ``2 (m-1)`` hops of ``B / m`` (a reduce-scatter then an all-gather, ``m`` pieces), for a
  compressed one ``m - 1`` hops of ``B`` (an all-gather of every member's payload)
  (:meth:`~skiptrain.schedule.cost.CostModel.sync_steps`).
* ``"scatter"``: a reduce-scatter into ``k`` pieces that ends with piece ``j`` summed at its
  owner, ``owners[j]``: chain ``j`` starts at the member after the owner and makes ``m - 1`` hops
  of ``B / k``, every receiver adding its own piece ``j``.  With ``k`` owners among ``m >= k``
  members it moves ``(m-1) / k`` of ``B`` per link in ``m - 1`` steps, against ``2 (m-1) / m``
  in ``2 (m-1)`` steps for ``"sum"``: the cheaper while ``m <= 2k`` (:func:`scatter_pays`).
* ``"gather"``: its mirror: chain ``j`` starts at ``owners[j]`` and makes ``m - 1`` hops of
  ``B / k``, every receiver keeping piece ``j``.

Chains start at distinct members and all move one hop per step, so no ring link carries two
pieces in one step.  The cost model (:meth:`~skiptrain.schedule.cost.CostModel.phases_s`), the
simulator and the runtime's transport (:meth:`skiptrain.dp.transport.Transport.ring_pass`) run
these same chains: :func:`chain_starts` is the one description of who sends what when.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

RING_OPS = ("sum", "scatter", "gather")


def scatter_pays(members: int, owners: int) -> bool:
    """Whether a reduce-scatter to ``owners`` pieces (then its gather) is the cheaper pass over a
    ring of ``members`` than an all-reduce: it moves ``(m-1)/k`` of the bytes per link against
    ``2 (m-1)/m``, in ``m - 1`` steps against ``2 (m-1)``; so while ``m <= 2k`` (at ``m = 2k`` the
    same bytes in half the steps)."""
    return 1 < members <= 2 * owners


def chain_starts(m: int, op: str, owner_pos: Sequence[int]) -> list[int]:
    """The ring position each chain starts at, chain ``j`` carrying piece ``j``: every position for
    ``"sum"``; the position after ``owner_pos[j]`` for ``"scatter"``; ``owner_pos[j]`` for
    ``"gather"``."""
    if op == "sum":
        return list(range(m))
    if op == "scatter":
        return [(p + 1) % m for p in owner_pos]
    if op == "gather":
        return list(owner_pos)
    raise ValueError(f"ring op {op!r} is not one of {RING_OPS}")


def moves_at(m: int, starts: Sequence[int], hops: int, position: int) -> list[tuple[int | None, int | None]]:
    """For the member at ``position``, per step ``(piece it sends, piece it receives)`` (None:
    nothing), when chain ``j`` starts at ``starts[j]`` and makes ``hops`` hops."""
    out = []
    for step in range(hops):
        at = {(s + step) % m: j for j, s in enumerate(starts)}
        out.append((at.get(position), at.get((position - 1) % m)))
    return out


@dataclass(frozen=True)
class SyncRing:
    """One ring of a sync phase: ``nodes`` in ring order, its ``op`` (module doc), and for
    ``"scatter"``/``"gather"`` the owner of every piece, ``owners[j]`` a member of ``nodes``."""
    nodes: tuple[int, ...]
    op: str = "sum"
    owners: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in RING_OPS:
            raise ValueError(f"ring op {self.op!r} is not one of {RING_OPS}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"a ring lists a member twice: {self.nodes}")
        if (self.op == "sum") != (not self.owners) or not set(self.owners) <= set(self.nodes) \
                or len(set(self.owners)) != len(self.owners):
            raise ValueError(f"a {self.op!r} ring's owners {self.owners} do not fit its members {self.nodes}")

    def __len__(self) -> int:
        return len(self.nodes)

    def chains(self, sum_steps: tuple[int, float]) -> tuple[list[int], int, float]:
        """``(start positions, hops per chain, fraction of the phase's bytes per hop)``;
        ``sum_steps`` is the all-reduce's ``(hops, fraction)`` for this ring's size."""
        m = len(self.nodes)
        if m < 2:
            return [], 0, 0.0
        if self.op == "sum":
            return chain_starts(m, "sum", ()), sum_steps[0], sum_steps[1]
        pos = {n: i for i, n in enumerate(self.nodes)}
        return chain_starts(m, self.op, [pos[o] for o in self.owners]), m - 1, 1.0 / len(self.owners)
