import random

import pytest
import torch

from skiptrain.config import build_config
from skiptrain.errors import UserError
from skiptrain.model import StagedLM, best_partition, partition_layers
from skiptrain.model.device import autocast, build_on_device
from skiptrain.model.memory import GiB, check_fits, estimate_node_memory, estimate_stage_memory, stage_params
from skiptrain.model.transformer import is_meta
from skiptrain.optim import build_adamw


def tiny(**over):
    return build_config("tiny", overrides={"model": over} if over else None).model


def flat_reference(model: StagedLM, tokens: torch.Tensor, layer_order) -> torch.Tensor:
    """Apply embedding, the given layers one by one, norm and head: the unsplit model by hand."""
    h = model.tok_emb(tokens)
    for i in layer_order:
        h = model.layers[str(i)](h, model.rope_cos, model.rope_sin)
    return model.head(model.norm(h))


def test_full_route_equals_unsplit_model_bitwise():
    cfg = tiny(n_layers=6, n_stages=4, stage0_layers=-1)
    m = StagedLM(cfg, seed=3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    assert torch.equal(m(x), flat_reference(m, x, range(cfg.n_layers)))


def test_stage_modules_chained_equal_whole_model_bitwise():
    """Nodes that each build only their stage compute exactly what the whole model computes."""
    cfg = tiny(n_layers=6, n_stages=4, stage0_layers=0)
    whole = StagedLM(cfg, seed=5)
    nodes = {s: StagedLM(cfg, stages=[s], seed=5) for s in range(cfg.n_stages)}
    x = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    h = nodes[0].embed(x)
    for s in (1, 2, 3):
        h = nodes[s].run_stage(s, h)
    assert torch.equal(nodes[0].logits(h), whole(x))
    names = {n for node in nodes.values() for n, _ in node.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}


@pytest.mark.parametrize("route", [[2], [1, 3], [3, 1], [2, 1, 3], []])
def test_skip_route_equals_layer_blocks_by_hand(route):
    cfg = tiny(n_layers=7, n_stages=4, stage0_layers=1)
    m = StagedLM(cfg, seed=1)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    order = list(m.partition.layers(0)) + [i for s in route for i in m.partition.layers(s)]
    assert torch.equal(m(x, route=route), flat_reference(m, x, order))


def test_stage0_in_route_rejected():
    cfg = tiny()
    m = StagedLM(cfg)
    with pytest.raises(ValueError, match="stage 0 is implicit"):
        m(torch.zeros(1, 4, dtype=torch.long), route=[0, 1])


def test_gqa_and_mha_shapes_and_loss():
    for kv in (0, 1, 2):
        cfg = tiny(n_kv_heads=kv)
        m = StagedLM(cfg)
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        logits, loss = m(x, x)
        assert logits.shape == (2, 16, cfg.vocab_size)
        assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 1.0


def test_causality():
    cfg = tiny()
    m = StagedLM(cfg, seed=2)
    x = torch.randint(0, cfg.vocab_size, (1, 20))
    y = x.clone()
    y[0, 15:] = (y[0, 15:] + 1) % cfg.vocab_size
    assert torch.equal(m(x)[0, :15], m(y)[0, :15])


def brute_force(costs, S, extra):
    n = len(costs)
    best = None
    def rec(i, k, acc):
        nonlocal best
        if k == S:
            if i == n:
                stage = [extra + sum(costs[:acc[0]])] + [sum(costs[a:b]) for a, b in zip(
                    [sum(acc[:j]) for j in range(1, S)], [sum(acc[:j + 1]) for j in range(1, S)])]
                key = (max(stage), sum(c * c for c in stage))
                if best is None or key < best[0]:
                    best = (key, tuple(acc))
            return
        lo = 0 if k == 0 else 1
        for c in range(lo, n - i + 1):
            rec(i + c, k + 1, acc + [c])
    rec(0, 0, [])
    return best


def test_partitioner_matches_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        n, S = rng.randint(3, 8), rng.randint(2, 4)
        if n < S - 1:
            continue
        costs = [rng.uniform(0.5, 2.0) for _ in range(n)]
        extra = rng.uniform(0, 3)
        p = best_partition(costs, S, extra)
        stage = [extra + sum(costs[i] for i in p.layers(0))] + [sum(costs[i] for i in p.layers(s)) for s in range(1, S)]
        assert (max(stage), sum(c * c for c in stage)) == pytest.approx(brute_force(costs, S, extra)[0])
        assert all(c >= 1 for c in p.counts[1:]) and p.n_layers == n


def test_partitioner_charges_stage0_for_the_head():
    """A large vocabulary makes the head expensive: stage 0 then gets fewer layers than equal counts would."""
    cfg = build_config("small", overrides={"model": {"n_layers": 12, "n_stages": 4, "vocab_size": 32000}}).model
    p = partition_layers(cfg)
    assert p.counts[0] < 3 and p.n_layers == 12
    assert p.counts[0] < max(p.counts[1:])


def test_pinned_stage0_layers():
    p = partition_layers(tiny(n_layers=6, n_stages=3, stage0_layers=2))
    assert p.counts[0] == 2 and sum(p.counts) == 6


def test_1b_preset_builds_stage_2_of_8_on_meta_without_allocating():
    cfg = build_config("1b").model
    assert cfg.n_stages == 8
    m = StagedLM(cfg, stages=[2], device="meta")
    assert all(p.is_meta for p in m.parameters()) and m.num_parameters() > 0
    assert not hasattr(m, "tok_emb") and not hasattr(m, "head")   # other stages never built
    assert {int(n.split(".")[1]) for n, _ in m.named_parameters()} == set(m.partition.layers(2))
    assert m.num_parameters() == stage_params(cfg, 2)
    whole = StagedLM(cfg, device="meta")
    assert 1.0e9 < whole.num_parameters() < 1.2e9
    assert whole.num_parameters() == sum(stage_params(cfg, s) for s in range(cfg.n_stages))


@pytest.mark.parametrize("stage", [0, 2])
def test_materialized_meta_stage_equals_cpu_build(stage):
    cfg = tiny(n_layers=6, n_stages=4, stage0_layers=1)
    built = StagedLM(cfg, stages=[stage], seed=7)
    meta = StagedLM(cfg, stages=[stage], seed=7, device="meta")
    assert is_meta(meta) and not is_meta(built)
    meta.materialize("cpu")
    assert not is_meta(meta)
    ref = dict(built.named_parameters())
    for n, p in meta.named_parameters():
        assert torch.equal(p, ref[n]), n
    assert torch.equal(meta.rope_cos, built.rope_cos) and torch.equal(meta.rope_sin, built.rope_sin)
    h = torch.randn(2, cfg.seq_len, cfg.d_model)
    if stage == 0:
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        assert torch.equal(meta.logits(meta.embed(x)), built.logits(built.embed(x)))
    else:
        assert torch.equal(meta.run_stage(stage, h), built.run_stage(stage, h))


@pytest.mark.parametrize("stage", [0, 2])
def test_memory_estimate_of_parameters_and_optimizer_matches_materialized(stage):
    cfg = build_config("small").model
    m = StagedLM(cfg, stages=[stage], seed=1)
    opt = build_adamw(m.named_parameters(), build_config("small").train)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    measured = sum(t.numel() * t.element_size() for t in m.parameters())
    measured += sum(p.grad.numel() * p.grad.element_size() for p in m.parameters())
    measured += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                    if torch.is_tensor(t))
    est = estimate_stage_memory(cfg, stage, micro_batch=8, in_flight=3)
    assert est.params == m.num_parameters()
    assert abs(est.param_bytes + est.grad_bytes + est.optimizer_bytes - measured) <= 0.1 * measured


def test_memory_estimate_bf16_activations_and_refusal():
    cfg = build_config("1b").model
    fp32 = estimate_stage_memory(cfg, 2, micro_batch=2, in_flight=3, precision="fp32")
    bf16 = estimate_stage_memory(cfg, 2, micro_batch=2, in_flight=3, precision="bf16")
    assert bf16.activation_bytes < fp32.activation_bytes and bf16.param_bytes == fp32.param_bytes
    one = estimate_stage_memory(cfg, 2, micro_batch=2, in_flight=1, precision="bf16")
    copies = 2 * one.params         # autocast's bf16 weight copies, once per iteration
    assert bf16.activation_bytes - copies == 3 * (one.activation_bytes - copies)
    node = estimate_node_memory(cfg, [1, 2], micro_batch=2, in_flight=3, precision="bf16")
    assert node.total_bytes == bf16.total_bytes + estimate_stage_memory(cfg, 1, 2, 3, "bf16").total_bytes
    assert node.describe().startswith("stages 1, 2: ")
    check_fits(bf16, 80 * GiB, "cuda:0")
    with pytest.raises(UserError, match=r"stage 2: .* does not fit cuda:0 \(2.00 GiB\); use more stages") as e:
        check_fits(bf16, 2 * GiB, "cuda:0")
    assert "\n" not in str(e.value) and "bf16" not in str(e.value).split("; ")[1]
    with pytest.raises(UserError, match=r"smaller train.micro_batch or train.precision=bf16$"):
        check_fits(fp32, 2 * GiB, "cuda:0")


def saved_activation_bytes(m: StagedLM, stage: int, samples: int, precision: str) -> int:
    """Bytes of the tensors autograd saves for one micro-batch through ``stage`` (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    h = torch.randn(samples, m.cfg.seq_len, m.cfg.d_model, requires_grad=True)
    with autocast(torch.device("cpu"), precision), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.run_stage(stage, h)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_estimate_of_a_body_stage_matches_saved_tensors(precision):
    cfg = build_config("small").model
    m = StagedLM(cfg, stages=[2], seed=1)
    measured = saved_activation_bytes(m, 2, 4, precision)
    est = estimate_stage_memory(cfg, 2, micro_batch=4, in_flight=1, precision=precision)
    assert abs(est.activation_bytes - measured) <= 0.1 * measured


def test_build_on_device_materialises_only_the_stages_and_refuses_what_cannot_fit():
    cfg = tiny(n_layers=6, n_stages=4, stage0_layers=1)
    model, est = build_on_device(cfg, [1, 3], 7, torch.device("cpu"), micro_batch=2, in_flight=2, precision="bf16")
    ref = dict(StagedLM(cfg, seed=7).named_parameters())
    assert model.stages == [1, 3] and not is_meta(model) and est.stages == (1, 3)
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())
    with pytest.raises(UserError, match="^stage 1: .* does not fit cpu"):
        build_on_device(cfg, [1], 7, torch.device("cpu"), micro_batch=10**9, in_flight=1, precision="fp32")
