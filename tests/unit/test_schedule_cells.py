"""The planner's decomposition into cells (schedule/cells.py, schedule/regional.py): cells are a
partition of nearby nodes, quotas keep the swarm balanced, a cell simulated alone is exactly its
part of the swarm's simulation, and re-planning starts from the plan in force."""

import functools
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skiptrain.net.topology import Node, Topology, cluster, geo12
from skiptrain.schedule import regional
from skiptrain.schedule.cells import deal_quotas, group_cells, lanes_in_cells, split_sizes
from skiptrain.schedule.cost import CostModel
from skiptrain.schedule.placement import stage_sizes
from skiptrain.schedule.planner import PlanConfig, plan, replan
from skiptrain.schedule.schedule import SKIP_CLAIMS, MicroBatch, Schedule
from skiptrain.schedule.simulator import simulate


def _cost(S=4):
    return CostModel(d_model=64, tokens_per_sample=64, samples=2, layers_per_stage=[2] * S,
                     s_per_sample_per_layer=0.05, hop_overhead_s=0.05, fwd_task_s=0.01, bwd_task_s=0.01)


def _cfg(**kw):
    return PlanConfig(**{**dict(n_stages=4, skip_ratio=0.34, memory=2, mb_per_originator=2, max_evals=20,
                                cells=3, dp_sync=False, time_limit_s=2.0), **kw})


def _regions(k, per):
    """``k`` regions of ``per`` nodes: 1 ms inside a region, 50 ms between."""
    n = k * per
    loc = [i // per for i in range(n)]
    lat = np.array([[0.001 if loc[a] == loc[b] else 0.05 for b in range(n)] for a in range(n)])
    return Topology([Node(i, f"r{loc[i]}") for i in range(n)], lat, np.full((n, n), 1e9))


def test_cells_partition_the_nodes_and_keep_regions_together():
    topo = _regions(4, 10)
    cells = group_cells(topo, _cost(), 4)
    assert sorted(n for c in cells for n in c) == list(range(40))
    assert sorted({topo.nodes[n].location for n in c}.__len__() for c in cells) == [1, 1, 1, 1]
    sizes = [len(c) for c in group_cells(geo12(120), _cost(), 6)]   # 12 locations of 10: merged
    assert sum(sizes) == 120 and all(15 <= x <= 30 for x in sizes)
    assert [len(c) for c in group_cells(cluster(50), _cost(), 7)] == [7, 7, 7, 8, 7, 7, 7]


@settings(max_examples=60, deadline=None)
@given(n_cells=st.integers(1, 6), per=st.integers(8, 14), S=st.integers(3, 6), mpo=st.integers(1, 4),
       extra=st.lists(st.integers(0, 6), min_size=6, max_size=6), base=st.integers(0, 40))
def test_sizes_and_quotas_are_dealt_whole_and_balanced(n_cells, per, S, mpo, extra, base):
    cells = [list(range(i * per, (i + 1) * per)) for i in range(n_cells)]
    sizes = [per * n_cells // S + (1 if s < per * n_cells % S else 0) for s in range(S)]
    rows = split_sizes(sizes, cells)
    assert [sum(r[s] for r in rows) for s in range(S)] == sizes
    assert all(min(r) >= 1 and sum(r) == per for r in rows)
    v = S // 2
    mbs = [r[0] * mpo for r in rows]
    fx = [0] + [base + e for e in extra[:S - 1]]      # visits of the cells that are not re-planned
    q = deal_quotas(S, v, mbs, fx)
    assert [sum(x.values()) for x in q] == [m * v for m in mbs]
    assert all(0 <= x[s] <= m for x, m in zip(q, mbs) for s in x)
    total = [fx[s] + sum(x[s] for x in q) for s in range(1, S)]
    if max(extra[:S - 1]) * (S - 1) <= sum(mbs) * v:  # the new visits can make up the difference
        assert max(total) - min(total) <= 1


def test_a_large_plan_keeps_every_constraint_and_identical_cells_share_one_plan():
    topo = cluster(60)
    s = plan(topo, _cost(), _cfg(mb_per_originator=3))     # 3 micro-batches: every cell's quotas equal
    s.validate(SKIP_CLAIMS, n_nodes=60)
    info = s.meta["planner"]
    assert sorted(n for c in info["cells"] for n in c) == list(range(60))
    assert info["n_cells"] == 3 and info["distinct_cells"] == 1       # a uniform cluster: one problem
    cell_of = {n: i for i, c in enumerate(info["cells"]) for n in c}
    for mb in s.micro_batches:                                         # routes never leave their cell
        assert {cell_of[n] for n in (mb.originator, *mb.nodes)} == {cell_of[mb.originator]}


@functools.lru_cache(maxsize=1)
def _geo36_plan():
    return plan(geo12(36), _cost(), _cfg(max_evals=0, time_limit_s=1.0)).to_dict()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10 ** 6), moves=st.integers(1, 12))
def test_a_cell_simulated_alone_is_its_part_of_the_swarm(seed, moves):
    """The decomposition's evaluation: after random moves inside cells (replica changes, route
    exchanges), every micro-batch finishes at the same time in the swarm's simulation as in its
    cell's simulation alone (cells share no node and no link), with link contention on."""
    topo, cost = geo12(36), _cost()
    s = Schedule.from_dict(_geo36_plan())
    rng = random.Random(seed)
    cells = s.meta["planner"]["cells"]
    cell_of = {n: i for i, c in enumerate(cells) for n in c}
    for _ in range(moves):
        a, b = rng.sample(s.micro_batches, 2)
        if cell_of[a.originator] == cell_of[b.originator] and rng.random() < 0.5:
            a.route, b.route = b.route, a.route
        elif a.route:
            i = rng.randrange(len(a.route))
            st_, _ = a.route[i]
            reps = [n for n in s.placement[st_] if cell_of[n] == cell_of[a.originator]]
            a.route[i] = (st_, rng.choice(reps))
    s.keep_on_nodes()
    whole = simulate(s, topo, cost, contention=True, dp_sync=False, record=False)
    for c in cells:
        pos = {n: k for k, n in enumerate(c)}
        part = Schedule([[pos[n] for n in p if n in pos] for p in s.placement],
                        [MicroBatch(mb.id, pos[mb.originator], [(x, pos[n]) for x, n in mb.route])
                         for mb in s.micro_batches if mb.originator in pos], s.memory, s.skip_ratio, s.max_swaps)
        alone = simulate(part, topo.subset(c), cost, contention=True, dp_sync=False, record=False)
        for mb in part.micro_batches:
            assert alone.mb_done_s[mb.id] == pytest.approx(whole.mb_done_s[mb.id], abs=1e-9)


def test_replanning_after_failures_and_a_join_starts_from_the_plan_in_force():
    topo, cost = geo12(64), _cost()
    full = plan(topo, cost, _cfg(time_limit_s=2.0))
    first = geo12(64).subset(range(63))                 # node 63 joins later
    s = plan(first, cost, _cfg(time_limit_s=2.0, cells=6))
    dead = {s.placement[1][0], s.placement[0][-1]}
    alive = sorted(set(range(64)) - dead)
    r = replan(topo, cost, _cfg(time_limit_s=2.0, max_evals=0, cells=6), s, alive)   # no search: routes as dealt
    r.validate(SKIP_CLAIMS, n_nodes=64)
    used = {n for mb in r.micro_batches for n in (mb.originator, *mb.nodes)}
    assert not used & dead and 63 in set(r.nodes())
    assert Counter(mb.originator for mb in r.micro_batches) == Counter({o: 2 for o in r.placement[0]})
    old = [set(c) for c in s.meta["planner"]["cells"]]
    new = [set(c) for c in r.meta["planner"]["cells"]]
    kept = {n for c in new if c in old for n in c}
    assert len(kept) >= 20 and 63 not in kept and not kept & dead
    before = sorted((mb.originator, mb.route) for mb in s.micro_batches if mb.originator in kept)
    after = sorted((mb.originator, mb.route) for mb in r.micro_batches if mb.originator in kept)
    assert before == after and before                   # untouched cells keep their routes
    assert r.meta["planner"]["replanned_cells"] == sum(c not in old for c in new)
    assert full.meta["planner"]["n_cells"] == 3


def test_full_pipeline_lanes_in_cells_are_aligned_and_stay_in_their_region():
    topo = _regions(3, 14)
    pl = lanes_in_cells(topo, 6, CostModel(layers_per_stage=[1] * 6), 2, 3, 3)
    assert all(len(p) == 6 for p in pl)                  # 2 lanes per region of 14, 2 nodes left each
    assert len({n for p in pl for n in p}) == 36
    for i in range(6):
        assert len({topo.nodes[pl[s][i]].location for s in range(6)}) == 1


def test_a_limit_of_zero_still_gives_every_cell_a_complete_balanced_plan():
    topo = geo12(96)
    s = plan(topo, _cost(), _cfg(cells=None, time_limit_s=0.0, max_evals=None))
    info = s.meta["planner"]
    assert info["n_cells"] > 1 and info["time_capped"] and info["between_rounds"] == 0
    s.validate(SKIP_CLAIMS, n_nodes=96)


def test_cells_give_their_spare_body_nodes_to_the_last_stages():
    """A cell's sizes are split by work with equal remainders going to the deepest body stages
    (10 nodes: 3/2/2/3, where a whole swarm of 10 gets 3/3/2/2)."""
    topo, cost = cluster(30), _cost()
    assert stage_sizes(10, 4, 0.34, cost) == [3, 3, 2, 2]
    s = plan(topo, cost, _cfg(cells=3, max_evals=0))
    s.validate(SKIP_CLAIMS, n_nodes=30)
    stage_of = s.stage_of()
    for cell in s.meta["planner"]["cells"]:
        assert [sum(stage_of[n] == st for n in cell) for st in range(4)] == [3, 2, 2, 3]


def test_cells_that_differ_only_in_their_location_names_share_one_plan():
    topo = _regions(2, 12)                 # two regions, the same links inside, named r0 and r1
    s = plan(topo, _cost(), _cfg(cells=2, mb_per_originator=3))
    s.validate(SKIP_CLAIMS, n_nodes=24)
    info = s.meta["planner"]
    assert len(info["cells"]) == 2 and info["distinct_cells"] == 1
    assert info["deepened_cells"] == 0                  # a set search budget: no deeper second plan


def test_with_the_default_budget_a_cell_is_planned_again_deeper_within_the_limit(monkeypatch):
    monkeypatch.setattr(regional, "DEEPEN_MIN", 0.1)   # a second plan whatever it buys (the limit is short)
    # cells of 8 nodes: the first plan converges in about a third of its CPU share (cells of 20
    # took all of it, leaving nothing to deepen with)
    s = plan(cluster(16), _cost(), _cfg(cells=2, mb_per_originator=3, max_evals=None, time_limit_s=3.0))
    s.validate(SKIP_CLAIMS, n_nodes=16)
    info = s.meta["planner"]
    assert info["distinct_cells"] == 1 and info["deepened_cells"] == 1
    assert info["planner_cpu_s"] <= 1.5 * 3.0


def test_the_plan_reports_the_cells_it_planned_not_the_count_asked_for():
    # 5 cells asked of 60 geo12 nodes: the regions cut into 4 (none smaller than 3/4 of a cell)
    from skiptrain.net.topology import geo12
    from skiptrain.schedule.cost import reference_cost
    s = plan(geo12(60), reference_cost(), _cfg(n_stages=6, cells=5, max_evals=2))
    info = s.meta["planner"]
    assert info["cells_requested"] == 5
    assert info["n_cells"] == len(info["cells"]) == 4
