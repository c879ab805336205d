"""bench/gpu.py: says it needs CUDA and exits 0 without one; its measuring code runs on any device.

The units (no process started) are in tests/unit/test_bench_gpu_units.py."""

from unit.test_bench_gpu_units import gpu


def test_swarm_measuring_code_runs_four_nodes_on_the_cpu(capsys, tmp_path):
    sw = gpu.measure_swarm("tiny", "cpu", iterations=3, warmup=1, quick=True,
                           overrides={"train": {"precision": "bf16"}}, keep=tmp_path / "swarm")
    assert sw["nodes"] == 4 and sw["devices"] == "cpu,cpu,cpu,cpu" and sw["iterations"] == 3
    assert sw["tokens_per_iteration"] == 2 * 4 * 64
    assert 0 < sw["median_iteration_s"] <= sw["median_period_s"] and sw["tok_s"] >= sw["tok_s_period"] > 0
    res = gpu.measure("tiny", "cpu", steps=1, warmup=0, quick=True, overrides={"model": {"seq_len": 32}},
                      keep=tmp_path / "loops")
    gpu.print_table({**res, "swarm": sw}, None)
    assert "4-node swarm, one GPU" in capsys.readouterr().out
