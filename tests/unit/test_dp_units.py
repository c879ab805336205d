"""Single-process tests of skiptrain.dp: encodings, DCT, payload validation, DeMo maths at N=1."""

import copy
import math

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skiptrain.config import DPConfig, TrainConfig, build_config, ConfigError
from skiptrain.dp.accountant import ByteAccountant
from skiptrain.dp.dct import ChunkedDCT, dct_matrix
from skiptrain.dp.encoding import (INDEX_ENCODINGS, INDEX_LIMIT, VALUE_ENCODINGS, decode_indices, decode_values,
                                   encode_indices, encode_values, index_nbytes, value_nbytes)
from skiptrain.dp.link import LINK_PRESETS, LinkModel
from skiptrain.dp.payload import PayloadError, PayloadLayout, TensorSpec
from skiptrain.dp import StrategyError, make_strategy
from skiptrain.optim import build_optimizer
from skiptrain.runtime.step import HostedStage, optimizer_step


# ---- encodings ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(enc=st.sampled_from(INDEX_ENCODINGS), n=st.integers(0, 300), data=st.data())
def test_index_encodings_round_trip(enc, n, data):
    hi = min(INDEX_LIMIT[enc], 2**40)
    vals = data.draw(st.lists(st.integers(0, hi - 1), min_size=n, max_size=n))
    idx = torch.tensor(vals, dtype=torch.int64)
    buf = encode_indices(idx, enc)
    assert buf.dtype == np.uint8 and buf.size == index_nbytes(n, enc)
    assert torch.equal(decode_indices(buf, n, enc), idx)


def test_index_sizes_and_limits():
    assert index_nbytes(32, "int64") == 256 and index_nbytes(32, "u16") == 64 and index_nbytes(32, "u12") == 48
    assert index_nbytes(3, "u12") == 5
    with pytest.raises(ValueError):
        encode_indices(torch.tensor([4096]), "u12")
    with pytest.raises(ValueError):
        encode_indices(torch.tensor([-1]), "u16")


@settings(max_examples=60, deadline=None)
@given(enc=st.sampled_from(VALUE_ENCODINGS), v=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=200))
def test_value_encodings_round_trip(enc, v):
    x = torch.tensor(v, dtype=torch.float32)
    buf = encode_values(x, enc)
    assert buf.size == value_nbytes(len(v), enc)
    y = decode_values(buf, len(v), enc)
    if enc == "fp32":
        assert torch.equal(x, y)
    elif enc == "bf16":
        assert torch.equal(x.to(torch.bfloat16).float(), y)
    elif enc in ("sign1", "sign1c"):  # sign1c with group=None: one (bf16) scale for the block
        scale = x.abs().mean()
        if enc == "sign1c":
            scale = scale.to(torch.bfloat16).float()
        assert torch.allclose(y.abs(), scale.expand_as(y))
        if scale > 0:  # a scale that rounds to 0 decodes to (signed) zeros
            assert torch.equal(y >= 0, x >= 0)
    else:  # sign2: nearest of 4 uniform levels over [-max, max]
        s = float(x.abs().max())
        levels = torch.tensor([-1, -1 / 3, 1 / 3, 1]) * s
        err = (y - x).abs()
        assert bool((err <= (levels[1] - levels[0]) / 2 + 1e-4 * max(s, 1)).all())
        assert torch.allclose((y.unsqueeze(1) - levels).abs().min(1).values, torch.zeros_like(y), atol=1e-4 * max(s, 1))


def test_value_bytes():
    assert value_nbytes(256, "sign1") == 4 + 32 and value_nbytes(256, "sign2") == 4 + 64
    assert value_nbytes(256, "sign1c", 8) == 2 * 32 + 32 and value_nbytes(256, "sign1c") == 2 + 32
    with pytest.raises(ValueError, match="groups"):
        value_nbytes(10, "sign1c", 4)
    assert value_nbytes(256, "bf16") == 512 and value_nbytes(256, "fp32") == 1024


@settings(max_examples=40, deadline=None)
@given(g=st.integers(1, 12), k=st.integers(1, 9), data=st.data())
def test_sign1c_one_bf16_scale_per_group(g, k, data):
    """sign1c: every group of k values decodes to +-(its own mean |v|, rounded to bf16)."""
    mags = data.draw(st.lists(st.floats(0, 1e3, width=32), min_size=g, max_size=g))
    torch.manual_seed(g * 10 + k)
    x = torch.randn(g, k) * torch.tensor(mags).unsqueeze(1)
    buf = encode_values(x, "sign1c", k)
    assert buf.size == value_nbytes(g * k, "sign1c", k) == 2 * g + (g * k + 7) // 8
    y = decode_values(buf, g * k, "sign1c", k).view(g, k)
    # (the float32 mean as the payload computes it: another summation order can differ by an ulp,
    # which flips the bf16 rounding of a tie such as 197.5)
    scale = torch.from_numpy(np.abs(x.numpy()).mean(1, keepdims=True).astype(np.float32)).to(torch.bfloat16).float()
    assert torch.equal(y.abs(), scale.expand_as(y))
    live = (scale > 0).expand_as(y)  # a group whose scale rounds to 0 decodes to (signed) zeros
    assert torch.equal((y >= 0)[live], (x >= 0)[live])


# ---- DCT -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 64])
def test_dct_matrix_orthonormal_and_matches_scipy(n):
    d = dct_matrix(n).double()
    assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    x = np.random.default_rng(0).standard_normal(n)
    assert np.allclose(d.numpy() @ x, scipy.fft.dct(x, norm="ortho"), atol=1e-5)


@pytest.mark.parametrize("shape,padded,n_chunks", [((128, 64), (128, 64), 2), ((100, 70), (128, 128), 4),
                                                   ((5,), (1, 5), 1), ((200,), (1, 256), 4), ((3, 200), (3, 256), 4)])
def test_chunked_dct_padding_and_inverse(shape, padded, n_chunks):
    g = ChunkedDCT(shape, 64)
    assert (g.pr, g.pc) == padded and g.n_chunks == n_chunks
    x = torch.randn(shape)
    c = g.forward(x)
    assert c.shape == (g.n_chunks, g.chunk_numel)
    assert torch.allclose(c.norm(), x.norm(), rtol=1e-5)  # zero padding keeps the norm
    assert torch.allclose(g.inverse(c), x, atol=1e-5)
    # one chunk equals scipy's 2-D orthonormal DCT of the (zero-padded) block
    blk = torch.nn.functional.pad(x.reshape(g.rows, g.cols), (0, g.pc - g.cols, 0, g.pr - g.rows))[: g.er, : g.ec]
    ref = scipy.fft.dctn(blk.double().numpy(), norm="ortho")
    assert np.allclose(c[0].reshape(g.er, g.ec).numpy(), ref, atol=1e-5)


def test_dct_off_is_plain_chunking():
    g = ChunkedDCT((128, 64), 64, use_dct=False)
    x = torch.randn(128, 64)
    c = g.forward(x)
    assert torch.equal(c[1], x[64:].reshape(-1)) and torch.equal(g.inverse(c), x)


# ---- payload validation ----------------------------------------------------------------------

def _layout(ienc="u16", venc="fp32"):
    return PayloadLayout([TensorSpec("a.weight", (128, 64), 2, 4096, 3), TensorSpec("b.weight", (70,), 2, 64, 3)],
                         ienc, venc)


def _valid(layout, gen=0):
    g = torch.Generator().manual_seed(gen)
    t = {}
    for s in layout.specs:
        idx = torch.stack([torch.randperm(s.chunk_numel, generator=g)[: s.k] for _ in range(s.n_chunks)])
        t[s.name] = (idx, torch.randn(s.n_chunks, s.k, generator=g))
    return t


@pytest.mark.parametrize("ienc", INDEX_ENCODINGS)
@pytest.mark.parametrize("venc", VALUE_ENCODINGS)
def test_payload_round_trip(ienc, venc):
    lay = _layout(ienc, venc)
    t = _valid(lay)
    buf = lay.encode(7, 3, t)
    assert buf.size == lay.nbytes
    n, out = lay.decode(buf, peer=1, expect_step=7)
    assert n == 3
    for name, (idx, val) in t.items():
        assert torch.equal(out[name][0], idx)
        if venc == "fp32":
            assert torch.equal(out[name][1], val)


@pytest.mark.parametrize("ienc", INDEX_ENCODINGS)
@pytest.mark.parametrize("venc", VALUE_ENCODINGS)
def test_decoding_every_peer_at_once_equals_decoding_each(ienc, venc):
    lay = _layout(ienc, venc)
    bufs = [lay.encode(4, r + 1, _valid(lay, gen=r)) for r in range(3)]
    weights, tensors = lay.decode_all(bufs, [0, 1, 2], expect_step=4)
    assert weights == [1, 2, 3]
    for r, buf in enumerate(bufs):
        _, one = lay.decode(buf, peer=r, expect_step=4)
        for name, (idx, val) in one.items():
            assert torch.equal(tensors[name][0][r], idx) and torch.equal(tensors[name][1][r], val)


@pytest.mark.parametrize("kind,words", [("index", "out of range"), ("dup", "duplicate"), ("nan", "non-finite"),
                                        ("inf", "non-finite"), ("layout", "layout")])
def test_decoding_every_peer_at_once_names_the_one_at_fault(kind, words):
    lay, bad = _corrupt(kind)
    good = lay.encode(5, 1, _valid(lay))
    with pytest.raises(PayloadError, match=f"peer rank 6.*{words}"):
        lay.decode_all([good, good, bad, good], [4, 5, 6, 7], expect_step=5)


def _corrupt(kind):
    lay = _layout("u16", "fp32")
    t = _valid(lay)
    buf = lay.encode(5, 1, t)
    spec = lay.specs[1]  # b.weight: chunks of 64 elements, so 16-bit indices can be out of range
    a, b, c = lay.blocks[spec.name]
    if kind == "short":
        buf = buf[:-1]
    elif kind == "long":
        buf = np.concatenate([buf, np.zeros(2, np.uint8)])
    elif kind == "index":
        buf[a:a + 2] = np.frombuffer(np.uint16(64).tobytes(), np.uint8)
    elif kind == "dup":
        buf[a + 2:a + 4] = buf[a:a + 2]
    elif kind == "nan":
        buf[b + 4:b + 8] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    elif kind == "inf":
        buf[b:b + 4] = np.frombuffer(np.float32(-np.inf).tobytes(), np.uint8)
    elif kind == "magic":
        buf[0] = 0
    elif kind == "layout":
        buf[20] ^= 1
    return lay, buf


@pytest.mark.parametrize("kind,words", [("short", "size"), ("long", "size"), ("index", "out of range"),
                                        ("dup", "duplicate"), ("nan", "non-finite"), ("inf", "non-finite"),
                                        ("magic", "magic"), ("layout", "layout")])
def test_payload_rejects_malformed(kind, words):
    lay, buf = _corrupt(kind)
    with pytest.raises(PayloadError, match=f"peer rank 3.*{words}"):
        lay.decode(buf, peer=3, expect_step=5)


def test_payload_rejects_wrong_step_and_bad_scale():
    lay = _layout("u12", "sign1")
    buf = lay.encode(5, 1, _valid(lay))
    with pytest.raises(PayloadError, match="peer rank 2.*lock-step"):
        lay.decode(buf, peer=2, expect_step=6)
    a, b, c = lay.blocks["a.weight"]
    buf[b:b + 4] = np.frombuffer(np.float32(-1).tobytes(), np.uint8)
    with pytest.raises(PayloadError, match="peer rank 2.*a.weight.*scale"):
        lay.decode(buf, peer=2, expect_step=5)


@pytest.mark.parametrize("bad", [np.inf, np.nan, -2.0])
def test_payload_rejects_bad_per_chunk_scale(bad):
    lay = _layout("u12", "sign1c")
    buf = lay.encode(5, 1, _valid(lay))
    lay.decode(buf.copy(), peer=1, expect_step=5)  # valid as sent
    a, b, c = lay.blocks["b.weight"]
    buf[b + 2:b + 4] = torch.tensor([bad]).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").view(np.uint8)
    with pytest.raises(PayloadError, match="peer rank 1.*b.weight.*scale"):  # the second chunk's scale
        lay.decode(buf, peer=1, expect_step=5)


# ---- config, accounting, link model ----------------------------------------------------------

def test_config_checks_index_width():
    with pytest.raises(ConfigError, match="dp.chunk"):
        build_config("tiny", overrides=["dp.indices=u12", "dp.chunk=128"])
    build_config("tiny", overrides=["dp.indices=u16", "dp.chunk=128"])


def test_link_model_and_accountant():
    link = LinkModel(10, 100, 25)
    assert math.isclose(link.all_gather_s(10_000, 4), 3 * (0.025 + 10_000 * 8 / 10e6))
    assert math.isclose(link.all_reduce_s(4_000_000, 4), 6 * (0.025 + 1_000_000 * 8 / 10e6))
    assert LinkModel().all_gather_s(1 << 20, 4) == 0 and link.all_gather_s(100, 1) == 0
    acc = ByteAccountant(4, n_params=1000)
    acc.add_all_gather(100); acc.end_step(); acc.end_step()
    s = acc.summary()
    assert s["payload_bytes_per_step"] == 50 and s["payload_bytes_per_sync"] == 100
    assert s["received_bytes_per_step"] == 150 and s["ratio_payload_vs_fp32"] == 80


def test_consumer_link_preset():
    cfg = build_config("tiny", overrides=["dp.link=consumer"])
    link = LinkModel.from_config(cfg.dp)
    assert link == LinkModel(up_mbps=10, down_mbps=100, latency_ms=25)
    # 8 nodes, 1 MB each: 7 rounds of 25 ms + 1 MB at 10 Mbit/s (the upload binds)
    assert math.isclose(link.all_gather_s(1_000_000, 8), 7 * (0.025 + 0.8))
    assert make_strategy(cfg.dp, _model().named_parameters()).tr.link == link
    # without the preset the explicit fields apply; combining both is refused
    assert LinkModel.from_config(build_config("tiny", overrides=["dp.link_up_mbps=5"]).dp) == LinkModel(5, 0, 0)
    with pytest.raises(ConfigError, match="dp.link"):
        build_config("tiny", overrides=["dp.link=consumer", "dp.link_latency_ms=10"])
    with pytest.raises(ConfigError, match="dp.link"):
        build_config("tiny", overrides=["dp.link=dialup"])


def test_link_presets_match_config_choices():
    import dataclasses
    (f,) = [f for f in dataclasses.fields(DPConfig) if f.name == "link"]
    assert set(f.metadata["choices"]) == {""} | set(LINK_PRESETS)


# ---- strategies in a group of one ----------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(70, 100, bias=True), torch.nn.Tanh(), torch.nn.Linear(100, 3))


def _stepper(s, m, tc):
    """The one optimizer step over a strategy of one replica: ``step(lr, n) -> SyncStats``."""
    opt = build_optimizer(m.named_parameters(), tc, s.update_rule)

    def step(lr, n):
        return optimizer_step([HostedStage(0, s, n)], opt, lr, tc.grad_clip).stats[0]
    step.opt = opt
    return step


def _grad(m, seed):
    torch.manual_seed(seed)
    x = torch.randn(16, 70)
    m.zero_grad()
    m(x).pow(2).sum().backward()


def test_n1_demo_full_k_is_sign_sgd():
    """N=1 with every coefficient sent and exact values: DeMo is signSGD with weight decay."""
    m = _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=64 * 64, values="fp32", indices="int64", check_every=1)
    opt = TrainConfig(weight_decay=0.1, grad_clip=0.0)
    s = make_strategy(dp, m.named_parameters(), None, opt)
    step = _stepper(s, m, opt)
    for it in range(3):
        _grad(m, it)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        st = step(0.01, 1)
        assert st.synced and st.n_total == 1 and st.received_bytes == 0
        for n, p in m.named_parameters():
            exp = before[n] * (1 - 0.01 * 0.1 if p.ndim >= 2 else 1) - 0.01 * torch.sign(grads[n])
            mask = grads[n].abs() > 1e-6  # sign of ~0 gradients may flip through the DCT round trip
            assert torch.allclose(p.detach()[mask], exp[mask], atol=1e-7), n
        for mom in s.m.values():  # everything was sent: no residual
            assert float(mom.abs().max()) < 1e-6


def test_n1_demo_rms_step_rule_keeps_relative_magnitudes():
    """dp.step_rule=rms: p -= lr * d / rms(d) per tensor, so the step has the RMS of a sign step
    (lr) but follows the decoded momentum's direction, magnitudes included."""
    m = _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=64 * 64, values="fp32", indices="int64", beta=0.0,
                  step_rule="rms", check_every=1)
    s = make_strategy(dp, m.named_parameters(), None, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    step = _stepper(s, m, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    for it in range(2):
        _grad(m, it)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        step(0.01, 1)
        for n, p in m.named_parameters():
            g = grads[n]
            d = before[n] - p.detach()
            assert torch.allclose(d, 0.01 * g / g.square().mean().sqrt(), rtol=1e-4, atol=1e-8), n
            assert math.isclose(float(d.square().mean().sqrt()), 0.01, rel_tol=1e-4)
            assert not torch.allclose(d, 0.01 * torch.sign(g), atol=1e-5)  # not a sign step
    with pytest.raises(StrategyError, match="step_rule"):
        make_strategy(DPConfig(strategy="demo", step_rule="nope"), _model().named_parameters(), None, TrainConfig())


def test_n1_demo_clip_step_rule_is_sign_above_rms_and_linear_below():
    m = _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=64 * 64, values="fp32", indices="int64", beta=0.0,
                  step_rule="clip", check_every=1)
    s = make_strategy(dp, m.named_parameters(), None, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    step = _stepper(s, m, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    _grad(m, 0)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    step(0.01, 1)
    for n, p in m.named_parameters():
        g, d = grads[n], before[n] - p.detach()
        r = g / g.square().mean().sqrt()
        big = r.abs() >= 1.001
        assert bool(big.any()) and bool((~big).any()), n  # both regimes are exercised
        assert torch.allclose(d[big], 0.01 * torch.sign(g[big]), atol=1e-8), n
        assert torch.allclose(d[~big], 0.01 * r[~big], rtol=1e-3, atol=1e-8), n
        assert float(d.abs().max()) <= 0.01 + 1e-8


def test_n1_demo_update_momentum_accumulates_decoded_updates():
    """dp.update_momentum=mu: u = mu u + decoded, the step follows u (same on every replica: no bytes)."""
    m = _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=64 * 64, values="fp32", indices="int64", beta=0.0,
                  update_momentum=0.5, check_every=1)
    opt = TrainConfig(weight_decay=0.0, grad_clip=0.0)
    s = make_strategy(dp, m.named_parameters(), None, opt)
    step = _stepper(s, m, opt)
    u = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    for it, lr in enumerate((0.01, 0.02, 0.005)):
        _grad(m, it)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        for n, p in m.named_parameters():
            u[n] = 0.5 * u[n] + lr * p.grad  # everything is sent, beta=0: decoded = lr * g
        step(lr, 1)
        for n, p in m.named_parameters():
            mask = u[n].abs() > 1e-6
            assert torch.allclose(p.detach()[mask], (before[n] - lr * torch.sign(u[n]))[mask], atol=1e-7), n
    # the update momentum is part of the state (checkpoint round trip), and is required on resume
    st = s.state_dict()
    for n, _ in m.named_parameters():
        assert torch.allclose(st["tensors"][n]["update_momentum"], u[n], atol=1e-7)
    s2 = make_strategy(dp, _model().named_parameters(), None, opt)
    s2.load_state_dict(st)
    assert all(torch.equal(s2.u[n], s.u[n]) for n in s.u)
    st_plain = make_strategy(DPConfig(strategy="demo"), _model().named_parameters(), None, opt).state_dict()
    with pytest.raises(StrategyError, match="update momentum"):
        make_strategy(dp, _model().named_parameters(), None, opt).load_state_dict(st_plain)


def test_n1_demo_adam_step_rule_is_adam_on_the_decoded_gradient():
    """dp.step_rule=adam with beta=0 and every coefficient sent: decoded = lr * g, and the one
    optimizer path's AdamW applies it: torch.optim.Adam's step on g (train.beta1/beta2, eps 1e-8)."""
    m, ref = _model(), _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=64 * 64, values="fp32", indices="int64", beta=0.0,
                  step_rule="adam", check_every=1)
    opt = TrainConfig(weight_decay=0.0, grad_clip=0.0, beta1=0.9, beta2=0.95)
    s = make_strategy(dp, m.named_parameters(), None, opt)
    step = _stepper(s, m, opt)
    adam = torch.optim.Adam(ref.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    for it, lr in enumerate((0.01, 0.02, 0.005, 0.01)):
        _grad(m, it); _grad(ref, it)
        for g in adam.param_groups:
            g["lr"] = lr
        step(lr, 1)
        adam.step()
        for (n, a), b in zip(m.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=2e-6), (it, n)
    assert s.update_rule == "adamw" and isinstance(step.opt, torch.optim.AdamW)   # the moments live there


def test_n1_demo_topk_error_feedback_keeps_residual():
    m = _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=5, values="sign1", indices="u12", beta=0.9, check_every=0)
    s = make_strategy(dp, m.named_parameters(), None, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    step = _stepper(s, m, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    _grad(m, 0)
    step(0.01, 1)
    _grad(m, 1)
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    expect = {n: 0.9 * s.m[n] + 0.01 * s.geo[n].forward(grads[n]) for n in s.m}
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    sent = {}
    orig_encode = s.layout.encode

    def spy(step, n, tensors):     # what was sent: the payload as a receiver decodes it
        buf = orig_encode(step, n, tensors)
        sent.update(s.layout.decode(buf, 0)[1])
        return buf
    s.layout.encode = spy
    step(0.01, 1)
    for n, p in m.named_parameters():
        idx, q = sent[n]
        # residual = momentum minus exactly what was sent (quantised), untouched elsewhere
        sent_dense = torch.zeros_like(expect[n]).scatter_(1, idx, q)
        assert torch.allclose(s.m[n], expect[n] - sent_dense, atol=1e-7)
        # the k largest coefficients of each chunk were chosen
        kth = expect[n].abs().topk(s.k[n], dim=1).values[:, -1:]
        assert bool((expect[n].abs().gather(1, idx) >= kth - 1e-9).all())
        # N=1: the update is the sign of the inverse DCT of what was sent
        upd = s.geo[n].inverse(sent_dense)
        assert torch.allclose(p.detach(), before[n] - 0.01 * torch.sign(upd), atol=1e-7)


def test_n1_allreduce_matches_torch_adamw():
    m1, m2 = _model(), _model()
    s = make_strategy(DPConfig(strategy="allreduce"), m1.named_parameters(), None,
                      TrainConfig(weight_decay=0.0, grad_clip=0.0, beta1=0.9, beta2=0.95))
    step = _stepper(s, m1, TrainConfig(weight_decay=0.0, grad_clip=0.0, beta1=0.9, beta2=0.95))
    ref = torch.optim.AdamW(m2.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for it in range(4):
        _grad(m1, it); _grad(m2, it)
        for p in m1.parameters():
            p.grad.mul_(2)  # a sum over 2 micro-batches ...
        step(0.01, 2)     # ... divided by the count
        ref.step()
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


@pytest.mark.parametrize("strategy", ["allreduce", "allreduce_bf16", "powersgd", "diloco", "demo"])
def test_n1_every_strategy_steps_and_round_trips_state(strategy):
    m = _model()
    dp = DPConfig(strategy=strategy, topk=4, values="sign2", indices="u12", sync_every=2 if strategy == "diloco" else 1)
    s = make_strategy(dp, m.named_parameters(), None, TrainConfig())
    step = _stepper(s, m, TrainConfig())
    p0 = [p.detach().clone() for p in m.parameters()]
    for it in range(4):
        _grad(m, it)
        step(0.01, 1 if it != 2 else 0)
    assert any(not torch.equal(a, b) for a, b in zip(p0, m.parameters()))
    st = s.state_dict()
    assert st["strategy"] == strategy and st["step"] == 4
    assert set(st["tensors"]) == set(s.state_tensor_names())
    assert strategy not in ("demo", "diloco") or set(st["tensors"]) == {n for n, _ in m.named_parameters()}
    m2 = _model()
    s2 = make_strategy(dp, m2.named_parameters(), None, TrainConfig())
    step2 = _stepper(s2, m2, TrainConfig())
    s2.load_state_dict(st)
    step2.opt.load_state_dict(copy.deepcopy(step.opt.state_dict()))   # (torch shares 'step' tensors otherwise)
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m.parameters()):
            a.copy_(b)
    _grad(m, 9); _grad(m2, 9)
    step(0.01, 1); step2(0.01, 1)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_strategy_refuses_other_state():
    m = _model()
    s = make_strategy(DPConfig(strategy="demo"), m.named_parameters(), None, TrainConfig())
    with pytest.raises(StrategyError, match="strategy"):
        s.load_state_dict({"strategy": "allreduce", "step": 0, "tensors": {}})


def test_n1_sparseloco_lossless_is_diloco():
    """Every coefficient sent exactly (fp32 values, k = chunk size) and no error-feedback decay:
    SparseLoCo's outer step is DiLoCo's (same inner AdamW steps, same Nesterov outer step)."""
    tc = TrainConfig(weight_decay=0.0, grad_clip=0.0)
    ma, mb = _model(), _model()
    common = dict(sync_every=2, outer_lr=0.7, outer_momentum=0.9, check_every=1)
    sa = make_strategy(DPConfig(strategy="sparseloco", chunk=64, topk=64 * 64, values="fp32", indices="int64",
                                dct=False, ef_decay=0.0, **common), ma.named_parameters(), None, tc)
    sb = make_strategy(DPConfig(strategy="diloco", **common), mb.named_parameters(), None, tc)
    step_a, step_b = _stepper(sa, ma, tc), _stepper(sb, mb, tc)
    for it in range(6):
        _grad(ma, it)
        _grad(mb, it)
        a, b = step_a(0.01, 1), step_b(0.01, 1)
        assert a.synced == b.synced == (it % 2 == 1)
        for (n, p), q in zip(ma.named_parameters(), mb.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=lambda m: f"{it} {n}: {m}")
    assert all(float(e.abs().max()) < 1e-6 for e in sa.e.values())     # everything sent: no residual


def test_a_sync_whose_payload_is_rejected_leaves_the_residual_as_it_was():
    m = _model()
    dp = DPConfig(strategy="demo", chunk=64, topk=5, values="sign1", indices="u12", check_every=0)
    s = make_strategy(dp, m.named_parameters(), None, TrainConfig(weight_decay=0.0, grad_clip=0.0))
    acc = {n: torch.randn_like(t) for n, t in s.m.items()}
    kept = {n: t.clone() for n, t in acc.items()}

    class Garbled:              # a peer whose payload is garbage
        rank = 0

        def all_gather_bytes(self, buf):
            return [buf.copy(), np.full_like(buf, 0xFF)]
    s.sparse.tr = Garbled()
    with pytest.raises(PayloadError, match="peer rank 1"):
        s.sparse.exchange(acc, 1)
    assert all(torch.equal(acc[n], kept[n]) for n in acc)


def test_n1_sparseloco_sends_a_sparse_2bit_payload_and_keeps_the_residual():
    tc = TrainConfig(weight_decay=0.0, grad_clip=0.0)
    m = _model()
    dp = DPConfig(strategy="sparseloco", chunk=64, topk=4, values="sign2", indices="u12", sync_every=2,
                  ef_decay=0.9, check_every=0)
    s = make_strategy(dp, m.named_parameters(), None, tc)
    step = _stepper(s, m, tc)
    sent, pre = {}, {}
    orig_encode, orig_exchange = s.layout.encode, s.sparse.exchange

    def spy_encode(step_no, n, tensors):     # what was sent: the payload as a receiver decodes it
        buf = orig_encode(step_no, n, tensors)
        sent.update(s.layout.decode(buf, 0)[1])
        return buf

    def spy_exchange(acc, weight):
        pre.update({n: t.clone() for n, t in acc.items()})
        return orig_exchange(acc, weight)
    s.layout.encode, s.sparse.exchange = spy_encode, spy_exchange
    anchor = {n: p.detach().clone() for n, p in m.named_parameters()}
    for it in range(2):
        _grad(m, it)
        st = step(0.01, 1)
    assert st.synced and st.payload_bytes == s.payload_bytes
    n_params = sum(p.numel() for p in m.parameters())
    assert 4 * n_params / s.payload_bytes > 20                   # a small fraction of the fp32 bytes
    for n, p in m.named_parameters():
        idx, q = sent[n]
        assert q.unique().numel() <= 4 or q.numel() <= 4          # one 2-bit code per value: 4 levels
        sent_dense = torch.zeros_like(pre[n]).scatter_(1, idx, q)
        assert torch.allclose(s.e[n], pre[n] - sent_dense, atol=1e-7)          # residual stays local
        d = s.sparse.geo[n].inverse(sent_dense)                                 # N=1: the average is what was sent
        assert torch.allclose(p.detach(), anchor[n] - 0.7 * (d + 0.9 * d), atol=1e-6)   # Nesterov from zero


def test_ring_links_delay_each_round_by_the_slowest_ring_link_for_the_scaled_bytes():
    from skiptrain.dp.link import RingLinks

    ring = RingLinks(latency_s=(0.01, 0.02, 0.005), s_per_byte=(1e-6, 1e-7, 2e-6), byte_scale=4.0)
    # all-gather of 1000 B per node over 3: 2 rounds, each the slowest of lat + 4000 B x s/B
    slowest = max(0.01 + 4000 * 1e-6, 0.02 + 4000 * 1e-7, 0.005 + 4000 * 2e-6)
    assert ring.all_gather_s(1000, 3) == pytest.approx(2 * slowest)
    # all-reduce of 3000 B: 4 rounds of a 1000-byte piece
    assert ring.all_reduce_s(3000, 3) == pytest.approx(4 * slowest)
    assert ring.all_gather_s(1000, 1) == 0.0 and not RingLinks().enabled


def test_the_freeze_rule_sees_mean_gradients_not_the_signs_of_a_direction_strategy():
    """DeMo's update is a sign direction, the same norm for a layer that still learns and one
    that has converged: what ``inspect`` gets for such a stage is the replica's mean gradient."""
    cfg = build_config("tiny", overrides={"dp": {"strategy": "demo", "topk": 4}})
    model = _model()
    strat = make_strategy(cfg.dp, model.named_parameters(), None, cfg.train)
    opt = build_optimizer(model.named_parameters(), cfg.train, strat.update_rule)
    grads = {n: torch.randn_like(p) * (i + 1) for i, (n, p) in enumerate(model.named_parameters())}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    seen = {}
    optimizer_step([HostedStage(0, strat, 2)], opt, 1e-3, 1.0, inspect=seen.update)
    assert strat.update_rule == "direction" and seen.keys() == grads.keys()
    assert all(torch.allclose(seen[n], grads[n] / 2) for n in grads)
