"""Unequal compute: the planner, the placement and the simulator use each node's speed."""

import numpy as np
import pytest

from skiptrain.net.topology import Node, Topology, random_topology
from skiptrain.schedule.compare import compare
from skiptrain.schedule.cost import CostModel, reference_cost
from skiptrain.schedule.planner import PlanConfig, plan
from skiptrain.schedule.simulator import simulate


def uniform(speeds):
    n = len(speeds)
    return Topology([Node(i, "dc", s) for i, s in enumerate(speeds)], np.full((n, n), 0.001),
                    np.full((n, n), 1e9))


def test_a_slow_replica_gets_fewer_visits():
    speeds = [1.0] * 9
    speeds[8] = 0.25
    topo = uniform(speeds)
    cost = CostModel(d_model=64, tokens_per_sample=64, samples=2, layers_per_stage=[2] * 3,
                     s_per_sample_per_layer=0.05, hop_overhead_s=0.01, dp_mode="none")
    s = plan(topo, cost, PlanConfig(n_stages=3, stage_sizes=[3, 3, 3], skip_ratio=0.0, memory=3,
                                    mb_per_originator=4, seed=0, contention=False, dp_sync=False,
                                    max_evals=300, placement=[[0, 1, 2], [3, 4, 5], [6, 7, 8]]))
    visits = s.node_visits()
    assert visits[8] < min(visits[6], visits[7])
    # the simulator charges the slow node 4x per task
    r = simulate(s, topo, cost, contention=False, dp_sync=False)
    per_task = r.node_busy_s[8] / visits[8]
    assert per_task == pytest.approx(4 * r.node_busy_s[6] / visits[6])


@pytest.mark.parametrize("seed", range(5))
def test_planner_beats_full_pipeline_on_unequal_speeds(seed):
    topo = random_topology(20, seed=seed, n_regions=6)
    assert len({nd.location for nd in topo.nodes}) >= 5
    assert max(nd.speed for nd in topo.nodes) / min(nd.speed for nd in topo.nodes) > 1.5
    cfg = PlanConfig(n_stages=6, skip_ratio=0.33, memory=3, mb_per_originator=6, seed=0, max_evals=400,
                     placements=2, constructions=4)
    t = compare(topo, reference_cost(), cfg, contention=False, dp_sync=False,
                methods=("full_pipeline", "planner")).iteration_s()
    assert t["planner"] <= 0.65 * t["full_pipeline"]
