"""A swarm node's device and precision: per-node device resolution, its refusals, the host
staging of messages, and the sync strategies' state on their parameters' device."""

from __future__ import annotations

import pytest
import torch

from skiptrain.config import ConfigError, DPConfig, TrainConfig, build_config
from skiptrain.dp import make_strategy
from skiptrain.errors import UserError
from skiptrain.model.device import node_device, to_host_async
from skiptrain.runtime.preflight import device_of_node

NO_CUDA = not torch.cuda.is_available()


def _cfg(**sections):
    return build_config("tiny", overrides={"runtime": {"nodes": 4}, **sections})


def test_each_node_takes_its_entry_of_runtime_devices_or_train_device():
    cfg = _cfg(runtime={"nodes": 4, "devices": "cpu, auto,cpu,cpu"}, train={"device": "cpu"})
    assert [device_of_node(cfg, n, n) for n in (0, 2, 3)] == [torch.device("cpu")] * 3
    assert node_device("cpu", [], 7, 7) == torch.device("cpu")          # beyond the list: train.device
    assert node_device("cuda", ["cpu"], 0, 3) == torch.device("cpu")    # the list wins over train.device
    if NO_CUDA:
        assert device_of_node(cfg, 1, 1) == torch.device("cpu")         # auto without a GPU
    else:
        assert node_device("cuda", [], 5, 5) == torch.device("cuda", 5 % torch.cuda.device_count())


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: cuda entries resolve")
def test_a_cuda_node_without_cuda_is_refused_naming_its_setting():
    with pytest.raises(UserError, match=r"runtime.devices \(node 1\)=cuda:1 but this torch sees no CUDA device"):
        device_of_node(_cfg(runtime={"nodes": 2, "devices": "cpu,cuda:1"}), 1, 1)
    with pytest.raises(UserError, match="train.device=cuda but this torch sees no CUDA device"):
        device_of_node(_cfg(train={"device": "cuda"}), 0, 0)


def test_bad_device_lists_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="runtime.devices entry 'gpu0' is not a device"):
        _cfg(runtime={"nodes": 2, "devices": "cpu,gpu0"})
    with pytest.raises(ConfigError, match="lists 3 device.s. for runtime.nodes=4; list one device per node"):
        _cfg(runtime={"nodes": 4, "devices": "cpu,cpu,cpu"})


def test_nccl_replica_sync_and_elastic_off_cpu_are_refused():
    with pytest.raises(UserError, match="dp.backend=nccl needs every replica on a CUDA device, but node 2 computes on "
                                        "cpu; set dp.backend=gloo"):
        device_of_node(_cfg(dp={"backend": "nccl"}, train={"device": "cpu"}), 2, 2)
    with pytest.raises(ConfigError, match="dp.backend"):
        _cfg(dp={"backend": "mpi"})
    if not NO_CUDA:
        with pytest.raises(UserError, match="elastic.enabled"):
            device_of_node(_cfg(elastic={"enabled": True}, train={"device": "cuda"}), 0, 0)


def test_auto_is_the_cpu_in_an_elastic_swarm_even_beside_a_gpu(monkeypatch):
    """The embedded demo freezes layers (an elastic swarm runs on the CPU) with train.device=auto:
    on a machine with a GPU its nodes take the CPU, and an explicit GPU is
    refused.  (A GPU is pretended: ``auto`` would pick ``cuda`` without the elastic rule.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_of_node(_cfg(), 0, 0) == torch.device("cuda", 0)                  # auto beside a GPU
    elastic = _cfg(elastic={"enabled": True})
    assert [device_of_node(elastic, n, n) for n in range(4)] == [torch.device("cpu")] * 4
    listed = _cfg(elastic={"enabled": True}, runtime={"nodes": 2, "devices": "auto,cuda:0"})
    assert device_of_node(listed, 0, 0) == torch.device("cpu")
    with pytest.raises(UserError, match="elastic.enabled"):
        device_of_node(listed, 1, 1)


def test_host_staging_is_a_no_op_on_the_cpu():
    t = torch.randn(3, 4)
    host, done = to_host_async(t)
    assert host is t and done is None


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_host_staging_of_a_cuda_tensor_is_pinned_and_exact():
    t = torch.randn(64, 128, device="cuda")
    host, done = to_host_async(t)
    done.synchronize()
    assert host.is_pinned() and torch.equal(host, t.cpu())


@pytest.mark.parametrize("strategy", ["allreduce", "allreduce_bf16", "powersgd", "diloco", "demo", "sparseloco"])
def test_every_strategy_keeps_its_state_on_the_parameters_device(strategy):
    """Parameters on the meta device (no memory, no values): a state tensor created anywhere
    else (the CPU) shows up as such, and the first exchange mixes devices only if a strategy
    creates a tensor off the parameters' device."""
    torch.manual_seed(0)
    named = [("w", torch.nn.Parameter(torch.empty(48, 32, device="meta"))),
             ("b", torch.nn.Parameter(torch.empty(32, device="meta")))]
    s = make_strategy(DPConfig(strategy=strategy, chunk=16, topk=4), named, None, TrainConfig())
    assert s.device == torch.device("meta")
    tensors = [t for ts in s.state_dict()["tensors"].values() for t in ts.values()]
    assert all(t.device.type == "meta" for t in tensors), strategy
    grads = {n: torch.zeros_like(p) for n, p in named}
    if strategy in ("allreduce", "allreduce_bf16", "diloco"):
        assert all(t.device.type == "meta" for t in s.exchange(grads, 2, 1e-3).values())
    elif strategy == "powersgd":     # its buffers are built, then the count is read: a meta tensor has no value
        with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
            s.exchange(grads, 2, 1e-3)


def test_bf16_messages_name_their_codec_and_arrive_as_float32():
    from skiptrain.runtime.transport import (ACT, GRAD, LocalTransport, decode_header, decode_payload, encode_header,
                                             encode_payload, payload_buffer)

    assert decode_header(encode_header(GRAD, 1, 2, 0, (2, 4, 8), "bf16")) == (GRAD, 1, 2, 0, (2, 4, 8), "bf16")
    x = torch.randn(2, 4, 8)
    wire = encode_payload(x, "bf16")
    assert wire.numel() == payload_buffer((2, 4, 8), "bf16").numel() == 2 * x.numel()
    got = decode_payload(wire, "bf16", (2, 4, 8))
    assert got.dtype == torch.float32 and torch.equal(got, x.to(torch.bfloat16).float())
    tr = LocalTransport(0, "bf16")
    tr.send(0, ACT, 3, 1, x)
    assert torch.equal(tr.inbox.get_nowait().tensor, got)


def test_a_swarm_node_s_stages_are_checked_together_on_its_device(monkeypatch):
    """Each stage alone fits the device, the node serving three of them does not: refused naming
    that node, whether the layout is the planned one or runtime.node_stages."""
    import skiptrain.model.device as device
    from skiptrain.model.memory import StageMemoryError, estimate_node_memory
    from skiptrain.runtime.preflight import check_swarm_memory

    cfg = _cfg(runtime={"nodes": 4, "memory": 64}, train={"device": "cpu"})
    t = cfg.train

    def est(stages):
        return estimate_node_memory(cfg.model, stages, t.micro_batch, 64, t.precision).total_bytes

    budget = max(est([s]) for s in range(4)) + 1
    assert est([1, 2, 3]) > budget
    monkeypatch.setattr(device, "device_memory_bytes", lambda dev: budget)
    check_swarm_memory(cfg)                              # before planning: each stage on some node
    check_swarm_memory(cfg, {0: [0], 1: [1], 2: [2], 3: [3]})
    with pytest.raises(StageMemoryError, match=r"^stages 1, 2, 3: .* does not fit node 1's cpu \("):
        check_swarm_memory(cfg, {0: [0], 1: [1, 2, 3]})
    cfg.runtime.nodes, cfg.runtime.node_stages = 2, "0,1+2+3"
    with pytest.raises(StageMemoryError, match=r"^stages 1, 2, 3: .* does not fit node 1's cpu \("):
        check_swarm_memory(cfg)
