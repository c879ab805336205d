"""Topologies: presets, custom JSON files, relaying, errors."""

import json

import numpy as np
import pytest

from skiptrain.net.topology import (GEO12_REFERENCE_ORDER, GiB, TopologyError, cluster, from_spec, geo12,
                                    load_topology, random_topology)


def test_geo12_reference_order_and_values():
    t = geo12(20)
    assert [n.location for n in t.nodes[:12]] == GEO12_REFERENCE_ORDER
    assert t.nodes[12].location == "Belgium" and t.n == 20
    # Belgium (0) - Germany (2): 4 ms, 0.2425 GB/s
    assert t.transfer_s(0, 2, 2 ** 25) == pytest.approx(0.004 + 2 ** 25 / (0.2425 * GiB))
    # same region (Belgium 0 and 12): 1 ms, 2 GB/s
    assert t.transfer_s(0, 12, GiB) == pytest.approx(0.001 + 0.5)
    assert np.allclose(t.latency_s, t.latency_s.T)
    # NL (6) - London (10) is the suspicious link; geo12-fixed repairs it
    assert t.bandwidth_Bps[6, 10] == pytest.approx(0.00023681640625 * GiB)
    assert geo12(20, fixed=True).bandwidth_Bps[6, 10] == pytest.approx(0.2425 * GiB)


def test_package_data_is_used():
    from importlib import resources
    assert resources.files("skiptrain.net").joinpath("data/geo12.json").is_file()


def test_custom_file_with_nodes_speeds_and_relay(tmp_path):
    spec = {"locations": ["a", "b", "c"],
            "links": [{"a": "a", "b": "b", "latency_ms": 10, "bandwidth_GBps": 1.0},
                      {"a": "b", "b": "c", "latency_ms": 20, "bandwidth_GBps": 0.5}],
            "same_region": {"latency_ms": 1, "bandwidth_GBps": 4},
            "nodes": [{"location": "a", "speed": 2.0}, {"location": "c"}, {"location": "a"}]}
    f = tmp_path / "t.json"
    f.write_text(json.dumps(spec))
    t = load_topology(str(f))
    assert t.n == 3 and t.speed(0) == 2.0 and t.speed(1) == 1.0
    # a -> c relays through b: latencies add, 1/bandwidth adds (store and forward)
    assert t.latency_s[0, 1] == pytest.approx(0.030)
    assert t.bandwidth_Bps[0, 1] == pytest.approx(1.0 / (1 / GiB + 1 / (0.5 * GiB)))
    assert t.transfer_s(0, 2, 4 * GiB) == pytest.approx(0.001 + 1.0)


def test_disconnected_and_bad_specs_raise():
    spec = {"locations": ["a", "b", "c"],
            "links": [{"a": "a", "b": "b", "latency_ms": 1, "bandwidth_GBps": 1}]}
    with pytest.raises(TopologyError, match="disconnected"):
        from_spec(spec, node_locations=["a", "c"])
    with pytest.raises(TopologyError, match="unknown location"):
        from_spec({"locations": ["a"], "links": [{"a": "a", "b": "z", "latency_ms": 1, "bandwidth_GBps": 1}]})
    with pytest.raises(TopologyError, match="neither a preset"):
        load_topology("/nonexistent/topo.json")
    with pytest.raises(TopologyError):
        load_topology("random:x")


LINK = {"a": "a", "b": "b", "latency_ms": 1, "bandwidth_GBps": 1}


@pytest.mark.parametrize("spec,needle", [
    ([], "holds a JSON list, not an object with 'locations' and 'links'"),
    ("x", "holds a JSON str"),
    ({"locations": ["a", "b"], "links": [5]}, "is malformed (TypeError"),
    ({"locations": ["a", "b"], "links": [{**LINK, "latency_ms": "x"}]}, "is malformed (ValueError"),
    ({"locations": [["a"]], "links": []}, "is malformed (TypeError"),
    ({"locations": ["a", "b"], "links": [LINK], "same_region": 5}, "is malformed (TypeError"),
    ({"locations": ["a", "b"], "links": [LINK], "nodes": [{"location": "a", "speed": "fast"}]}, "is malformed"),
    ({"locations": ["a", "b"], "links": [LINK], "nodes": [{"loc": "a"}]}, "is malformed (KeyError"),
    ({"latency_ms": [[0]], "nodes": [1]}, "is malformed (TypeError"),
    ({"locations": ["a", "b"], "links": [{**LINK, "latency_ms": float("nan")}]}, "must be finite numbers >= 0"),
])
def test_a_malformed_topology_file_is_one_line(tmp_path, spec, needle):
    f = tmp_path / "t.json"
    f.write_text(json.dumps(spec))
    with pytest.raises(TopologyError) as e:
        load_topology(str(f), 4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_topology_of_more_nodes_than_the_maximum_is_refused_before_its_matrices_are_made():
    for name in ("cluster", "geo12", "random"):
        with pytest.raises(TopologyError, match="100000000 nodes is more than a topology holds"):
            load_topology(name, 100_000_000)


def test_random_topology_is_deterministic_and_heterogeneous():
    a, b = random_topology(10, seed=3), random_topology(10, seed=3)
    assert np.array_equal(a.latency_s, b.latency_s) and [n.speed for n in a.nodes] == [n.speed for n in b.nodes]
    assert len({n.speed for n in a.nodes}) > 1
    assert not np.array_equal(a.latency_s, random_topology(10, seed=4).latency_s)


def test_cluster_and_roundtrip():
    c = cluster(4)
    assert c.transfer_s(0, 3, 10 * GiB) == pytest.approx(0.00005 + 1.0)
    t2 = type(c).from_dict(json.loads(json.dumps(c.to_dict())))
    assert np.allclose(t2.latency_s, c.latency_s) and np.allclose(t2.bandwidth_Bps, c.bandwidth_Bps)
