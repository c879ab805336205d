"""The planner re-plans the routes for the nodes that remain after a failure
(``runtime/drift.py::replan_routes`` on a schedule whose node ids are not 0..n-1)."""

from __future__ import annotations

from skiptrain.config import build_config
from skiptrain.net.topology import geo12
from skiptrain.runtime.drift import replan_routes
from skiptrain.runtime.recovery import replan
from skiptrain.schedule.cost import CostModel
from skiptrain.schedule.planner import PlanConfig, plan
from skiptrain.schedule.routes import check_route
from skiptrain.schedule.schedule import SKIP_CLAIMS
from skiptrain.schedule.simulator import simulate


def _cost(S):
    return CostModel(d_model=64, tokens_per_sample=128, samples=2, layers_per_stage=[2] * S,
                     s_per_sample_per_layer=0.01, hop_overhead_s=0.01)


def test_replan_routes_on_survivors_with_non_contiguous_ids_keeps_ids_and_placement():
    topo, cost = geo12(12), _cost(4)
    cfg = build_config("tiny")
    s = plan(topo, cost, PlanConfig(n_stages=4, stage_sizes=[3, 3, 3, 3], skip_ratio=0.0, memory=2,
                                    mb_per_originator=2, seed=1, dp_sync=False, max_evals=60))
    dead = min(s.placement[1])                       # not the highest id: ids get a gap
    rep = replan(s, set(range(12)) - {dead})
    nodes = sorted(n for p in rep.placement for n in p)
    assert nodes != list(range(len(nodes)))              # ids no longer equal positions
    new, cur, ns = replan_routes(rep, topo, cost, cfg, min_gain=0.0, max_evals=60)
    assert new is not None, (cur, ns)
    assert new.placement == rep.placement
    assert sorted(m.id for m in new.micro_batches) == sorted(m.id for m in rep.micro_batches)
    assert dead not in {n for m in new.micro_batches for n in [m.originator, *m.nodes]}
    new.validate(claims=SKIP_CLAIMS)
    for m in new.micro_batches:
        assert m.originator in new.placement[0]
        assert all(n in new.placement[st] for st, n in m.route)
        check_route(m.stages, 4, 3, new.max_swaps)
    cur_full = simulate(rep, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
    new_full = simulate(new, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
    assert ns <= cur and new_full <= cur_full + 1e-9


def test_replan_routes_gives_up_when_a_stage_has_no_replica():
    topo, cost = geo12(8), _cost(4)
    s = plan(topo, cost, PlanConfig(n_stages=4, stage_sizes=[2, 2, 2, 2], skip_ratio=0.0, memory=2,
                                    mb_per_originator=2, seed=1, dp_sync=False, max_evals=30))
    rep = replan(s, set(range(8)) - set(s.placement[2]))
    new, cur, ns = replan_routes(rep, topo, cost, build_config("tiny"), min_gain=0.0, max_evals=30)
    assert new is None and ns is None
