"""The per-task overhead (``CostModel.fwd_task_s`` / ``bwd_task_s``) is charged the same way by
the simulator, the planner's constructions, the placement estimate and every baseline."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skiptrain.net.topology import geo12, random_topology
from skiptrain.schedule.compare import METHODS, compare
from skiptrain.schedule.cost import CostModel, CostError, published_cost
from skiptrain.schedule.fit import done_times, fit_task_overhead
from skiptrain.schedule.construction import RouteContext
from skiptrain.schedule.planner import PlanConfig, plan
from skiptrain.schedule.schedule import MicroBatch, Schedule
from skiptrain.schedule.simulator import simulate


def _cost(S=4, f=0.0, b=0.0):
    return CostModel(d_model=64, tokens_per_sample=64, samples=2, layers_per_stage=[2] * S,
                     s_per_sample_per_layer=0.05, hop_overhead_s=0.05, fwd_task_s=f, bwd_task_s=b)


def _tasks(sched):
    """(forward tasks incl. loss, backward tasks) per node of ``sched``."""
    fw, bw = Counter(), Counter()
    for mb in sched.micro_batches:
        for n in (mb.originator, *mb.nodes):
            fw[n] += 1
            bw[n] += 1
        fw[mb.originator] += 1          # the loss
    return fw, bw


@settings(max_examples=25, deadline=None)
@given(f=st.floats(0.0, 2.0), b=st.floats(0.0, 2.0), seed=st.integers(0, 50), visits=st.integers(0, 3))
def test_one_micro_batch_pays_every_task_overhead_once(f, b, seed, visits):
    """Alone on the network, a micro-batch of ``v`` body visits takes exactly ``(v + 2) f + (v + 1) b``
    longer: v + 1 forwards and the loss, v + 1 backwards."""
    topo = random_topology(5, seed=seed)
    route = [(s, s) for s in range(1, visits + 1)]
    sched = Schedule([[0], [1], [2], [3]], [MicroBatch(0, 0, route)], memory=1)
    base = simulate(sched, topo, _cost()).iteration_s
    with_o = simulate(sched, topo, _cost(f=f, b=b)).iteration_s
    assert with_o - base == pytest.approx((visits + 2) * f + (visits + 1) * b)


@pytest.mark.parametrize("model", [False, True])
def test_every_method_is_charged_per_task_alike(model):
    """For every method's schedule the simulator's busy seconds per node grow by exactly
    f x (forwards + losses) + b x (backwards) there."""
    topo, f, b = geo12(14), 0.3, 0.2
    cfg = PlanConfig(n_stages=4, skip_ratio=0.34, memory=2, mb_per_originator=2, max_evals=40)
    cmp = compare(topo, _cost(), cfg, contention=model, dp_sync=False, methods=METHODS)
    for m, sched in cmp.schedules.items():
        base = simulate(sched, topo, _cost(), contention=model, dp_sync=False)
        over = simulate(sched, topo, _cost(f=f, b=b), contention=model, dp_sync=False)
        fw, bw = _tasks(sched)
        for n in base.node_busy_s:
            assert over.node_busy_s[n] - base.node_busy_s[n] == pytest.approx(f * fw[n] + b * bw[n]), (m, n)


def test_constructions_read_the_task_seconds_of_the_cost_model():
    topo = random_topology(10, seed=3)
    c = _cost(f=0.7, b=0.4)
    pl = [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    ctx = RouteContext(topo, c, pl)
    for s, nodes in enumerate(pl):
        for n in nodes:
            sp = topo.nodes[n].speed
            assert ctx.f[s][n] == pytest.approx(c.fwd_compute_s(s, sp) + 0.7)
            assert ctx.b[s][n] == pytest.approx(c.bwd_compute_s(s, sp) + 0.4)
    assert ctx.loss[0] == pytest.approx(c.loss_compute_s(topo.nodes[0].speed) + 0.7)


def test_overhead_settings_are_checked_and_kept():
    with pytest.raises(CostError):
        _cost(f=-0.1)
    c = published_cost(task_s=(0.13, 0.09))
    assert (c.fwd_task_s, c.bwd_task_s) == (0.13, 0.09)
    assert CostModel.from_dict(c.to_dict()).fwd_s(1) == pytest.approx(0.44 + 0.13)
    assert c.with_task_s(0.0, 0.0).bwd_s(2) == pytest.approx(1.5 * 0.44)


def test_the_fit_finds_the_overhead_a_timeline_was_made_with():
    """Timelines simulated with a known overhead: the fit gives it back (to the grid's last step)."""
    topo = random_topology(10, seed=4)
    cfg = PlanConfig(n_stages=4, skip_ratio=0.34, memory=2, mb_per_originator=3, max_evals=30,
                     contention=True, dp_sync=False)
    runs = []
    for seed in (0, 1):
        s = plan(topo, _cost(), PlanConfig(**{**cfg.__dict__, "seed": seed}))
        tl = simulate(s, topo, _cost(f=0.031, b=0.017), dp_sync=False).timeline
        runs.append((s, done_times(tl)))
    f, b, rms = fit_task_overhead(runs, topo, _cost(f=0.5, b=0.5), limit_s=0.08)
    assert f == pytest.approx(0.031, abs=2e-3) and b == pytest.approx(0.017, abs=2e-3) and rms < 0.01
