"""Activation (and activation-gradient) encodings for pipeline hops: fp32, bf16, int8, int4.

A hop carries a float tensor of shape ``(..., cols)``; its ``rows`` are all leading dimensions
flattened (samples x tokens for activations).  Encodings, symmetric with one fp32 scale per row:

* ``"fp32"``: the values as little-endian float32 (``4 * rows * cols`` bytes);
* ``"bf16"``: the values rounded to bfloat16 (round to nearest even), little-endian
  (``2 * rows * cols`` bytes, no scale): what a link carries when ``train.precision=bf16`` and
  no stronger encoding is chosen (:func:`plain_codec`);
* ``"int8"``: ``scale = max|row| / 127``, ``q = round(x / scale)`` in -127..127, one byte each;
* ``"int4"``: ``scale = max|row| / 7``, ``q`` in -7..7, two values per byte (element ``2i`` in
  the low nibble, ``2i + 1`` in the high nibble, two's complement; an odd ``cols`` pads the last
  nibble of each row with 0).

The encoded buffer is one flat ``uint8`` tensor: ``rows`` fp32 scales, then the codes, row by
row.  Its length is :func:`encoded_bytes`, which the cost model, the simulator and the planner
use per hop.  Shape and codec travel outside the buffer (the transport's message header).
Decoding gives the bf16 values as float32, or ``q * scale`` exactly (so every element is within ``scale / 2`` of the input);
a row holding NaN or infinity decodes to NaN (bf16 keeps each value's NaN or infinity), so payload checks on the decoded tensor still
catch bad senders.  A zero row has scale 0 and decodes to zeros.

Which links compress is the cost model's choice (:meth:`CostModel.hop_codec`): only links
slower than a bandwidth threshold pay the quantisation error; the others carry the plain
encoding of the compute precision (fp32, or bf16 under ``train.precision=bf16``).  torch is imported only by the
functions that touch tensors, so the planner can count bytes without it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CODECS = ("fp32", "int8", "int4", "bf16")      # the index is the codec's number in a message header
QMAX = {"int8": 127, "int4": 7}
SCALE_BYTES = 4
PLAIN = {"fp32": "fp32", "bf16": "bf16"}        # train.precision -> its uncompressed wire encoding


def check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"activation codec {codec!r} is not one of {CODECS}")


def plain_codec(precision: str) -> str:
    """The encoding of a link that does not quantise, for compute precision ``precision``:
    fp32 for ``fp32``, bf16 for ``bf16`` (autocast computes in bf16 already, so the wire halves
    its bytes without a scale)."""
    if precision not in PLAIN:
        raise ValueError(f"precision {precision!r} is not one of {tuple(PLAIN)}")
    return PLAIN[precision]


def slow_link_codec(act_codec: str, plain: str) -> str:
    """What a compressing link carries: ``act_codec`` (``runtime.act_codec``), or ``plain`` (the
    precision's own encoding) when ``act_codec`` is fp32: a link never carries more bytes than
    the compute precision needs."""
    check_codec(act_codec)
    return plain if act_codec == "fp32" else act_codec


def quantizes(codec: str) -> bool:
    """Whether ``codec`` quantises with a per-row scale (int8, int4): the ones that cost encode time."""
    return codec in QMAX


def row_bytes(codec: str, cols: int) -> int:
    """Encoded bytes of one row of ``cols`` values (scale included)."""
    check_codec(codec)
    if codec in PLAIN:
        return (4 if codec == "fp32" else 2) * cols
    if codec == "int8":
        return SCALE_BYTES + cols
    return SCALE_BYTES + (cols + 1) // 2


def encoded_bytes(codec: str, rows: int, cols: int) -> int:
    """Length of the encoded buffer of a ``rows x cols`` tensor."""
    return rows * row_bytes(codec, cols)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``rows x cols`` int8 codes in -8..7 -> ``rows x ceil(cols / 2)`` uint8 (see module doc)."""
    import torch

    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``rows x cols`` int8 codes."""
    import torch

    lo = (packed & 0xF).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    q = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)[..., :cols]
    return torch.where(q >= 8, q - 16, q).to(torch.int8)


def quantize(x2d: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, fp32 scale per row) of a 2-D float tensor for ``"int8"`` or ``"int4"``."""
    import torch

    qmax = QMAX[codec]
    x = x2d.to(torch.float32)
    scale = x.abs().amax(dim=1) / qmax
    bad = ~torch.isfinite(x).all(dim=1)
    scale = torch.where(bad, torch.full_like(scale, math.nan), scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.nan_to_num(x / safe[:, None], nan=0.0, posinf=0.0, neginf=0.0)
    q = torch.clamp(torch.round(y), -qmax, qmax).to(torch.int8)
    return q, scale


def encode(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Encode ``x`` (any float tensor with >= 1 dimension) into one flat uint8 buffer."""
    import torch

    check_codec(codec)
    cols = x.shape[-1] if x.dim() else 1
    x2d = x.detach().reshape(-1, cols).to(torch.float32).contiguous()
    if codec == "fp32":
        return x2d.reshape(-1).view(torch.uint8).clone()
    if codec == "bf16":
        return x2d.reshape(-1).to(torch.bfloat16).view(torch.uint8)
    q, scale = quantize(x2d, codec)
    codes = q.view(torch.uint8) if codec == "int8" else pack_int4(q)
    return torch.cat((scale.contiguous().view(torch.uint8), codes.reshape(-1)))


def decode(buf: torch.Tensor, codec: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 tensor of ``shape`` from :func:`encode`'s buffer (see module doc)."""
    import torch

    check_codec(codec)
    cols = shape[-1] if shape else 1
    rows = math.prod(shape) // cols if cols else 0
    if buf.dtype != torch.uint8 or buf.numel() != encoded_bytes(codec, rows, cols):
        raise ValueError(f"{codec} buffer of {buf.numel()} bytes ({buf.dtype}) does not hold a tensor of "
                         f"shape {tuple(shape)} ({encoded_bytes(codec, rows, cols)} bytes)")
    if codec == "fp32":
        return buf.clone().view(torch.float32).reshape(shape)
    if codec == "bf16":
        return buf.clone().view(torch.bfloat16).to(torch.float32).reshape(shape)
    scale = buf[:rows * SCALE_BYTES].clone().view(torch.float32)
    codes = buf[rows * SCALE_BYTES:].reshape(rows, -1)
    q = codes.view(torch.int8) if codec == "int8" else unpack_int4(codes, cols)
    return (q.to(torch.float32) * scale[:, None]).reshape(shape)


def measure_codec_s(codec: str, rows: int, cols: int, repeats: int = 3) -> float:
    """Seconds to encode and decode one ``rows x cols`` fp32 tensor on this machine (least of
    ``repeats`` after one warm-up): a value for :attr:`CostModel.act_codec_s`."""
    import time

    import torch

    x = torch.randn(rows, cols)
    decode(encode(x, codec), codec, (rows, cols))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        decode(encode(x, codec), codec, (rows, cols))
        best = min(best, time.perf_counter() - t)
    return best
