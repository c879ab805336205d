"""train.precision (bf16 autocast, fp32 master state) and train.device on the one-process trainer."""

import pytest
import torch

from skiptrain.config import build_config
from skiptrain.errors import UserError
from skiptrain.model.device import autocast, resolve_device, to_device
from bench._elastic_trainer import ElasticTrainer
from skiptrain.train.trainer import Trainer


def cfg_for(data, **train):
    return build_config("tiny", overrides={"data": {"path": str(data)},
                                           "train": {"progress": False, "steps": 100, **train}})


def run(data, steps, **train):
    tr = Trainer(cfg_for(data, **train))
    return tr, [tr.train_step().loss for _ in range(steps)]


def test_bf16_lowers_the_loss_like_fp32_with_fp32_master_state(byte_data):
    fp32, l32 = run(byte_data, 50, precision="fp32")
    bf16, l16 = run(byte_data, 50, precision="bf16")
    assert l16[0] != l32[0]                              # autocast really ran in bf16
    assert abs(l16[0] - l32[0]) < 0.02 * l32[0]
    end32, end16 = sum(l32[-10:]) / 10, sum(l16[-10:]) / 10
    assert end32 < 0.8 * l32[0]                          # fp32 learned
    assert abs(end16 - end32) <= 0.02 * end32, (end16, end32)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    state = [t for st in bf16.opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    v16 = bf16.validate()
    assert abs(v16 - fp32.validate()) < 0.05 * v16


def test_autocast_contexts():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast(torch.device("cpu"), "bf16"):
        assert lin(x).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert lin(x).dtype == torch.float32
    with pytest.raises(UserError, match="train.precision"):
        autocast(torch.device("cpu"), "fp16")


def test_device_resolution_and_batches_on_cpu(byte_data):
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(UserError, match="train.device=cuda but this torch sees no CUDA device"):
            resolve_device("cuda")
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t
    tr = Trainer(cfg_for(byte_data, device="cpu"))
    assert tr.device == torch.device("cpu") and all(p.device == tr.device for p in tr.model.parameters())


def test_the_elastic_bench_harness_refuses_bf16(byte_data):
    cfg = cfg_for(byte_data, precision="bf16")
    cfg.elastic.enabled = True
    with pytest.raises(UserError, match="ElasticTrainer runs on the CPU in fp32 only"):
        ElasticTrainer(cfg)


def test_bf16_trainer_runs_forward_and_backward_matmuls_in_bf16(byte_data):
    tr = Trainer(cfg_for(byte_data, precision="bf16"))
    seen, grads = set(), set()
    for n, m in tr.model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, i, o: seen.add(o.dtype))
            m.register_full_backward_hook(lambda mod, gi, go: grads.add(go[0].dtype))
    tr.train_step()
    assert seen == {torch.bfloat16} and grads == {torch.bfloat16}


def test_trainer_refuses_a_model_that_cannot_fit_its_device(byte_data):
    with pytest.raises(UserError, match=r"^stages 0, 1, 2, 3: .* does not fit cpu \(.* GiB\); use more stages"):
        Trainer(cfg_for(byte_data, micro_batch=10**6))
