"""Activation encodings: exact agreement with a plain-Python reference, exact int4 packing,
bytes per hop, and non-finite rows staying detectable after decoding."""

import math
import struct

import pytest
import torch

from skiptrain.schedule.actcodec import (CODECS, decode, encode, encoded_bytes, measure_codec_s, pack_int4,
                                         quantize, unpack_int4)


def ref_encode(rows, codec):
    """Plain-Python reference of the documented format (finite rows)."""
    qmax = {"int8": 127, "int4": 7}[codec]
    scales, codes = [], []
    for row in rows:
        m = max(abs(v) for v in row)
        s = struct.unpack("<f", struct.pack("<f", m))[0] / qmax
        s = struct.unpack("<f", struct.pack("<f", s))[0]
        scales.append(s)
        q = [max(-qmax, min(qmax, round(struct.unpack("<f", struct.pack("<f", v / s))[0]))) if s > 0 else 0
             for v in row]
        codes.append(q)
    out = b"".join(struct.pack("<f", s) for s in scales)
    for q in codes:
        if codec == "int8":
            out += bytes(x & 0xFF for x in q)
        else:
            q = q + [0] * (len(q) % 2)
            out += bytes((q[i] & 0xF) | ((q[i + 1] & 0xF) << 4) for i in range(0, len(q), 2))
    return out, scales, codes


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("cols", [1, 7, 16])
def test_encode_matches_reference_and_decodes_exactly(codec, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(3, 5, cols, generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    x[1, 2] = 0.0  # a zero row
    rows = x.reshape(-1, cols).tolist()
    want, scales, codes = ref_encode(rows, codec)
    buf = encode(x, codec)
    assert bytes(buf.tolist()) == want
    assert buf.numel() == encoded_bytes(codec, 15, cols)
    y = decode(buf, codec, tuple(x.shape))
    exact = torch.tensor([[c * s for c in q] for q, s in zip(codes, scales)], dtype=torch.float32)
    assert torch.equal(y.reshape(-1, cols), exact)
    bound = torch.tensor(scales).unsqueeze(1) / 2 + 1e-6 * x.abs().reshape(-1, cols)
    assert ((y - x).abs().reshape(-1, cols) <= bound).all()
    assert torch.equal(y[1, 2], torch.zeros(cols))


def test_fp32_round_trip_is_bit_exact():
    x = torch.randn(4, 6)
    buf = encode(x, "fp32")
    assert buf.numel() == 4 * 24 and torch.equal(decode(buf, "fp32", (4, 6)), x)


def test_int4_pack_unpack_every_code():
    q = torch.tensor([[a, b] for a in range(-8, 8) for b in range(-8, 8)], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (256, 1)
    assert sorted(packed.reshape(-1).tolist()) == list(range(256))
    assert torch.equal(unpack_int4(packed, 2), q)
    odd = torch.tensor([[3, -2, -8]], dtype=torch.int8)
    assert pack_int4(odd).tolist() == [[0x3 | (0xE << 4), 0x8]]
    assert torch.equal(unpack_int4(pack_int4(odd), 3), odd)


def test_bytes_per_hop_reference_activation():
    # one hop of the reference setup: 8 x 1024 tokens of d=1024
    fp32 = encoded_bytes("fp32", 8192, 1024)
    assert fp32 == 32 * 2 ** 20
    assert fp32 / encoded_bytes("int8", 8192, 1024) >= 3.9
    assert fp32 / encoded_bytes("int4", 8192, 1024) >= 7.0
    x = torch.randn(2, 64, 1024)
    for codec in CODECS:
        assert encode(x, codec).numel() == encoded_bytes(codec, 128, 1024)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_non_finite_rows_decode_to_nan(codec):
    x = torch.randn(3, 8)
    x[0, 3] = math.nan
    x[2, 1] = math.inf
    y = decode(encode(x, codec), codec, (3, 8))
    assert torch.isnan(y[0]).all() and torch.isnan(y[2]).all() and torch.isfinite(y[1]).all()
    q, scale = quantize(x, codec)
    assert math.isnan(scale[0]) and math.isfinite(scale[1])


def test_decode_rejects_a_wrong_length():
    with pytest.raises(ValueError):
        decode(torch.zeros(10, dtype=torch.uint8), "int8", (2, 8))
    with pytest.raises(ValueError):
        encode(torch.zeros(2), "fp16")


def test_measure_codec_s_is_a_positive_time():
    assert 0 < measure_codec_s("int8", 16, 32, repeats=1) < 5


def test_bf16_round_trip_halves_the_bytes_and_keeps_non_finite_values():
    x = torch.randn(4, 16, 64) * 3.0
    x[1, 2, 5], x[3, 0, 0] = math.nan, -math.inf
    buf = encode(x, "bf16")
    assert buf.dtype == torch.uint8 and buf.numel() == encoded_bytes("bf16", 64, 64) == 2 * x.numel()
    assert 2 * buf.numel() == encode(x, "fp32").numel()
    y = decode(buf, "bf16", tuple(x.shape))
    assert y.dtype == torch.float32 and y.shape == x.shape
    finite = torch.isfinite(x)
    assert torch.equal(y[finite], x.to(torch.bfloat16).float()[finite])
    assert bool(((y - x).abs()[finite] <= x.abs()[finite] * 2 ** -8).all())     # bf16: 8 significant bits
    assert math.isnan(y[1, 2, 5]) and y[3, 0, 0] == -math.inf
    with pytest.raises(ValueError):
        decode(buf[:-2], "bf16", tuple(x.shape))


def test_links_carry_the_precisions_encoding_unless_a_stronger_codec_is_chosen():
    from skiptrain.net.topology import Node, Topology
    from skiptrain.schedule.actcodec import plain_codec, slow_link_codec
    from skiptrain.schedule.cost import CostModel

    assert plain_codec("fp32") == "fp32" and plain_codec("bf16") == "bf16"
    assert slow_link_codec("fp32", "bf16") == "bf16" and slow_link_codec("int8", "bf16") == "int8"
    assert slow_link_codec("bf16", "fp32") == "bf16" and slow_link_codec("fp32", "fp32") == "fp32"
    with pytest.raises(ValueError, match="precision"):
        plain_codec("fp16")
    fast, slow = 10 * 2 ** 30, 2 ** 20
    topo = Topology([Node(0, "a"), Node(1, "b")], [[0, 0], [0, 0]], [[fast, slow], [fast, fast]])
    kw = dict(d_model=64, tokens_per_sample=32, samples=4, layers_per_stage=[1, 1])
    fp32_bytes = 4 * 4 * 32 * 64          # fp32: samples x tokens x d_model x 4 bytes
    for act_codec, plain, want_slow, want_fast in (("fp32", "bf16", "bf16", "bf16"), ("int8", "bf16", "int8", "bf16"),
                                                   ("fp32", "fp32", "fp32", "fp32"), ("int4", "fp32", "int4", "fp32")):
        c = CostModel(act_codec=act_codec, act_plain=plain, **kw)
        assert (c.hop_codec(topo, 0, 1), c.hop_codec(topo, 1, 0)) == (want_slow, want_fast)
        assert c.hop_bytes(topo, 1, 0) == (fp32_bytes if plain == "fp32" else fp32_bytes // 2)
