"""The emulation seam: what a phase asks for, and what the node gets from it."""

import time

from skiptrain.config import build_config
from skiptrain.net.topology import load_topology
from skiptrain.runtime.emulation import Emulation
from skiptrain.runtime.executor import BWD, FWD
from skiptrain.runtime.job import EmulationSpec, Job, Phase, build_cost, phase_from_dict
from skiptrain.runtime.node.stats import IterationStats


class _Transport:
    pacing = "unset"


def test_a_job_file_from_before_the_spec_loads_with_the_same_settings():
    old = {"name": "p", "schedule": {}, "wan": True, "bytes_scale": 64.0, "emulate_compute": True,
           "emulate_sync": False}
    assert phase_from_dict(old).emulation == EmulationSpec(links=True, compute=True, sync=False, bytes_scale=64.0)
    assert phase_from_dict({"name": "p", "schedule": {}}).emulation is None
    job = Job(config={}, data_path="d", run_dir="r", phases=[Phase("p", {}, emulation=EmulationSpec(sync=True))])
    assert Job.from_dict(job.to_dict()).phases[0].emulation == EmulationSpec(sync=True)


def test_without_a_spec_nothing_is_emulated_and_the_node_is_still_measured():
    emu = Emulation(Phase("p", {}), load_topology("cluster", 4), None, rank=1)
    tr = _Transport()
    emu.pace(tr)
    assert tr.pacing is None and emu.sync_link([0, 1, 2]) is None
    start = time.time()
    assert emu.finish(FWD, 1, start) - start < 0.05           # a task ends when its compute ends
    emu.iteration_started(0.003)
    stats = IterationStats()
    emu.add_stats(stats)
    assert set(stats.columns) == {"overruns", "overrun_s", "cpu_s", "start_delay"}
    assert stats.packed()[3] == 0.003


def test_emulated_compute_pads_each_task_to_the_cost_model_at_the_node_speed():
    """The padding is the compute only: the cost model's per-task overhead is the runtime's own."""
    cfg = build_config("tiny")
    cost = build_cost(cfg, s_per_sample_layer=0.01)
    topo = load_topology("cluster", 4)
    emu = Emulation(Phase("p", {}, emulation=EmulationSpec(compute=True, links=True, sync=True)), topo, cost, rank=2)
    assert emu.task_s(FWD, 1) == cost.fwd_compute_s(1, topo.speed(2)) > 0.001
    assert emu.task_s(BWD, 1) == cost.bwd_compute_s(1, topo.speed(2))
    start = time.time()
    end = emu.finish(FWD, 1, start)
    assert end - start >= emu.task_s(FWD, 1) * 0.99
    tr = _Transport()
    emu.pace(tr)
    assert tr.pacing is not None and emu.sync_link([0, 1]) is not None
    emu.speed = emu.base_speed / 4                              # a node that slows down
    assert emu.task_s(FWD, 1) == cost.fwd_compute_s(1, topo.speed(2) / 4)
