"""Exact simulator results on tiny hand-computed cases, plus the timeline invariants."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skiptrain.net.topology import Node, Topology
from skiptrain.schedule.cost import CostModel
from skiptrain.schedule.schedule import MicroBatch, Schedule
from skiptrain.schedule.simulator import SimulationError, simulate
from skiptrain.schedule.timeline import check_no_overlap, from_dicts, max_in_flight, to_dicts


def topo(n, lat=0.5, bw=1.0):
    """``n`` nodes, every link ``lat`` s latency and ``bw`` bytes/s."""
    return Topology([Node(i, f"n{i}") for i in range(n)], np.full((n, n), lat), np.full((n, n), bw))


def cost(stages, bytes_=2, overhead=0.0, dp="none", params=None):
    # fwd = 1 s per stage, bwd 1.5 s, loss 0.25 s; one hop = bytes_ bytes
    return CostModel(d_model=1, tokens_per_sample=1, samples=1, dtype_bytes=bytes_,
                     layers_per_stage=[1] * stages, s_per_sample_per_layer=1.0, hop_overhead_s=overhead,
                     dp_mode=dp, params_per_stage=params or [], grad_dtype_bytes=1)


def test_single_microbatch_exact():
    # fwd0 1 | hop 0.5+2 | fwd1 1 | hop 2.5 | loss .25 | hop 2.5 | bwd1 1.5 | hop 2.5 | bwd0 1.5
    s = Schedule([[0], [1]], [MicroBatch(0, 0, [(1, 1)])], memory=1)
    r = simulate(s, topo(2), cost(2, overhead=0.1))
    assert r.iteration_s == pytest.approx(1 + 2.6 + 1 + 2.6 + 0.25 + 2.6 + 1.5 + 2.6 + 1.5)
    assert r.node_busy_s == {0: pytest.approx(2.75), 1: pytest.approx(2.5)}
    assert r.bytes_pipeline == 4 * 2
    kinds = [(e.node, e.kind) for e in r.timeline if e.kind in ("fwd", "bwd", "loss")]
    assert kinds == [(0, "fwd"), (1, "fwd"), (0, "loss"), (1, "bwd"), (0, "bwd")]


def test_link_contention_fifo_vs_simplified():
    # two micro-batches from one originator, hop = 0.5 latency + 3 s serialisation
    s = Schedule([[0], [1]], [MicroBatch(0, 0, [(1, 1)]), MicroBatch(1, 0, [(1, 1)])], memory=2)
    c = cost(2, bytes_=3)
    free = simulate(s, topo(2), c, contention=False)
    fifo = simulate(s, topo(2), c, contention=True)
    arr = lambda r: sorted(e.end for e in r.timeline if e.kind == "recv" and e.node == 1)[:2]
    # mb1's forward ends at 2; without contention it arrives at 2 + 3.5, with FIFO it waits for
    # mb0's message to leave the link (1 + 3 = 4) and arrives at 4 + 3.5
    assert arr(free) == pytest.approx([4.5, 5.5])
    assert arr(fifo) == pytest.approx([4.5, 7.5])
    assert fifo.iteration_s > free.iteration_s


def test_memory_credit_serialises_microbatches():
    one = Schedule([[0], [1]], [MicroBatch(0, 0, [(1, 1)])], memory=1)
    two = Schedule([[0], [1]], [MicroBatch(0, 0, [(1, 1)]), MicroBatch(1, 0, [(1, 1)])], memory=1)
    t1 = simulate(one, topo(2), cost(2)).iteration_s
    r2 = simulate(two, topo(2), cost(2))
    assert r2.iteration_s == pytest.approx(2 * t1)
    assert max(r2.max_in_flight.values()) == 1
    assert max_in_flight(r2.timeline) == {0: 1, 1: 1}


def test_backward_before_forward_and_gpipe_order():
    # stage 1 forward takes 2 s; links 1 s latency, ~no serialisation.
    # A (orig 0): fwd0 [0,1], fwd1 [2,4], loss [5,5.25], its backward reaches node 1 at 6.25.
    # B (orig 2, start 3): fwd0 [3,4], fwd1 [5,7].  C (orig 2): fwd0 [4,5], reaches node 1 at 6.
    # At 7 node 1 holds A's backward and C's forward: 1f1b takes the backward, gpipe the forward.
    s = Schedule([[0, 2], [1]], [MicroBatch(0, 0, [(1, 1)]), MicroBatch(1, 2, [(1, 1)], start_s=3.0),
                                 MicroBatch(2, 2, [(1, 1)])], memory=3)
    c = CostModel(d_model=1, tokens_per_sample=1, samples=1, dtype_bytes=1, layers_per_stage=[1, 2],
                  s_per_sample_per_layer=1.0, hop_overhead_s=0.0, dp_mode="none")
    t = topo(3, lat=1.0, bw=1e15)
    order = lambda r: [(e.kind, e.mb, round(e.start, 6)) for e in r.timeline
                       if e.node == 1 and e.kind in ("fwd", "bwd")]
    r = simulate(s, t, c)
    assert order(r)[:3] == [("fwd", 0, 2.0), ("fwd", 1, 5.0), ("bwd", 0, 7.0)]
    s.policy = "gpipe"
    r = simulate(s, t, c)
    assert order(r)[:3] == [("fwd", 0, 2.0), ("fwd", 1, 5.0), ("fwd", 2, 7.0)]


def test_dense_ring_sync_exact():
    # stage 1 has replicas 1 and 2; 4 bytes of gradient -> ring all-reduce: 2 steps of 2 bytes.
    # hop = 0.5 + 1 byte / 1 B/s = 1.5: fwd0 [0,1], fwd1 [2.5,3.5], loss [5,5.25],
    # bwd1 [6.75,8.25], bwd0 [9.75,11.25]; sync steps 0.5 + 2 = 2.5 s each: 8.25 -> 13.25
    s = Schedule([[0], [1, 2]], [MicroBatch(0, 0, [(1, 1)])], memory=1)
    c = cost(2, bytes_=1, dp="dense", params=[0, 4])
    r0 = simulate(s, topo(3), c, dp_sync=False)
    r = simulate(s, topo(3), c, dp_sync=True)
    assert r0.iteration_s == pytest.approx(11.25)
    assert r.sync_s[1] == pytest.approx((8.25, 13.25))
    assert r.iteration_s == pytest.approx(13.25)
    assert r.bytes_sync == 2 * 2 * 2  # 2 nodes x 2 steps x 2 bytes
    assert r.sync_s[0] == (11.25, 11.25)  # a single replica has nothing to sync


def test_deadlock_is_reported_not_hung():
    # reordered routes 1->2 and 2->1 with one credit per node: each waits for the other
    s = Schedule([[0, 3], [1], [2]], [MicroBatch(0, 0, [(1, 1), (2, 2)]), MicroBatch(1, 3, [(2, 2), (1, 1)])],
                 memory=1, max_swaps=1)
    r = simulate(s, topo(4), cost(3))
    assert r.deadlock and math.isinf(r.iteration_s) and math.isinf(r.score())
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(s, topo(4), cost(3), on_deadlock="raise")


def test_timeline_roundtrip_and_no_overlap():
    mbs = [MicroBatch(i, i % 2, [(1, 2 + i % 2), (2, 4)]) for i in range(6)]
    s = Schedule([[0, 1], [2, 3], [4]], mbs, memory=2)
    r = simulate(s, topo(5), cost(3))
    check_no_overlap(r.timeline)
    assert all(v <= 2 for v in max_in_flight(r.timeline).values())
    back = from_dicts(to_dicts(r.timeline))
    assert back == r.timeline
    assert sum(r.node_busy_s.values()) == pytest.approx(
        sum(e.end - e.start for e in r.timeline if e.kind in ("fwd", "bwd", "loss")))


def test_compressed_hops_only_on_slow_links():
    # nodes 0-1 on a fast link (2 GiB/s), 1-2 and 0-2 slow (0.1 GiB/s); d=64, 8 rows per message
    GiB = 2.0 ** 30
    bw = np.array([[1, 2, 0.1], [2, 1, 0.1], [0.1, 0.1, 1]]) * GiB
    t = Topology([Node(i, f"n{i}") for i in range(3)], np.zeros((3, 3)), bw)
    base = dict(d_model=64, tokens_per_sample=4, samples=2, layers_per_stage=[1, 1, 1],
                s_per_sample_per_layer=0.5, hop_overhead_s=0.0, dp_mode="none")
    plain = CostModel(**base)
    c8 = CostModel(**base, act_codec="int8", act_codec_s=0.25)
    c4 = CostModel(**base, act_codec="int4")
    assert c8.hop_codec(t, 0, 1) == "fp32" and c8.hop_codec(t, 1, 2) == "int8"
    assert c8.hop_bytes(t, 0, 1) == plain.activation_bytes == 8 * 64 * 4
    assert c8.hop_bytes(t, 1, 2) == 8 * (64 + 4) and c4.hop_bytes(t, 1, 2) == 8 * (32 + 4)
    assert c8.hop_s(t, 1, 2) == pytest.approx(8 * 68 / (0.1 * GiB) + 0.25)
    s = Schedule([[0], [1], [2]], [MicroBatch(0, 0, [(1, 1), (2, 2)])], memory=1)
    r0 = simulate(s, t, plain)
    r8 = simulate(s, t, c8)
    # hops 0->1 (fast), 1->2 (slow), 2->0 (slow), and back: 2 fast + 4 slow messages
    assert r0.bytes_pipeline == 6 * 2048
    assert r8.bytes_pipeline == 2 * 2048 + 4 * 8 * 68
    comp = 1.0 * 3 + 0.25 * 1.0 + 1.5 * 3
    wire8 = 2 * 2048 / (2 * GiB) + 4 * (8 * 68 / (0.1 * GiB) + 0.25)
    assert r8.iteration_s == pytest.approx(comp + wire8)
    assert {e.bytes for e in r8.timeline if e.kind == "send"} == {2048, 8 * 68}


def test_a_node_serving_two_stages_runs_both_without_a_link_between_them():
    # node 1 serves stages 1 and 2: fwd0 1 | hop 2.6 | fwd1 1 | fwd2 1 (no hop) | hop 2.6 | loss .25
    # | hop 2.6 | bwd2 1.5 | bwd1 1.5 | hop 2.6 | bwd0 1.5
    s = Schedule([[0], [1], [1]], [MicroBatch(0, 0, [(1, 1), (2, 1)])], memory=1)
    s.validate(("placement", "originators", "stage0_ends", "no_repeat", "memory"), n_nodes=2)
    r = simulate(s, topo(2), cost(3, overhead=0.1))
    assert r.iteration_s == pytest.approx(1 + 2.6 + 1 + 1 + 2.6 + 0.25 + 2.6 + 1.5 + 1.5 + 2.6 + 1.5)
    assert r.bytes_pipeline == 4 * 2
    assert r.node_busy_s == {0: pytest.approx(2.75), 1: pytest.approx(5.0)}
    kinds = [(e.node, e.kind, e.stage) for e in r.timeline if e.kind in ("fwd", "bwd", "loss")]
    assert kinds == [(0, "fwd", 0), (1, "fwd", 1), (1, "fwd", 2), (0, "loss", 0), (1, "bwd", 2),
                     (1, "bwd", 1), (0, "bwd", 0)]


def test_a_micro_batch_takes_one_credit_on_a_node_whatever_stages_it_visits_there():
    # one credit per node: with per-visit credits node 1 could never start stage 2 of micro-batch
    # 0 while holding its stage 1 (a deadlock); per micro-batch it runs both, then micro-batch 1
    two = Schedule([[0], [1], [1]], [MicroBatch(0, 0, [(1, 1), (2, 1)]), MicroBatch(1, 0, [(1, 1), (2, 1)])],
                   memory=1)
    assert two.credit_free() == {(0, 2), (1, 2)}
    one = Schedule([[0], [1], [1]], [MicroBatch(0, 0, [(1, 1), (2, 1)])], memory=1)
    r = simulate(two, topo(2), cost(3))
    assert r.iteration_s == pytest.approx(2 * simulate(one, topo(2), cost(3)).iteration_s)
    assert max(r.max_in_flight.values()) == 1


def test_a_later_visit_never_waits_behind_a_forward_that_waits_for_a_credit():
    """Node 2 serves stages 1 and 2 with one credit.  Micro-batch 0 holds it (stage 1) and its
    stage 2 is queued on node 2 behind micro-batch 1's stage 1, which waits for that credit: the
    credit-free stage 2 runs first (it would otherwise wait forever: a deadlock)."""
    s = Schedule([[0, 1], [2], [2]], [MicroBatch(0, 0, [(1, 2), (2, 2)]), MicroBatch(1, 1, [(1, 2), (2, 2)])],
                 memory=1)
    t = Topology([Node(i, "x") for i in range(3)], np.full((3, 3), 0.0), np.full((3, 3), 1e12))
    c = CostModel(d_model=1, tokens_per_sample=1, samples=1, layers_per_stage=[1, 1, 1],
                  s_per_sample_per_layer=1.0, hop_overhead_s=0.0)
    r = simulate(s, t, c)
    assert not r.deadlock
    order = [(e.kind, e.mb, e.stage) for e in r.timeline if e.node == 2 and e.kind in ("fwd", "bwd")]
    assert order[:2] == [("fwd", 0, 1), ("fwd", 0, 2)] and order.index(("fwd", 1, 1)) > order.index(("bwd", 0, 1))


def test_crossing_between_two_nodes_that_serve_the_same_stages_deadlocks_and_keeping_on_the_node_does_not():
    """Nodes 2 and 3 both serve stages 1 and 2, one credit each: micro-batch 0 goes 2 -> 3, micro-
    batch 1 goes 3 -> 2; each holds one node's credit and waits for the other's.  Kept on the node
    it is on (``keep_on_node``), each stays on its node and both finish."""
    pl = [[0, 1], [2, 3], [2, 3], [4]]
    crossing = Schedule(pl, [MicroBatch(0, 0, [(1, 2), (2, 3)]), MicroBatch(1, 1, [(1, 3), (2, 2)])], memory=1)
    t = Topology([Node(i, "x") for i in range(5)], np.full((5, 5), 0.1), np.full((5, 5), 1e9))
    assert simulate(crossing, t, cost(4)).deadlock
    kept = crossing.keep_on_nodes()
    assert [m.route for m in kept.micro_batches] == [[(1, 2), (2, 2)], [(1, 3), (2, 3)]]
    assert not simulate(kept, t, cost(4)).deadlock


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), S=st.integers(3, 6), memory=st.integers(1, 3), gpipe=st.booleans(),
       data=st.data())
def test_ascending_routes_kept_on_their_nodes_never_deadlock(seed, S, memory, gpipe, data):
    """Any ascending routes kept on their nodes (``Schedule.keep_on_nodes``), any memory, any node
    speeds and latencies: with each node's stages consecutive (nodes 2 and 3 serve a block of
    stages together, stage 0 among them or not, listed first; each stage of the block may also
    have a node serving it alone; the other stages have nodes of their own) the memory credits
    never deadlock."""
    first = data.draw(st.integers(0, S - 2), label="first shared stage")
    last = data.draw(st.integers(max(first, 1), S - 1), label="last shared stage")
    alone = data.draw(st.lists(st.booleans(), min_size=S, max_size=S), label="a node alone in each stage")
    pl = [[2, 3, 0, 1] if first == 0 else [0, 1]]
    nxt = 4
    for s in range(1, S):
        if first <= s <= last:
            pl.append([2, 3] + [nxt] * alone[s])
            nxt += alone[s]
        else:
            pl.append([nxt, nxt + 1])
            nxt += 2
    rng = np.random.default_rng(seed)
    mbs = []
    for j in range(data.draw(st.integers(2, 8), label="micro-batches")):
        k = int(rng.integers(1, S))
        stages = sorted(rng.choice(np.arange(1, S), size=k, replace=False).tolist())
        mbs.append(MicroBatch(j, int(rng.choice(pl[0])), [(s, int(rng.choice(pl[s]))) for s in stages]))
    sched = Schedule(pl, mbs, memory=memory, policy="gpipe" if gpipe else "1f1b").keep_on_nodes()
    lat = rng.uniform(0.0, 0.5, (nxt, nxt))
    t = Topology([Node(i, "x", float(rng.uniform(0.3, 2.0))) for i in range(nxt)], lat, np.full((nxt, nxt), 1e9))
    assert not simulate(sched, t, cost(S)).deadlock


def test_placement_may_share_a_node_between_stages_but_not_list_it_twice_in_one():
    ok = Schedule([[0], [1, 2], [1, 2], [3]], [MicroBatch(0, 0, [(1, 2), (2, 2), (3, 3)])], memory=1)
    ok.validate(n_nodes=4)
    assert ok.stages_of() == {0: [0], 1: [1, 2], 2: [1, 2], 3: [3]}
    assert ok.stage_of() == {0: 0, 1: 1, 2: 1, 3: 3} and ok.hosts_several()
    from skiptrain.schedule.schedule import ScheduleError

    with pytest.raises(ScheduleError, match="listed more than once"):
        Schedule([[0], [1, 1]], [], memory=1).validate(n_nodes=2)
    with pytest.raises(ScheduleError, match=r"node 1 serves stage\(s\) \[1, 2\]"):
        Schedule([[0], [1], [1], [2]], [MicroBatch(0, 0, [(3, 1)])], memory=1).validate(("placement",), n_nodes=3)


@pytest.mark.parametrize("kw,needle", [
    ({"hop_overhead_s": -1.0}, "cost model hop_overhead_s=-1.0 is not a number of seconds in [0, 1e+06]"),
    ({"s_per_sample_per_layer": -1.0}, "cost model s_per_sample_per_layer=-1.0 is not a number of seconds"),
    ({"act_fast_GBps": -1.0}, "cost model act_fast_GBps=-1.0 must be >= 0"),
])
def test_a_negative_cost_model_time_names_the_field(kw, needle):
    from skiptrain.schedule.cost import CostError

    with pytest.raises(CostError) as e:
        CostModel(**kw)
    assert needle in str(e.value)
