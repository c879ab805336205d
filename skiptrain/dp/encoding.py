"""Compact, lossless-where-promised packing of top-k indices and values into bytes.

Index encodings (per chunk, an index is a position ``0 <= i < chunk_numel``):

* ``int64`` - 8 bytes each, the DeMo reference layout;
* ``u16``   - 2 bytes each, little-endian, for chunks of up to 65536 elements;
* ``u12``   - 12 bits each, two indices in three bytes, for chunks of up to 4096 elements
  (a 64 x 64 DCT chunk exactly).

Value encodings (one block of values per tensor):

* ``fp32``  - 4 bytes each, exact;
* ``bf16``  - 2 bytes each, round-to-nearest bfloat16;
* ``sign1`` - 1 bit each (the sign) plus one fp32 scale per tensor: ``value = +-scale`` with
  ``scale = mean |v|`` of the selected values;
* ``sign2`` - 2 bits each plus one fp32 scale per tensor: a uniform 4-level quantizer over
  ``[-scale, scale]`` with ``scale = max |v|``, levels ``{-1, -1/3, 1/3, 1} * scale``;
* ``sign1c`` - 1 bit each plus one bfloat16 scale per *group* of values (the payload uses one
  group per chunk, i.e. ``k`` values): ``value = +-scale_g`` with ``scale_g = mean |v|`` of the
  group, rounded to bfloat16.  Chunks whose momentum is small then send small values, so error
  feedback does not overshoot them (with one scale per tensor it does).

Functions taking ``group`` use it for ``sign1c`` only (values per scale; ``None`` = one group).

``encode_*`` return ``numpy.uint8`` arrays of exactly ``*_nbytes(n)`` bytes; ``decode_*`` take
such arrays and return torch tensors.  Index decoding never validates range (the payload
layer does); value decoding returns what was sent, non-finite values included, so the payload
layer can reject them with the peer's name.
"""

from __future__ import annotations

import numpy as np
import torch

INDEX_ENCODINGS = ("int64", "u16", "u12")
VALUE_ENCODINGS = ("fp32", "bf16", "sign1", "sign2", "sign1c")
INDEX_LIMIT = {"int64": 2**63, "u16": 2**16, "u12": 2**12}


# ---- indices ---------------------------------------------------------------------------

def index_nbytes(n: int, enc: str) -> int:
    if enc == "int64":
        return 8 * n
    if enc == "u16":
        return 2 * n
    if enc == "u12":
        return (12 * n + 7) // 8
    raise ValueError(f"unknown index encoding {enc!r}; choose one of {INDEX_ENCODINGS}")


def encode_indices(idx: torch.Tensor, enc: str) -> np.ndarray:
    """Flat non-negative indices -> bytes.  Raises ValueError if one does not fit ``enc``."""
    a = idx.reshape(-1).to(torch.int64).cpu().numpy()
    if a.size and (a.min() < 0 or a.max() >= INDEX_LIMIT[enc]):
        raise ValueError(f"index out of range for {enc}: [{a.min()}, {a.max()}]")
    if enc == "int64":
        return a.astype("<i8").view(np.uint8)
    if enc == "u16":
        return a.astype("<u2").view(np.uint8)
    if enc == "u12":
        n = a.size
        if n % 2:
            a = np.concatenate([a, np.zeros(1, dtype=a.dtype)])
        a = a.astype(np.uint32).reshape(-1, 2)
        lo, hi = a[:, 0], a[:, 1]
        out = np.empty((a.shape[0], 3), dtype=np.uint8)
        out[:, 0] = lo & 0xFF
        out[:, 1] = ((lo >> 8) & 0x0F) | ((hi & 0x0F) << 4)
        out[:, 2] = (hi >> 4) & 0xFF
        return out.reshape(-1)[: index_nbytes(n, enc)]
    raise ValueError(f"unknown index encoding {enc!r}; choose one of {INDEX_ENCODINGS}")


def decode_indices(buf: np.ndarray, n: int, enc: str) -> torch.Tensor:
    """Bytes -> ``n`` int64 indices (unvalidated).  ``buf`` may hold one block per row (one row
    per peer): the result then has one row of ``n`` indices per row of ``buf``."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8)
    lead = buf.shape[:-1]
    if buf.shape[-1] != index_nbytes(n, enc):
        raise ValueError(f"{enc} block of {n} indices must be {index_nbytes(n, enc)} bytes, got {buf.shape[-1]}")
    if enc == "int64":
        return torch.from_numpy(buf.view("<i8").astype(np.int64))
    if enc == "u16":
        return torch.from_numpy(buf.view("<u2").astype(np.int64))
    if enc == "u12":
        pad = (-buf.shape[-1]) % 3
        b = np.pad(buf, [(0, 0)] * len(lead) + [(0, pad)]).astype(np.int64).reshape(*lead, -1, 3)
        lo = b[..., 0] | ((b[..., 1] & 0x0F) << 8)
        hi = (b[..., 1] >> 4) | (b[..., 2] << 4)
        return torch.from_numpy(np.stack([lo, hi], -1).reshape(*lead, -1)[..., :n].copy())
    raise ValueError(f"unknown index encoding {enc!r}; choose one of {INDEX_ENCODINGS}")


# ---- values ----------------------------------------------------------------------------

def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    n = codes.size
    c = np.concatenate([codes.astype(np.uint8), np.zeros((-n) % per, np.uint8)]).reshape(-1, per)
    out = np.zeros(c.shape[0], np.uint8)
    for j in range(per):
        out |= (c[:, j] << (bits * j)).astype(np.uint8)
    return out


def _unpack_bits(buf: np.ndarray, n: int, bits: int) -> np.ndarray:
    """The first ``n`` codes of every row (the last axis) of ``buf``."""
    per = 8 // bits
    mask = (1 << bits) - 1
    cols = [(buf >> (bits * j)) & mask for j in range(per)]
    return np.stack(cols, -1).reshape(*buf.shape[:-1], -1)[..., :n]


def _groups(n: int, group: int | None) -> int:
    if group is None or n == 0:
        return 1 if n else 0
    if group < 1 or n % group:
        raise ValueError(f"a block of {n} values does not split into groups of {group}")
    return n // group


def value_nbytes(n: int, enc: str, group: int | None = None) -> int:
    """Bytes for a block of ``n`` values, including the per-block scale where there is one."""
    if enc == "fp32":
        return 4 * n
    if enc == "bf16":
        return 2 * n
    if enc == "sign1":
        return 4 + (n + 7) // 8
    if enc == "sign2":
        return 4 + (2 * n + 7) // 8
    if enc == "sign1c":
        return 2 * _groups(n, group) + (n + 7) // 8
    raise ValueError(f"unknown value encoding {enc!r}; choose one of {VALUE_ENCODINGS}")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()


def _from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(b).astype(np.int16)).view(torch.bfloat16).float().numpy()


def encode_values(v: torch.Tensor, enc: str, group: int | None = None) -> np.ndarray:
    v = v.detach().reshape(-1).float().cpu()      # the payload is built on the host
    if enc == "fp32":
        return v.numpy().astype("<f4").view(np.uint8)
    if enc == "bf16":
        return v.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").view(np.uint8)
    a = v.numpy()
    if enc == "sign1":
        scale = np.float32(np.abs(a).mean()) if a.size else np.float32(0)
        codes = (a >= 0).astype(np.uint8)
        return np.concatenate([np.array([scale], "<f4").view(np.uint8), _pack_bits(codes, 1)])
    if enc == "sign2":
        scale = np.float32(np.abs(a).max()) if a.size else np.float32(0)
        safe = scale if scale > 0 else np.float32(1)
        codes = np.clip(np.rint((a / safe + 1.0) * 1.5), 0, 3).astype(np.uint8)
        return np.concatenate([np.array([scale], "<f4").view(np.uint8), _pack_bits(codes, 2)])
    if enc == "sign1c":
        g = _groups(a.size, group)
        scales = np.abs(a).reshape(g, -1).mean(1).astype(np.float32) if a.size else np.zeros(0, np.float32)
        codes = (a >= 0).astype(np.uint8)
        return np.concatenate([_bf16_bits(scales).astype("<i2").view(np.uint8), _pack_bits(codes, 1)])
    raise ValueError(f"unknown value encoding {enc!r}; choose one of {VALUE_ENCODINGS}")


def decode_values(buf: np.ndarray, n: int, enc: str, group: int | None = None) -> torch.Tensor:
    """Bytes -> ``n`` float32 values (non-finite values are passed through, not checked).
    ``buf`` may hold one block per row: the result then has one row of ``n`` values per row."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8)
    lead = buf.shape[:-1]
    if buf.shape[-1] != value_nbytes(n, enc, group):
        raise ValueError(f"{enc} block of {n} values must be {value_nbytes(n, enc, group)} bytes, got {buf.shape[-1]}")
    if enc == "fp32":
        return torch.from_numpy(buf.view("<f4").astype(np.float32))
    if enc == "bf16":
        return torch.from_numpy(buf.view("<i2").astype(np.int16)).view(torch.bfloat16).float()
    if enc == "sign1c":
        g = _groups(n, group)
        scales = _from_bf16_bits(np.ascontiguousarray(buf[..., : 2 * g]).view("<i2"))
        codes = _unpack_bits(buf[..., 2 * g:], n, 1).astype(np.float32)
        if not n:
            return torch.from_numpy(codes)
        return torch.from_numpy(((codes * 2 - 1).reshape(*lead, g, -1) * scales[..., None]).reshape(*lead, n))
    scale = np.ascontiguousarray(buf[..., :4]).view("<f4").astype(np.float32)   # (..., 1)
    if enc == "sign1":
        codes = _unpack_bits(buf[..., 4:], n, 1).astype(np.float32)
        return torch.from_numpy((codes * 2 - 1) * scale)
    if enc == "sign2":
        codes = _unpack_bits(buf[..., 4:], n, 2).astype(np.float32)
        return torch.from_numpy((codes / np.float32(1.5) - 1) * scale)
    raise ValueError(f"unknown value encoding {enc!r}; choose one of {VALUE_ENCODINGS}")


def block_scales(buf: np.ndarray, enc: str, n: int, group: int | None = None) -> np.ndarray | None:
    """The scales of a sign1/sign2/sign1c block as float32, one row per row of ``buf`` (None for
    fp32/bf16)."""
    if enc in ("sign1", "sign2"):
        return np.ascontiguousarray(buf[..., :4]).view("<f4").astype(np.float32)
    if enc == "sign1c":
        return _from_bf16_bits(np.ascontiguousarray(buf[..., : 2 * _groups(n, group)]).view("<i2"))
    return None
