"""One fixed-size byte payload per sync: every tensor's top-k indices and values in one bucket.

Layout (little-endian), identical on every replica and known before training starts::

    header (24 bytes)
      magic      4s   b"SKDP"
      version    u8   1
      index enc  u8   position in encoding.INDEX_ENCODINGS
      value enc  u8   position in encoding.VALUE_ENCODINGS
      reserved   u8   0
      step       i64  the sync counter of the sender (replicas are in lock-step)
      n_proc     u32  micro-batches the sender processed since the previous sync (decode weight)
      layout     u32  crc32 of (names, shapes, chunks, k, encodings): peers must agree
    then, for each tensor in sorted global-name order:
      indices    index_nbytes(n_chunks * k)   positions inside each chunk, chunk-major
      values     value_nbytes(n_chunks * k)   (sign1/sign2 blocks start with a fp32 scale,
                                               sign1c blocks with one bf16 scale per chunk)

:meth:`PayloadLayout.decode` validates everything a peer controls before anything is applied:
total size, magic, version, encodings, layout hash, step, every index in ``[0, chunk_numel)``
and unique inside its chunk, every value and scale finite.  Any failure is a
:class:`PayloadError` naming the peer (its rank in the group) and, where it applies, the tensor.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from .encoding import (INDEX_ENCODINGS, VALUE_ENCODINGS, block_scales, decode_indices, decode_values,
                       encode_indices, encode_values, index_nbytes, value_nbytes)

MAGIC = b"SKDP"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBqII")
HEADER_BYTES = _HEADER.size  # 24


class PayloadError(UserError, RuntimeError):
    """A peer's payload is malformed; it was not applied.  The message names the peer."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    n_chunks: int
    chunk_numel: int
    k: int

    @property
    def n(self) -> int:
        return self.n_chunks * self.k


class PayloadLayout:
    """Byte offsets of every tensor's blocks; encodes and validates/decodes payloads."""

    def __init__(self, specs: list[TensorSpec], index_enc: str, value_enc: str):
        if index_enc not in INDEX_ENCODINGS:
            raise ValueError(f"unknown index encoding {index_enc!r}")
        if value_enc not in VALUE_ENCODINGS:
            raise ValueError(f"unknown value encoding {value_enc!r}")
        self.specs = sorted(specs, key=lambda s: s.name)
        self.index_enc, self.value_enc = index_enc, value_enc
        self.blocks: dict[str, tuple[int, int, int]] = {}  # name -> (idx offset, val offset, end)
        off = HEADER_BYTES
        desc = [index_enc, value_enc]
        for s in self.specs:
            ni, nv = index_nbytes(s.n, index_enc), value_nbytes(s.n, value_enc, s.k)
            self.blocks[s.name] = (off, off + ni, off + ni + nv)
            off += ni + nv
            desc.append(f"{s.name}:{s.shape}:{s.n_chunks}x{s.chunk_numel}:{s.k}")
        self.nbytes = off
        self.layout_hash = zlib.crc32("|".join(desc).encode())

    def encode(self, step: int, n_processed: int,
               tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
        """``tensors[name] = (indices (n_chunks, k), values (n_chunks, k))`` -> the payload bytes."""
        out = np.zeros(self.nbytes, np.uint8)
        out[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(
            MAGIC, VERSION, INDEX_ENCODINGS.index(self.index_enc), VALUE_ENCODINGS.index(self.value_enc),
            0, int(step), int(n_processed), self.layout_hash), np.uint8)
        for s in self.specs:
            idx, val = tensors[s.name]
            a, b, c = self.blocks[s.name]
            out[a:b] = encode_indices(idx, self.index_enc)
            out[b:c] = encode_values(val, self.value_enc, s.k)
        return out

    def decode(self, buf: np.ndarray, peer: int, expect_step: int | None = None
               ) -> tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Validate a peer's payload; return ``(n_processed, {name: (indices, values)})``.

        Raises :class:`PayloadError` naming ``peer`` on any malformation; nothing is returned
        (so nothing can be applied) unless every check passes.
        """
        weights, tensors = self.decode_all([buf], [peer], expect_step)
        return weights[0], {name: (idx[0], val[0]) for name, (idx, val) in tensors.items()}

    def decode_all(self, bufs: list[np.ndarray], peers: list[int], expect_step: int | None = None
                   ) -> tuple[list[int], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Validate every peer's payload (``bufs[i]`` from ``peers[i]``) and decode them side by
        side: ``([n_processed per peer], {name: (indices, values)})``, each tensor of shape
        ``(peers, n_chunks, k)``.  One decode per tensor for all peers; any malformation raises
        :class:`PayloadError` naming the first peer found at fault, and nothing is returned."""
        def bad(row: int, msg: str) -> PayloadError:
            return PayloadError(f"payload from peer rank {peers[row]} rejected: {msg}")

        bufs = [np.asarray(b) for b in bufs]
        weights = [self._header(b, row, expect_step, bad) for row, b in enumerate(bufs)]
        rows = np.stack(bufs)
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for s in self.specs:
            a, b, c = self.blocks[s.name]
            idx = decode_indices(rows[:, a:b], s.n, self.index_enc).view(len(bufs), s.n_chunks, s.k)
            _check_indices(idx, s, bad)
            scales = block_scales(rows[:, b:c], self.value_enc, s.n, s.k)
            if scales is not None:
                ok = (np.isfinite(scales) & (scales >= 0)).all(axis=1)
                if not ok.all():
                    r = int(np.argmin(ok))
                    worst = scales[r][~(np.isfinite(scales[r]) & (scales[r] >= 0))][0]
                    raise bad(r, f"tensor {s.name}: value scale {worst} is not a finite non-negative number")
            val = decode_values(rows[:, b:c], s.n, self.value_enc, s.k).view(len(bufs), s.n_chunks, s.k)
            fin = torch.isfinite(val).flatten(1).all(1)
            if not bool(fin.all()):
                raise bad(int(torch.argmin(fin.int())), f"tensor {s.name}: non-finite value")
            out[s.name] = (idx, val)
        return weights, out

    def _header(self, buf: np.ndarray, row: int, expect_step: int | None, bad) -> int:
        """Check one payload's size and header; its ``n_processed``."""
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise bad(row, f"expected a flat uint8 buffer, got {buf.dtype} {buf.shape}")
        if buf.size != self.nbytes:
            raise bad(row, f"size {buf.size} bytes, expected exactly {self.nbytes}")
        magic, ver, ienc, venc, _, step, n_proc, lh = _HEADER.unpack(buf[:HEADER_BYTES].tobytes())
        if magic != MAGIC or ver != VERSION:
            raise bad(row, f"bad magic/version {magic!r}/{ver}")
        if ienc >= len(INDEX_ENCODINGS) or INDEX_ENCODINGS[ienc] != self.index_enc or \
                venc >= len(VALUE_ENCODINGS) or VALUE_ENCODINGS[venc] != self.value_enc:
            raise bad(row, f"encodings ({ienc}, {venc}) differ from ours ({self.index_enc}, {self.value_enc})")
        if lh != self.layout_hash:
            raise bad(row, "layout hash differs: the peer has other tensors, shapes, chunk or k settings")
        if expect_step is not None and step != expect_step:
            raise bad(row, f"sync step {step}, expected {expect_step} (replicas out of lock-step)")
        return int(n_proc)


def _check_indices(idx: torch.Tensor, s: TensorSpec, bad) -> None:
    """Every index of every peer's ``(peers, n_chunks, k)`` block inside its chunk, and unique."""
    if not s.n:
        return
    flat = idx.flatten(1)
    out_of_range = ((flat < 0) | (flat >= s.chunk_numel)).any(1)
    if bool(out_of_range.any()):
        r = int(torch.argmax(out_of_range.int()))
        raise bad(r, f"tensor {s.name}: index out of range [0, {s.chunk_numel}) "
                     f"(got {int(flat[r].min())}..{int(flat[r].max())})")
    if s.k > 1:
        srt = idx.sort(dim=2).values
        dup = (srt[..., 1:] == srt[..., :-1]).flatten(1).any(1)
        if bool(dup.any()):
            raise bad(int(torch.argmax(dup.int())), f"tensor {s.name}: duplicate index inside a chunk")
