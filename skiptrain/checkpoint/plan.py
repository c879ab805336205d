"""Who writes what: a deterministic, byte-balanced assignment of tensor shards to writers.

Every node of a run holds some stages; a stage served by several replicas holds the same tensors
on each.  To write each tensor exactly once and spread the I/O evenly, every node calls
:func:`plan_save` with the same inputs (the global tensor specs and, for each tensor, the ranks
that hold it) and gets the same answer without any communication:

1. tensors larger than ``chunk_bytes`` are cut along dimension 0 into near-equal row blocks
   (so one huge embedding does not land on one writer; a block is a contiguous byte range);
2. pieces are taken largest first (ties by name and offset) and each goes to the eligible holder
   with the fewest bytes so far (ties by lowest rank): greedy "longest processing time first",
   within ``max piece`` of the best possible balance when replicas hold the same tensors.

The plan depends only on its arguments, never on dict order or on the node computing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .format import DTYPES

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's global description: what every node knows even if it does not hold it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * DTYPES[self.dtype][0] if self.shape else self.nbytes


@dataclass(frozen=True)
class ShardItem:
    """Rows ``[row0, row0 + rows)`` of ``name`` (all of a 0-d tensor: row0 = 0, rows = 1)."""

    name: str
    row0: int
    rows: int
    byte_start: int   # offset of the block inside the tensor's row-major bytes
    nbytes: int

    def offsets(self, ndim: int) -> list[int]:
        return [self.row0] + [0] * (ndim - 1) if ndim else []

    def lengths(self, shape: Sequence[int]) -> list[int]:
        return [self.rows] + list(shape[1:]) if shape else []


@dataclass
class SavePlan:
    assignments: dict[int, list[ShardItem]]   # rank -> its pieces, in write order
    specs: dict[str, TensorSpec]

    def items(self, rank: int) -> list[ShardItem]:
        return self.assignments.get(rank, [])

    def bytes_per_rank(self) -> dict[int, int]:
        return {r: sum(i.nbytes for i in items) for r, items in sorted(self.assignments.items())}

    def ranks(self) -> list[int]:
        return sorted(self.assignments)

    def names_for(self, rank: int) -> list[str]:
        seen: dict[str, None] = {}
        for it in self.items(rank):
            seen.setdefault(it.name)
        return list(seen)


def split_rows(spec: TensorSpec, chunk_bytes: int) -> list[ShardItem]:
    if not spec.shape or spec.shape[0] <= 1 or spec.nbytes <= chunk_bytes:
        rows = spec.shape[0] if spec.shape else 1
        return [ShardItem(spec.name, 0, rows, 0, spec.nbytes)]
    n_rows = spec.shape[0]
    pieces = min(n_rows, math.ceil(spec.nbytes / chunk_bytes))
    out, row = [], 0
    for k in range(pieces):
        rows = n_rows // pieces + (1 if k < n_rows % pieces else 0)
        out.append(ShardItem(spec.name, row, rows, row * spec.row_bytes, rows * spec.row_bytes))
        row += rows
    return out


def plan_save(specs: Iterable[TensorSpec], holders: Mapping[str, Sequence[int]] | None = None,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, ranks: Sequence[int] | None = None) -> SavePlan:
    """Assign every byte of every tensor to exactly one of the ranks holding it.

    ``holders=None`` means a single writer, rank 0.  A tensor missing from ``holders`` or with no
    holder is a ValueError (nobody could write it).  ``ranks`` lists writers that must appear in
    the plan even with nothing to write (they still write an empty part, so the commit can wait
    for every rank).
    """
    specs = {s.name: s for s in specs}
    all_ranks = set(ranks or [])
    if holders is None:
        holders = {n: [0] for n in specs}
        all_ranks.add(0)
    pieces: list[tuple[ShardItem, tuple[int, ...]]] = []
    for name in sorted(specs):
        hs = tuple(sorted(set(holders.get(name, ()))))
        if not hs:
            raise ValueError(f"tensor {name!r} has no holder: no rank could write it")
        all_ranks.update(hs)
        pieces.extend((p, hs) for p in split_rows(specs[name], chunk_bytes))
    pieces.sort(key=lambda ph: (-ph[0].nbytes, ph[0].name, ph[0].row0))
    load = {r: 0 for r in all_ranks}
    assigned: dict[int, list[ShardItem]] = {r: [] for r in all_ranks}
    for piece, hs in pieces:
        r = min(hs, key=lambda r: (load[r], r))
        load[r] += piece.nbytes
        assigned[r].append(piece)
    for r in assigned:  # write in name order: related tensors end up near each other in the file
        assigned[r].sort(key=lambda it: (it.name, it.row0))
    return SavePlan(assigned, specs)
