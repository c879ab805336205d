"""Replica consistency: per-tensor hashes compared across the group.

Data-parallel replicas must hold bit-identical parameters after every sync.  Every K steps each
replica hashes every parameter (BLAKE2b, 8 bytes, over the raw little-endian bytes), the hash
vectors are all-gathered, and any difference raises :class:`ConsistencyError` naming the first
tensors that differ and the ranks that disagree with rank 0.  All ranks raise the same error.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import UserError


class ConsistencyError(UserError, RuntimeError):
    """Replicas that must be identical are not; the message names the tensor(s) and ranks."""


def tensor_hash(t: torch.Tensor) -> int:
    a = np.ascontiguousarray(t.detach().cpu().numpy())
    return int.from_bytes(hashlib.blake2b(a.view(np.uint8).tobytes(), digest_size=8).digest(), "little",
                          signed=True)


def param_hashes(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """int64 vector of per-tensor hashes, in the order of ``named``."""
    return torch.tensor([tensor_hash(p) for _, p in named], dtype=torch.int64)


def check_consistency(named: list[tuple[str, torch.Tensor]], transport, step: int) -> None:
    """Compare parameter hashes across the transport's group; raise ConsistencyError on mismatch."""
    mine = param_hashes(named)
    allh = transport.all_gather_tensor(mine)
    ref = allh[0]
    bad: dict[str, list[int]] = {}
    for r, h in enumerate(allh[1:], start=1):
        for i in torch.nonzero(h != ref).flatten().tolist():
            bad.setdefault(named[i][0], []).append(r)
    if bad:
        names = sorted(bad)
        detail = "; ".join(f"{n} differs on ranks {bad[n]}" for n in names[:5])
        more = f" (and {len(names) - 5} more tensors)" if len(names) > 5 else ""
        raise ConsistencyError(f"replicas diverged at step {step}: {detail}{more} (compared with rank 0)")
