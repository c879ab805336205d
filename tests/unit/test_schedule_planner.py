"""Planner and baselines: every schedule satisfies the constraints its method claims (hypothesis,
random topologies), determinism, serialisation, infeasible requests, the CLI."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skiptrain.errors import UserError
from skiptrain.net.topology import TopologyError, from_spec, geo12, random_topology
from skiptrain.schedule.compare import CLAIMS, compare
from skiptrain.schedule.cost import CostModel, from_model_config, reference_cost, ring_order
from skiptrain.schedule.placement import place, stage_sizes
from skiptrain.schedule.construction import route_orders
from skiptrain.schedule.planner import PlanConfig, plan
from skiptrain.schedule.routes import RouteError, check_route, skip_count
from skiptrain.schedule.schedule import Schedule, ScheduleError
from skiptrain.schedule.simulator import simulate
from skiptrain.schedule.timeline import check_no_overlap, max_in_flight


def small_cost(S, samples=2):
    return CostModel(d_model=64, tokens_per_sample=128, samples=samples, layers_per_stage=[2] * S,
                     s_per_sample_per_layer=0.01, hop_overhead_s=0.01)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), S=st.integers(2, 5), extra=st.integers(0, 5),
       k=st.sampled_from([0.0, 0.2, 0.25, 0.33, 0.4]), memory=st.integers(1, 3), mbo=st.integers(1, 3),
       swaps=st.integers(0, 2), full_model=st.booleans())
def test_every_method_keeps_its_constraints(seed, S, extra, k, memory, mbo, swaps, full_model):
    n = S + extra + 1
    topo = random_topology(n, seed=seed)
    if 0 < int(k * S + 0.5) >= S - 1:  # refused: routes would visit no body stage
        with pytest.raises(RouteError, match="no body stage"):
            skip_count(k, S)
        return
    cfg = PlanConfig(n_stages=S, skip_ratio=k, max_swaps=swaps, memory=memory, mb_per_originator=mbo,
                     seed=seed, max_evals=40, constructions=2)
    cmp = compare(topo, small_cost(S), cfg, contention=full_model, dp_sync=full_model, record=True)
    v = S - 1 - skip_count(k, S)
    for m, sched in cmp.schedules.items():
        sched.validate(CLAIMS[m], n_nodes=n)  # compare() did too; be explicit
        res = cmp.results[m]
        assert not res.deadlock and math.isfinite(res.iteration_s)
        assert all(x <= memory for x in max_in_flight(res.timeline).values())
        check_no_overlap(res.timeline)
        assert len(sched.micro_batches) == len(cmp.schedules["planner"].micro_batches)
        if m.startswith("full") or m == "swarm_full":
            assert all(mb.stages == list(range(1, S)) for mb in sched.micro_batches)
        else:
            assert all(len(mb.route) == v for mb in sched.micro_batches)
            counts = sched.stage_visits()[1:]
            assert max(counts) - min(counts) <= 1
            for mb in sched.micro_batches:
                check_route(mb.stages, S, v, swaps)
        # every micro-batch finished; stage 0 runs the first forward and the last backward
        done = {e.mb for e in res.timeline if e.kind == "bwd" and e.stage == 0}
        assert done == {mb.id for mb in sched.micro_batches}


def test_route_orders_are_exactly_the_allowed_ones():
    orders = route_orders(6, 3, 2)
    assert len(orders) == 10 * 3 and len(set(orders)) == 30
    for r in orders:
        check_route(list(r), 6, 3, 2)
    assert len(route_orders(6, 4, 2)) == 5 * 5  # 4 visits: none, 3 single swaps, 1 double
    assert all(list(r) == sorted(r) for r in route_orders(6, 3, 0))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(6, 120), S=st.integers(2, 7), k=st.sampled_from([0.0, 0.2, 0.33, 0.5]))
def test_deep_ties_give_equal_body_stages_spare_nodes_from_the_last(n, S, k):
    """Body stages of equal work: the same sizes as the default, reordered so that the larger
    ones are the last (the simple reference: stage 0 kept, the body sizes sorted ascending)."""
    if n < S:                   # every stage needs a node: stage_sizes refuses
        return
    c = CostModel(d_model=64, tokens_per_sample=64, samples=2, layers_per_stage=[2] * S, s_per_sample_per_layer=0.05)
    try:
        first, deep = stage_sizes(n, S, k, c), stage_sizes(n, S, k, c, deep_ties=True)
    except RouteError:          # a skip ratio that leaves no body stage: nothing to split
        return
    assert deep == [first[0], *sorted(first[1:])]


def test_deep_ties_never_take_a_spare_node_from_stage_0():
    """Stage 0 tied with the body stages (73 nodes, 3 stages, k=0.2: every remainder 2/3) keeps
    its spare node: only the body stages' ties go to the deepest."""
    c = CostModel(d_model=64, tokens_per_sample=64, samples=2, layers_per_stage=[2] * 3, s_per_sample_per_layer=0.05)
    assert stage_sizes(73, 3, 0.2, c) == [38, 18, 17]
    assert stage_sizes(73, 3, 0.2, c, deep_ties=True) == [38, 17, 18]


def test_deep_ties_change_nothing_without_a_tie():
    c = CostModel(d_model=64, tokens_per_sample=64, samples=2, layers_per_stage=[1, 2, 3, 4], s_per_sample_per_layer=0.05)
    for n in range(4, 60):
        assert stage_sizes(n, 4, 0.0, c, deep_ties=True) == stage_sizes(n, 4, 0.0, c)
    r = reference_cost()
    assert stage_sizes(21, 6, 0.33, r) == [5, 4, 3, 3, 3, 3]
    assert stage_sizes(21, 6, 0.33, r, deep_ties=True) == [5, 3, 3, 3, 3, 4]
    assert stage_sizes(20, 6, 0.33, r, deep_ties=True) == [5, 3, 3, 3, 3, 3]


def test_reference_stage_sizes_and_cost():
    c = reference_cost()
    assert stage_sizes(20, 6, 0.33, c) == [5, 3, 3, 3, 3, 3]
    assert c.activation_bytes == 8 * 1024 * 1024 * 4 and c.fwd_s(0) == pytest.approx(1.76)
    t = geo12(20)
    assert c.hop_s(t, 0, 2) == pytest.approx(0.004 + 2 ** 25 / (0.2425 * 2 ** 30) + 0.35)
    # the ring avoids the NL-London link when it can
    ring = ring_order(t, [0, 2, 6, 10, 12])
    pairs = {frozenset((ring[i], ring[(i + 1) % 5])) for i in range(5)}
    assert frozenset((6, 10)) not in pairs


def test_cost_from_model_config():
    from skiptrain.config import build_config
    m = build_config("tiny").model
    c = from_model_config(m, samples=8, s_per_sample_per_layer=0.01)
    assert c.layers_per_stage[0] == m.stage0_layers and sum(c.layers_per_stage) == m.n_layers
    assert c.activation_bytes == 8 * m.seq_len * m.d_model * 4
    assert c.params_per_stage[0] > c.params_per_stage[1]


def test_planner_is_deterministic_and_serialisable():
    topo = random_topology(10, seed=7)
    cfg = lambda: PlanConfig(n_stages=4, skip_ratio=0.25, memory=2, mb_per_originator=2, seed=3, max_evals=60)
    a, b = plan(topo, small_cost(4), cfg()), plan(topo, small_cost(4), cfg())
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d["meta"] = {}
    assert da == db
    back = Schedule.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back.to_dict() == a.to_dict()
    assert simulate(back, topo, small_cost(4)).iteration_s == simulate(a, topo, small_cost(4)).iteration_s


def test_planner_beats_baselines_on_reference_setup_simplified():
    """Simulated (not wall-clock) iteration times, one run: the planner must beat the full pipeline
    and random skipping in the reference's simplified model."""
    cfg = PlanConfig(stage_sizes=[5, 3, 3, 3, 3, 3], skip_ratio=0.33, memory=3, mb_per_originator=6,
                     max_evals=150, constructions=4)
    cmp = compare(geo12(20), reference_cost(), cfg, contention=False, dp_sync=False,
                  methods=("full_pipeline", "random_skip", "planner"))
    t = cmp.iteration_s()
    assert t["planner"] < 0.6 * t["full_pipeline"]
    assert t["planner"] < 0.9 * t["random_skip"]


@pytest.mark.parametrize("kw, match", [
    (dict(n_stages=6, skip_ratio=0.95), "skip ratio"),
    (dict(n_stages=12, skip_ratio=0.0), "cannot serve"),
    (dict(n_stages=4, memory=0), "memory"),
    (dict(n_stages=4, stage_sizes=[5, 5, 5, 5]), "need"),
])
def test_infeasible_requests_raise_clear_errors(kw, match):
    topo = random_topology(8, seed=1)
    with pytest.raises(UserError, match=match):
        plan(topo, small_cost(kw["n_stages"]), PlanConfig(**kw))


def test_disconnected_topology_is_an_error():
    spec = {"locations": ["a", "b"], "links": []}
    with pytest.raises(TopologyError, match="disconnected"):
        from_spec(spec, node_locations=["a", "b", "a"])


def test_lane_placement_and_validate_catches_violations():
    topo = geo12(12)
    pl = place(topo, [2, 2, 2], reference_cost(), mode="lanes", dp_sync=False)
    assert sorted(n for p in pl for n in p) == sorted(set(n for p in pl for n in p))
    s = plan(topo, small_cost(3), PlanConfig(n_stages=3, skip_ratio=0.0, memory=1, mb_per_originator=1,
                                             max_evals=5))
    s.validate(n_nodes=12)
    bad = Schedule.from_dict(s.to_dict())
    bad.micro_batches[0].route = [(2, bad.placement[2][0]), (1, bad.placement[1][0])][::1]
    bad.max_swaps = 0
    with pytest.raises(ScheduleError, match="swaps"):
        bad.validate()
    bad.micro_batches[0].route = [(1, bad.placement[2][0])]
    with pytest.raises(ScheduleError):
        bad.validate()


def test_cli_simulate_writes_json_and_png(tmp_path, capsys):
    from skiptrain.cli import main
    out, png = tmp_path / "r.json", tmp_path / "g.png"
    rc = main(["simulate", "--topology", "random:3", "--nodes", "9", "--stages", "4", "--skip", "0.25",
               "--micro-batches", "2", "--samples", "1", "--seq-len", "64", "--d-model", "64",
               "--max-evals", "20", "--json", str(out), "--gantt", str(png)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert {"full_pipeline", "random_skip", "planner"} <= set(d["methods"]) and d["planner_s"] > 0
    assert all(math.isfinite(v["iteration_s"]) for v in d["methods"].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "planner" in capsys.readouterr().out
    rc = main(["simulate", "--topology", "random:3", "--nodes", "3", "--stages", "6"])
    assert rc == 2
    assert "cannot serve" in capsys.readouterr().err
    assert main(["simulate", "--memory", "0"]) == 2
    assert main(["simulate", "--skip", "0.99"]) == 2


@pytest.mark.parametrize("argv,needle", [
    (["--s-per-sample-layer", "nan"], "--s-per-sample-layer nan must be a number of seconds in [0, 1e+06]"),
    (["--s-per-sample-layer", "1e308"], "--s-per-sample-layer 1e+308 must be a number of seconds in [0, 1e+06]"),
    (["--s-per-sample-layer", "-1"], "--s-per-sample-layer -1.0 must be a number of seconds in [0, 1e+06]"),
    (["--hop-overhead", "inf"], "--hop-overhead inf must be a number of seconds in [0, 1e+06]"),
    (["--act-fast-gbps", "-1"], "--act-fast-gbps -1.0 must be a number of GB/s >= 0"),
    (["--d-model", "0"], "--d-model 0 must be >= 1"),
    (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["--layers-per-stage", "-1"], "--layers-per-stage -1 must be >= 0"),
    (["--max-swaps", "3"], "--max-swaps 3 must be in [0, 2]"),
    (["--micro-batches", "100000000"], "--micro-batches 100000000 must be in [1, 4096]"),
    (["--memory", "0"], "--memory 0 must be in [1, 4096]"),
    (["--memory", str(2**63)], f"--memory {2**63} must be in [1, 4096]"),
    (["--max-evals", "-1"], "--max-evals -1 must be >= 0"),
    (["--time-limit", "-1"], "--time-limit -1.0 must be a number of seconds >= 0"),
    (["--time-limit", "nan"], "--time-limit nan must be a number of seconds >= 0"),
    (["--stage-sizes", "2,2"], "--stage-sizes 2,2 lists 2 stage(s), but --stages is 3; give one size per stage"),
    (["--stage-sizes", "2,2,9"], "--stage-sizes 2,2,9: stage sizes [2, 2, 9] need 13 nodes, topology has 6"),
    (["--skip", "0.9"], "--skip 0.9 with --stages 3: skip ratio 0.9 with 3 stages skips 3 of the 2 body stages"),
    (["--dp-payload-mb", "nan"], "--dp-payload-mb nan must be a finite number"),
    (["--nodes", "100000000"], "more than a topology holds"),
])
def test_cli_simulate_with_absurd_numbers_is_one_line(capsys, argv, needle):
    from skiptrain.cli import main
    assert main(["simulate", "--topology", "cluster", "--nodes", "6", "--stages", "3", "--methods", "planner",
                 "--max-evals", "5", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_gantt_side_by_side(tmp_path):
    from skiptrain.schedule.gantt import draw_side_by_side
    topo = random_topology(6, seed=2)
    s = plan(topo, small_cost(3), PlanConfig(n_stages=3, skip_ratio=0.0, memory=2, mb_per_originator=2,
                                             max_evals=5))
    r = simulate(s, topo, small_cost(3))
    p = draw_side_by_side(r.timeline, r.timeline, tmp_path / "sbs.png")
    assert p.stat().st_size > 1000


def test_the_time_cap_bounds_placement_and_construction_too_and_big_stages_stay_valid():
    """A cap of 0 s leaves the first placement's estimate and one constructive start per
    candidate: the schedule is still complete and balanced, and the meta says what was cut.
    The topology has stages of more than 16 replicas, so routes weigh a bounded set of
    replicas and rings are searched with bounded effort."""
    topo = random_topology(96, seed=1, n_regions=5)
    cost = CostModel(d_model=256, tokens_per_sample=128, samples=2, layers_per_stage=[2] * 4,
                     s_per_sample_per_layer=0.01, hop_overhead_s=0.01)
    cfg = PlanConfig(n_stages=4, skip_ratio=0.33, memory=2, mb_per_originator=2, seed=0, time_limit_s=0.0,
                     cells=1)                      # the swarm planned whole (cells: test_schedule_cells.py)
    sched = plan(topo, cost, cfg)
    info = sched.meta["planner"]
    assert info["placement_capped"] and info["time_capped"] and info["evals"] == 0
    assert max(len(p) for p in sched.placement[1:]) > 16
    sched.validate(("placement", "originators", "stage0_ends", "no_repeat", "memory"), n_nodes=topo.n)
    visits = [0] * 4
    for mb in sched.micro_batches:
        for s, _ in mb.route:
            visits[s] += 1
    assert max(visits[1:]) - min(visits[1:]) <= 1          # the stage quotas hold
    r = simulate(sched, topo, cost)
    assert math.isfinite(r.iteration_s)
    big = sorted(max(sched.placement[1:], key=len))
    ring = ring_order(topo, big)
    assert sorted(ring) == big                              # a ring over exactly those nodes


def test_without_a_binding_cap_nothing_is_cut():
    sched = plan(geo12(20), reference_cost(), PlanConfig(n_stages=6, stage_sizes=[5, 3, 3, 3, 3, 3], seed=0,
                                                         max_evals=50, contention=False, dp_sync=False))
    info = sched.meta["planner"]
    assert not info["placement_capped"] and not info["time_capped"] and info["evals"] > 0


def test_a_placement_search_past_its_deadline_keeps_only_the_first_start():
    topo, cost = geo12(20), reference_cost()
    sizes = [5, 3, 3, 3, 3, 3]
    late = place(topo, sizes, cost, 0.33, return_all=True, deadline=-1.0)
    free = place(topo, sizes, cost, 0.33, return_all=True)
    assert len(late) == 1 and len(free) > 1
