"""Joining a running job: a node started with ``--join HOST:PORT`` passes the HMAC challenge, is
placed on the stage where it shortens the iteration most, receives weights, optimizer and sync
state from the live replicas over the wire (moves planned by the layout-change core) and starts at
an iteration boundary; a process with a wrong secret is refused and never enters a process group.
Units: ``add_replica``, ``choose_stage``, ``join_transfers``, the state by name from several
senders.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_join.py."""

from __future__ import annotations


import pytest
import torch

from skiptrain.config import build_config
from skiptrain.net.topology import load_topology
from skiptrain.runtime.job import build_cost
from skiptrain.runtime.join_placement import add_replica, choose_stage, join_transfers
from skiptrain.runtime.recovery import replan
from skiptrain.schedule.schedule import MicroBatch, Schedule


def _sched() -> Schedule:
    return Schedule(placement=[[0, 1], [2], [3], [4]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2), (2, 3), (3, 4)]) for k in range(4)])


# ---- units ------------------------------------------------------------------------------------

def test_add_replica_balances_hops_and_restores_a_skipped_stage():
    s = _sched()
    r = add_replica(s, 7, 2)
    assert r.placement[2] == [3, 7]
    hops = [n for m in r.micro_batches for st, n in m.route if st == 2]
    assert sorted(hops) == [3, 3, 7, 7] and [m.id for m in r.micro_batches] == [0, 1, 2, 3]
    r.validate(claims=("placement", "originators", "stage0_ends", "no_repeat"))
    lost = replan(s, {0, 1, 2, 4})                           # stage 2 lost: skipped by every route
    assert all(m.stages == [1, 3] for m in lost.micro_batches)
    back = add_replica(lost, 7, 2, original=s)
    assert back.placement[2] == [7] and all(m.route == [(1, 2), (2, 7), (3, 4)] for m in back.micro_batches)
    with pytest.raises(ValueError, match="body stage"):
        add_replica(s, 7, 0)


def test_choose_stage_takes_the_empty_stage_first_else_the_best_simulated():
    cfg = build_config("tiny", overrides={"runtime": {"s_per_sample_layer": 1e-3}})
    cfg.model.vocab_size = 256
    cost = build_cost(cfg)
    topo = load_topology("geo12", 8)
    s = _sched()
    lost = replan(s, {0, 1, 2, 4})
    stage, rep = choose_stage(lost, 7, s, topo, cost)
    assert stage == 2 and rep["rule"] == "empty stage"
    stage, rep = choose_stage(s, 7, s, topo, cost)
    sims = {int(k): v for k, v in rep["simulated_s"].items()}
    assert set(sims) == {1, 2, 3} and sims[stage] == min(sims.values())
    assert rep["simulated_before_s"] >= sims[stage]


def test_garbled_join_input_is_refused_not_a_crash():
    from skiptrain.runtime.join import respond, verify

    nonce = "ab" * 32
    good = respond("s3cret", nonce, 7)
    assert verify("s3cret", nonce, 7, good)
    assert not verify("s3cret", nonce, 8, good) and not verify("other", nonce, 7, good)
    for bad in ["", "\u00e9" * 64, "\ufffd", good[:-1], good + "0", None, 12]:
        assert verify("s3cret", nonce, 7, bad) is False          # wrong, never an exception


def test_join_transfers_spread_over_live_replicas_and_keep_one_source_when_replicas_drift():
    from skiptrain.model.partition import Partition

    part = Partition((1, 1, 1))
    sizes = {f"layers.1.w{i}": 100 for i in range(6)} | {"optim.exp_avg.layers.1.w0": 100, "tok_emb.weight": 50,
                                                          "layers.2.w": 10}
    placement = [[0], [1, 2, 7], [3, 8]]              # 7 joins stage 1 (two live replicas), 8 stage 2
    plan = join_transfers(sizes, part, placement, {7: 1, 8: 2})
    to7 = [t for t in plan if t.dst == 7]
    assert sorted(t.src for t in to7) == [1, 2]                       # the bytes spread over both
    assert sorted(n for t in to7 for n in t.names) == sorted(n for n in sizes if n.startswith(("layers.1", "optim")))
    assert abs(to7[0].nbytes - to7[1].nbytes) <= 100
    assert [(t.src, t.names) for t in plan if t.dst == 8] == [(3, ["layers.2.w"])]
    assert {t.dst for t in plan} == {7, 8}                            # live replicas receive nothing
    drift = join_transfers(sizes, part, placement, {7: 1, 8: 2}, drift=True)
    assert sorted(t.src for t in drift if t.dst == 7) == [1]
    # a joiner on a stage with no live replica is left to the caller (checkpoint or CheckFree)
    assert join_transfers(sizes, part, [[0], [1], [9]], {9: 2}) == []


def test_stage_state_from_several_senders_loads_by_name_without_pickle():
    from skiptrain.checkpoint.wire import pack_state
    from skiptrain.dp import make_strategy
    from skiptrain.model.transformer import StagedLM
    from skiptrain.optim import build_optimizer
    from skiptrain.runtime.job_checkpoint import load_stage_state, stage_state, sync_tensors
    from skiptrain.runtime.step import HostedStage, optimizer_step
    from skiptrain.runtime.transition import gather_state

    cfg = build_config("tiny", overrides={"dp": {"strategy": "diloco", "sync_every": 2}})
    a, b = StagedLM(cfg.model, stages=[2], seed=1), StagedLM(cfg.model, stages=[2], seed=2)
    sa = make_strategy(cfg.dp, a.named_parameters(), None, cfg.train)
    oa = build_optimizer(a.named_parameters(), cfg.train, sa.update_rule)
    for p in a.parameters():
        p.grad = torch.randn_like(p)
    optimizer_step([HostedStage(2, sa, 1)], oa, 1e-3, 1.0)
    sb = make_strategy(cfg.dp, b.named_parameters(), None, cfg.train)
    ob = build_optimizer(b.named_parameters(), cfg.train, sb.update_rule)
    names = sorted(stage_state(a, oa, sa, 0)[0])
    extra, scalars = sync_tensors(sa)
    halves = [pack_state(a, oa, names[k::2], {"strategy": scalars}, extra) for k in (0, 1)]   # two senders
    tensors, record, got_scalars = gather_state(None, None, None, halves, set(names))
    assert sorted(tensors) == names
    load_stage_state(b, ob, sb, tensors, record, got_scalars)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert sb.step_count == sa.step_count == 1
    ta, tb = sa.state_dict()["tensors"], sb.state_dict()["tensors"]
    assert ta and ta.keys() == tb.keys() and all(torch.equal(ta[n][k], tb[n][k]) for n in ta for k in ta[n])
    # the optimizer's moments travelled by name too: the next step is the same on both
    for p, q in zip(a.parameters(), b.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    oa.step()
    ob.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    weight = next(n for n, _ in b.named_parameters())
    with pytest.raises(ValueError, match=f"lacks weight {weight}"):
        load_stage_state(b, ob, sb, {n: t for n, t in tensors.items() if n != weight}, record, got_scalars)


def test_a_node_joining_a_schedule_of_one_stage_becomes_a_data_parallel_replica():
    one = Schedule(placement=[[0, 1]], memory=2, method="test",
                   micro_batches=[MicroBatch(k, k % 2, []) for k in range(6)])
    stage, choice = choose_stage(one, 2)
    assert stage == 0 and choice["candidates"] == [0]
    new = add_replica(one, 2, 0)
    assert new.placement == [[0, 1, 2]]
    per = {n: sorted(m.id for m in new.micro_batches if m.originator == n) for n in (0, 1, 2)}
    assert sorted(len(v) for v in per.values()) == [2, 2, 2]
    assert sorted(i for v in per.values() for i in v) == list(range(6))     # the same samples, once each
    with pytest.raises(ValueError, match="stage 0 of a schedule of one stage"):
        add_replica(_sched(), 5, 0)
