"""bench/gpu.py: says it needs CUDA and exits 0 without one; its measuring code runs on any device.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_bench_gpu.py."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch


SPEC = importlib.util.spec_from_file_location("bench_gpu", Path(__file__).parents[2] / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would measure")
def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys):
    assert gpu.main(["--quick", "--json", str(tmp_path / "r.json")]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text()) == {"cuda": False, "measured": False}


def test_measuring_code_runs_on_the_cpu_with_a_tiny_preset(capsys, tmp_path):
    res = gpu.measure("tiny", "cpu", steps=2, warmup=1, quick=True, overrides={"model": {"seq_len": 32}},
                      keep=tmp_path)
    assert res["device"] == "cpu" and res["tokens_per_step"] == 4 * 2 * 32
    for which in ("skiptrain", "plain"):
        assert res[which]["tok_s"] > 0 and res[which]["model_tflops"] > 0
    gpu.print_table(res, None)
    out = capsys.readouterr().out
    assert "plain PyTorch loop" in out and "n/a" in out and "not measured" in out
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0 and gpu.peak_tflops("Mystery", None) is None
