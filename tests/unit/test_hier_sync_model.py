"""The hierarchical dense sync in the cost model and the simulator (schedule/cost.py,
schedule/simulator.py): its time against a hand-computed case, ``auto`` picks the faster shape,
and the simulator charges what the cost model charges."""

import numpy as np
import pytest

from skiptrain.net.topology import Node, Topology
from skiptrain.schedule.cost import CostError, CostModel
from skiptrain.schedule.schedule import MicroBatch, Schedule
from skiptrain.schedule.simulator import simulate
from skiptrain.schedule.sync_rings import SyncRing


def _regions(region_sizes=(2, 2), intra_bw=1e9, inter_bw=1e8):
    """Regions of the given sizes: 1 ms and ``intra_bw`` B/s inside, 50 ms and ``inter_bw`` between."""
    loc = [r for r, k in enumerate(region_sizes) for _ in range(k)]
    n = len(loc)
    same = np.array([[loc[a] == loc[b] for b in range(n)] for a in range(n)])
    return Topology([Node(i, f"r{loc[i]}") for i in range(n)], np.where(same, 0.001, 0.05),
                    np.where(same, intra_bw, inter_bw))


def _cost(mode, stages=1, params=25_000_000):
    """One stage of ``params`` fp32 gradients (4 * params bytes), the dense sync shaped by ``mode``."""
    return CostModel(d_model=1, tokens_per_sample=1, samples=1, dtype_bytes=1, layers_per_stage=[1] * stages,
                     s_per_sample_per_layer=1.0, hop_overhead_s=0.0, params_per_stage=[params] * stages,
                     dp_topology=mode)


def test_regions_are_the_latency_clusters():
    assert _regions((2, 3)).region_of() == [0, 0, 1, 1, 1]


def _nodes(rings):
    return sorted(sorted(r.nodes) for r in rings)


def test_hierarchical_time_hand_computed():
    # 1e8 bytes over regions {0,1} and {2,3}, k = 2 (each region's first member sums shard 0):
    # phase 1, each region's ring of 2 reduce-scatters to its 2 members: 1 step of
    #   (1 ms + 5e7 B / 1e9 B/s) = 0.051 s
    # phase 2, k=2 shards of 5e7 B, rings {0,2} and {1,3}: 2 steps of (50 ms + 2.5e7 / 1e8) = 0.6 s
    # phase 3, the mirror gather: 0.051 s
    t, c = _regions(), _cost("hierarchical")
    phases = c.sync_phases(t, [0, 1, 2, 3], c.sync_bytes(0))
    assert [_nodes(rings) for rings, _ in phases] == [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]]
    assert [[r.op for r in rings] for rings, _ in phases] == [["scatter"] * 2, ["sum"] * 2, ["gather"] * 2]
    assert [r.owners for r in phases[0][0]] == [(0, 1), (2, 3)]
    assert [share for _, share in phases] == [1.0, 0.5, 1.0]
    assert c.dp_sync_s(t, [0, 1, 2, 3], 0) == pytest.approx(0.051 + 0.6 + 0.051)
    # flat: one ring of 4 crossing regions, 6 steps of (50 ms + 2.5e7 / 1e8) = 1.8 s
    assert _cost("flat").dp_sync_s(t, [0, 1, 2, 3], 0) == pytest.approx(1.8)


def test_a_region_of_more_than_2k_members_all_reduces_instead():
    # regions of 2, 4 and 5, k = 2: scattering moves (m-1)/2 of the bytes per link in m-1 steps,
    # all-reducing 2 (m-1)/m in 2 (m-1) steps: for 4 the same bytes in half the steps (scatter),
    # for 5 2 against 1.6 (all-reduce: 8 steps of 1 ms + 2e7 / 1e9)
    t, c = _regions((2, 4, 5)), _cost("hierarchical")
    (first, _), _, (last, _) = c.sync_phases(t, list(range(11)), c.sync_bytes(0))
    assert [(r.op, len(r)) for r in first] == [("scatter", 2), ("scatter", 4), ("sum", 5)]
    assert [(r.op, len(r)) for r in last] == [("gather", 2), ("gather", 4), ("sum", 5)]
    assert c.ring_s(t, first[2], 1e8) == pytest.approx(8 * (0.001 + 2e7 / 1e9))
    assert c.ring_s(t, first[1], 1e8) == pytest.approx(3 * (0.001 + 5e7 / 1e9))


def test_auto_picks_the_faster_shape():
    t = _regions()
    assert _cost("auto").dp_sync_s(t, [0, 1, 2, 3], 0) == pytest.approx(0.702)
    slow_inside = _regions(intra_bw=1e6)      # the regions' own links are the slow ones
    hier = _cost("hierarchical").dp_sync_s(slow_inside, [0, 1, 2, 3], 0)
    flat = _cost("flat").dp_sync_s(slow_inside, [0, 1, 2, 3], 0)
    assert flat < hier
    assert _cost("auto").dp_sync_s(slow_inside, [0, 1, 2, 3], 0) == pytest.approx(flat)


def test_unequal_regions_and_degenerate_cases():
    t = _regions((2, 3))
    c = _cost("hierarchical")
    rings, share = c.sync_phases(t, [0, 1, 2, 3, 4], c.sync_bytes(0))[1]
    assert share == 0.5 and len(rings) == 2          # k = the smallest region's count
    assert all(len(r) == 2 for r in rings)
    # one replica per region, or one region: the flat ring; a compressed sync is never hierarchical
    assert c.sync_phases(t, [0, 2], c.sync_bytes(0)) == [([SyncRing((0, 2))], 1.0)]
    assert c.sync_phases(t, [2, 3, 4], c.sync_bytes(0)) == [([SyncRing((2, 3, 4))], 1.0)]
    compressed = CostModel(dp_mode="compressed", compressed_payload_bytes=8, dp_topology="hierarchical")
    assert len(compressed.sync_phases(t, [0, 1, 2, 3], 8)) == 1
    with pytest.raises(CostError):
        CostModel(dp_topology="tree")


def test_simulator_charges_the_cost_models_sync():
    # stage 0 on node 0, stage 1 replicated on 1, 2 (region 0) and 3, 4 (region 1); one micro-batch
    # each through 1 and 3; the stage-1 sync has its links to itself.  Hierarchical: every ring of
    # a phase has equal links, so the simulated sync lasts exactly the cost model's time; the flat
    # ring mixes fast and slow links and a member sends on as soon as it received (not in lockstep
    # with the slowest link), so the simulation is at most the cost model's time
    t = _regions((3, 2))
    s = Schedule([[0], [1, 2, 3, 4]], [MicroBatch(0, 0, [(1, 1)]), MicroBatch(1, 0, [(1, 3)])], memory=2)
    span = {}
    for mode in ("flat", "hierarchical", "auto"):
        c = _cost(mode, stages=2, params=1_000_000)
        start, end = simulate(s, t, c, contention=True, dp_sync=True).sync_s[1]
        span[mode] = end - start
        if mode != "flat":
            assert span[mode] == pytest.approx(c.dp_sync_s(t, [1, 2, 3, 4], 1))
    assert span["flat"] <= _cost("flat", 2, 1_000_000).dp_sync_s(t, [1, 2, 3, 4], 1)
    assert span["auto"] == pytest.approx(span["hierarchical"]) and span["hierarchical"] < span["flat"]
    hier = simulate(s, t, _cost("hierarchical", 2, 1_000_000), dp_sync=True)
    # bytes on the wire (B = 4e6): phases 1 and 3, rings {1,2} and {3,4} scatter (gather) to both
    # members: 2 chains x 1 hop of B/2 each, 2 B a phase; phase 2, shard rings {1,3} and {2,4} on
    # B/2: 2 x 2 steps of B/4 each, 2 B
    assert hier.bytes_sync == 6 * 4_000_000
    assert {e.node for e in hier.timeline if e.kind == "sync"} == {1, 2, 3, 4}


def test_the_runtimes_links_charge_what_the_cost_model_charges():
    # the runtime's emulated sync (the transport sleeps HierarchicalLinks.all_reduce_s) takes the
    # same shape and the same seconds as the cost model, for the same bytes on the same topology
    from types import SimpleNamespace

    from skiptrain.dp.link import HierarchicalLinks, RingLinks
    from skiptrain.runtime.emulation import Emulation
    from skiptrain.runtime.job import EmulationSpec

    t = _regions((3, 2))
    ph = SimpleNamespace(emulation=EmulationSpec(sync=True))
    nbytes = _cost("auto").sync_bytes(0)
    for mode in ("hierarchical", "auto"):
        c = _cost(mode)
        link = Emulation(ph, t, c, 1).sync_link([1, 2, 3, 4])
        assert isinstance(link, HierarchicalLinks)
        assert link.all_reduce_s(nbytes, 4) == pytest.approx(c.dp_sync_s(t, [1, 2, 3, 4], 0))
        assert sorted(map(sorted, link.regions)) == [[0, 1], [2, 3]]      # group ranks of nodes 1, 2 | 3, 4
    # regions of 2 and 6 (k = 2): the region of 6 all-reduces, with slower links inside it
    base = _regions((1, 2, 6))
    bw = np.array(base.bandwidth_Bps)
    bw[3:, 3:] = 2e8
    wide = Topology(base.nodes, np.array(base.latency_s), bw)
    c = _cost("hierarchical")
    link = Emulation(ph, wide, c, 1).sync_link(list(range(1, 9)))
    assert [len(o) for o in link.owners] == [2, 0]
    assert link.all_reduce_s(nbytes, 8) == pytest.approx(c.dp_sync_s(wide, list(range(1, 9)), 0))
    slow_inside = _regions((3, 2), intra_bw=1e6)
    link = Emulation(ph, slow_inside, _cost("auto"), 1).sync_link([1, 2, 3, 4])
    assert not link.hierarchical(nbytes, 4)                    # auto: the flat ring is faster there
    assert link.all_reduce_s(nbytes, 4) == pytest.approx(_cost("flat").dp_sync_s(slow_inside, [1, 2, 3, 4], 0))
    assert isinstance(Emulation(ph, t, _cost("flat"), 1).sync_link([1, 2, 3, 4]), RingLinks)


def test_every_member_of_a_ring_ends_its_sync_when_it_last_received():
    # regions {1, 2, 3} and {4, 5}, k = 2, B = 4e6 bytes: phase 1, the ring 1 -> 2 -> 3 scatters
    # to 1 and 2 (2 hops of B/2: 2 x 3 ms); phase 2, shard rings {1, 4} and {2, 5} on B/2 (2 steps
    # of 50 ms + 1e6 / 1e8): 0.126 s; phase 3, the gather: node 1 sends piece 0 to node 2 (0.129 s),
    # on to node 3 (0.132 s); node 2 sends piece 1 to 3, on to 1.  Node 2's sync ends at 0.129 s,
    # not at phase 2's end, in which it last received before
    t = _regions((1, 3, 2))
    s = Schedule([[0], [1, 2, 3, 4, 5]], [MicroBatch(0, 0, [(1, 1)])], memory=2)
    r = simulate(s, t, _cost("hierarchical", stages=2, params=1_000_000), dp_sync=True)
    start, end = r.sync_s[1]
    ends = {e.node: e.end - start for e in r.timeline if e.kind == "sync"}
    assert end - start == pytest.approx(0.132)
    assert ends == pytest.approx({1: 0.132, 2: 0.129, 3: 0.132, 4: 0.129, 5: 0.129})
