"""Multi-process skip-pipeline runtime (skiptrain.runtime): units, exact equivalence with the
single-process trainer, a short training run, and failure handling (killed and hung peers).

Here the units, which start no process; the tests that start processes are in
tests/integration/test_runtime.py."""

from __future__ import annotations

import pytest
import torch

from skiptrain.config import build_config
from skiptrain.runtime.executor import node_plan
from skiptrain.runtime.transport import (ACT, GRAD, LocalTransport, TransportError, decode_header, encode_header,
                                        header_generation)
from skiptrain.runtime.wan import LinkFifo
from skiptrain.schedule.schedule import MicroBatch, Schedule


# ---- units ------------------------------------------------------------------------------------

def test_link_fifo_queues_messages_like_the_simulator():
    lat = [[0.0, 0.1], [0.1, 0.0]]
    inv = [[0.0, 1 / 1000.0], [1 / 1000.0, 0.0]]      # 1000 B/s
    link = LinkFifo(0, lat, inv, bytes_scale=2.0, hop_overhead_s=0.05)
    assert link.schedule(1, 100, 0.0) == pytest.approx((0.0, 0.2 + 0.1 + 0.05))
    # second message queues behind the first: starts when the first left the link (0.2 s)
    assert link.schedule(1, 100, 0.1) == pytest.approx((0.2, 0.4 + 0.15))
    link.reset()
    assert link.schedule(1, 100, 0.1)[0] == pytest.approx(0.1)


def test_header_round_trip_and_rejects_garbage():
    h = encode_header(GRAD, 7, 12, 3, (8, 64, 32))
    assert decode_header(h) == (GRAD, 7, 12, 3, (8, 64, 32), "fp32")
    assert decode_header(encode_header(ACT, 1, 2, 0, (2, 4, 8), "int4"))[-1] == "int4"
    assert header_generation(encode_header(ACT, 1, 2, 0, (2, 4, 8), gen=5)) == 5      # (a receiver in
    assert header_generation(h) == 0                                                   # another one rejects it)
    for bad in ([9, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 7, 1, 4, 0, 0, 0], [0, 0, 0, 0, 0, 1, -4, 0, 0, 0]):
        with pytest.raises(TransportError):
            decode_header(torch.tensor(bad))


def test_local_transport_applies_the_codec_both_ways():
    x = torch.randn(2, 8, 16)
    tr = LocalTransport(0, "int8")
    tr.send(0, ACT, 3, 1, x)
    got = tr.inbox.get_nowait().tensor
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert got.shape == x.shape and not torch.equal(got, x) and bool(((got - x).abs() <= scale / 2 + 1e-7).all())
    plain = LocalTransport(0)
    plain.send(0, GRAD, 0, 0, x)
    assert plain.inbox.get_nowait().tensor is x          # fp32: delivered as it is


def test_node_plan_counts_tasks_and_messages():
    s = Schedule(placement=[[0, 1], [2], [3]], memory=2, skip_ratio=0.0, micro_batches=[
        MicroBatch(0, 0, [(1, 2), (2, 3)]), MicroBatch(1, 1, [(2, 3)]), MicroBatch(2, 0, [])])
    p0, p2, p3 = node_plan(s, 0), node_plan(s, 2), node_plan(s, 3)
    assert p0.n_tasks == 6 and p0.inject == [0, 2]
    assert p0.incoming == {(ACT, 0, 3): 3, (GRAD, 0, 0): 2}
    assert p2.n_tasks == 2 and p2.incoming == {(ACT, 0, 1): 0, (GRAD, 0, 1): 3}
    assert p3.n_tasks == 4 and p3.incoming[(GRAD, 0, 2)] == 0 and p3.incoming[(ACT, 1, 1)] == 1


def test_node_stages_refusals_name_the_conflict():
    from skiptrain.config import ConfigError

    def cfg(**rt):
        return build_config("tiny", overrides={"runtime": {"nodes": 3, **rt}})

    assert cfg(node_stages="0,1+2,3", method="full_pipeline").runtime.node_stages
    assert cfg(node_stages="0,1+2,3").runtime.method == "planner"       # the planner plans shared nodes
    assert cfg(node_stages="0,1+2,3", drift_threshold=0.2).runtime.drift_threshold == 0.2   # routes only
    assert cfg(node_stages="0,1+2,3", recover=True, takeover=True).runtime.recover     # never moves a shared node
    for rt, msg in (({"node_stages": "0,1+2", "method": "random_skip"}, r"stage\(s\) \[3\] no node"),
                    ({"node_stages": "0,1+2,3,4", "method": "random_skip"}, "model.n_stages=4"),
                    ({"node_stages": "0,1+2,3", "stage_sizes": "1,1,1", "method": "random_skip"}, "set only one"),
                    ({"nodes": 5, "node_stages": "0,1,1+2,2,3", "method": "random_skip"}, "same position"),
                    # 4 is replica 1 of both stages, but after 2 or 3 fails it would not be: refused
                    ({"nodes": 7, "node_stages": "0,0,1,2,1+2,1+2,3", "method": "random_skip"}, "first, in the same order"),
                    ({"node_stages": "0,1+3,2"}, "consecutive")):
        with pytest.raises(ConfigError, match=msg):
            cfg(**rt)
    # elastic freezing takes such a node (its first transition moves its stages' state out)
    build_config("tiny", overrides={"runtime": {"nodes": 3, "node_stages": "0,1+2,3"}, "elastic": {"enabled": True}})
