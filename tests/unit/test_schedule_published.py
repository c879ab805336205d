"""SkipPipe's published schedules (package data) in this project's simulator, and the fair
random baseline."""

import pytest

from skiptrain.net.topology import geo12
from skiptrain.schedule.baselines import random_skip, slow_hops
from skiptrain.schedule.compare import CLAIMS
from skiptrain.schedule.cost import published_cost, reference_cost
from skiptrain.schedule.published import (load_published, published_times, skippipe_ca, skippipe_lanes,
                                          skippipe_paths, walk)
from skiptrain.schedule.simulator import simulate


def test_walk_follows_hops_from_the_originator():
    pl = [[0, 3], [5], [7]]
    assert walk({"7": 3, "0": 5, "5": 7}, [[0], [5], [7, 3]]) == (0, [(1, 5), (2, 7), (2, 3)])
    with pytest.raises(Exception):
        walk({"5": 7}, pl)  # starts at a body node


def test_published_schedules_have_the_documented_shape():
    ca = skippipe_ca()
    ca.validate(CLAIMS["skippipe_published"], n_nodes=20)
    per = ca.by_originator()
    assert sorted(per) == sorted(load_published()["partitions"][0])
    for o, mbs in per.items():
        assert [mb.start_s for mb in mbs] == [0.0, 1.0, 2.0, 2.5, 3.5, 4.5]
        assert len({tuple(mb.route) for mb in mbs}) == 1
    lanes = skippipe_lanes()
    lanes.validate(CLAIMS["skippipe_lanes"], n_nodes=20)
    assert len(lanes.micro_batches) == 27 and len(lanes.by_originator()) == 3
    for kind in ("non-ca-paths", "random-paths"):
        s = skippipe_paths(kind, published_cost())
        s.validate(CLAIMS["skippipe_published"], n_nodes=20)
        assert len(s.micro_batches) == 30


@pytest.mark.parametrize("method,build", [
    ("skippipe_published", skippipe_ca), ("skippipe_lanes", skippipe_lanes),
    ("skippipe_published_no_ca", lambda: skippipe_paths("non-ca-paths", published_cost())),
    ("skippipe_published_random", lambda: skippipe_paths("random-paths", published_cost()))])
def test_published_cost_reproduces_skippipe_simulator(method, build):
    # same simplified model (no contention, no DP sync): within 3% of SkipPipe's own simulator
    r = simulate(build(), geo12(20), published_cost(), contention=False, dp_sync=False)
    assert r.iteration_s == pytest.approx(published_times()[method], rel=0.03)


def test_published_cost_is_a_quarter_of_the_bench_cost_per_stage():
    pub, bench = published_cost(), reference_cost()
    assert pub.fwd_s(0) == pytest.approx(0.44) and bench.fwd_s(0) == pytest.approx(1.76)
    assert pub.activation_bytes == bench.activation_bytes == 32 * 2 ** 20


@pytest.mark.parametrize("seed", range(5))
def test_random_skip_avoids_unusable_links_and_stays_balanced(seed):
    topo, cost = geo12(20), reference_cost()
    pl = [[12, 3, 9, 5, 14], [7, 2, 19], [0, 16, 13], [18, 1, 4], [17, 6, 10], [11, 15, 8]]  # 6 (NL) - 10 (London)
    s = random_skip(topo, cost, pl, 6, 0.33, 3, seed)
    s.validate(CLAIMS["random_skip"], n_nodes=20)
    limit = cost.usable_hop_s(topo)
    assert 4.1 < limit < 132  # only the NL-London link (132 s; the next slowest 4.0 s) is unusable
    assert all(slow_hops(topo, cost, mb.originator, mb.route, limit) == 0 for mb in s.micro_batches)
    visits = s.node_visits()
    for stage in pl[1:]:
        assert max(visits[n] for n in stage) - min(visits[n] for n in stage) <= 1


def test_published_methods_only_on_the_reference_topology():
    from skiptrain.net.topology import random_topology
    from skiptrain.schedule.compare import compare
    from skiptrain.schedule.planner import PlanConfig
    cfg = PlanConfig(n_stages=6, skip_ratio=0.33, memory=3, mb_per_originator=1, max_evals=10, constructions=1)
    with pytest.raises(ValueError, match="geo12 with 20 nodes"):
        compare(random_topology(20, seed=1), published_cost(), cfg, contention=False, dp_sync=False,
                methods=("planner", "skippipe_published"))


def test_cli_simulate_with_compressed_hops(tmp_path):
    import json

    from skiptrain.cli import main
    out = {}
    for codec in ("fp32", "int8"):
        path = tmp_path / f"{codec}.json"
        rc = main(["simulate", "--topology", "geo12", "--nodes", "8", "--stages", "3", "--skip", "0.0",
                   "--micro-batches", "1", "--samples", "1", "--seq-len", "64", "--d-model", "64",
                   "--max-evals", "10", "--simplified", "--methods", "full_pipeline,planner",
                   "--act-codec", codec, "--json", str(path)])
        assert rc == 0
        out[codec] = json.loads(path.read_text())["methods"]["full_pipeline"]["bytes_pipeline"]
    assert 3.5 * out["int8"] < out["fp32"]  # cross-region hops carry 64 + 4 bytes per row, not 256
