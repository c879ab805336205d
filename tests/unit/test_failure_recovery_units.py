"""Surviving killed, hung and bad peers, the units (no process started): the re-plan for
surviving nodes, payload checks, the HMAC challenge-response.  The tests that start processes
are in tests/integration/test_failure_recovery.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from skiptrain.config import build_config
from skiptrain.runtime.join import respond, verify
from skiptrain.runtime.job import Job, Phase, with_runtime
from skiptrain.runtime.recovery import (BadPayload, RecoveryError, check_payload, checkfree_combine, replan,
                                        stage_grad_norms, stage_tensors)
from skiptrain.runtime.transport import ACT, GRAD
from skiptrain.schedule.schedule import MicroBatch, Schedule


PLACEMENT = [[0, 1, 2], [3, 4], [5, 6], [7]]


def _schedule(mb_per_orig: int = 2) -> Schedule:
    mbs, k = [], 0
    for i in range(mb_per_orig):
        for o in PLACEMENT[0]:
            mbs.append(MicroBatch(k, o, [(1, PLACEMENT[1][k % 2]), (2, PLACEMENT[2][(k + 1) % 2]), (3, 7)]))
            k += 1
    return Schedule(placement=[list(p) for p in PLACEMENT], micro_batches=mbs, memory=2, method="test")


# ---- units ------------------------------------------------------------------------------------

def test_replan_moves_hops_to_replicas_and_skips_stages_without_one():
    s = _schedule()
    r = replan(s, set(range(8)) - {4, 7})
    assert r.placement == [[0, 1, 2], [3], [5, 6], []]
    assert sorted(m.id for m in r.micro_batches) == sorted(m.id for m in s.micro_batches)
    for m in r.micro_batches:
        assert m.stages == [1, 2]                    # stage 3 skipped by every route, order kept
        assert m.route[0] == (1, 3)
    r.validate(claims=("originators", "stage0_ends", "no_repeat"))


def test_replan_gives_a_dead_originators_micro_batches_to_survivors():
    s = _schedule()
    lost = [m.id for m in s.micro_batches if m.originator == 1]
    r = replan(s, set(range(8)) - {1})
    assert sorted(m.id for m in r.micro_batches) == list(range(6))   # same ids = same samples
    per = Counter(m.originator for m in r.micro_batches)
    assert set(per) == {0, 2} and per[0] == per[2] == 3
    assert all(r.micro_batches[i].id in lost for i in range(4, 6))   # appended after their own
    # deterministic: every survivor computes the same schedule
    assert replan(s, set(range(8)) - {1}).to_dict() == r.to_dict()


def test_replan_without_stage0_is_unrecoverable():
    with pytest.raises(RecoveryError, match="no stage-0 node"):
        replan(_schedule(), {3, 4, 5, 6, 7})


def test_check_payload_rejects_bad_tensors_naming_the_peer():
    good = torch.zeros(2, 4, 8)
    check_payload(ACT, good, 5, (2, 4, 8), 0, 1)
    with pytest.raises(BadPayload, match="from node 5.*non-finite") as ei:
        check_payload(ACT, good * float("nan"), 5, (2, 4, 8), 3, 1)
    assert ei.value.node == 5
    with pytest.raises(BadPayload, match="shape"):
        check_payload(GRAD, torch.zeros(2, 4), 6, (2, 4, 8), 3, 1)
    with pytest.raises(BadPayload, match="dtype"):
        check_payload(GRAD, torch.zeros(2, 4, 8, dtype=torch.float64), 6, (2, 4, 8), 3, 1)


def test_replan_takeover_moves_a_replica_into_the_empty_stage():
    s = _schedule()
    r = replan(s, set(range(8)) - {7}, takeover=True)
    # stages 1 and 2 both have two replicas: the lower stage gives its highest-id node
    assert r.placement == [[0, 1, 2], [3], [5, 6], [4]] and r.meta["takeover"] == {4: [1, 3]}
    for m, old in zip(sorted(r.micro_batches, key=lambda m: m.id), s.micro_batches):
        assert m.stages == [1, 2, 3] and m.route[0] == (1, 3) and m.route[1] == old.route[1]
        assert m.route[2] == (3, 4)
    r.validate(claims=("placement", "originators", "stage0_ends", "no_repeat"))
    # without a replicated body stage nothing can take over: the stage stays skipped
    r2 = replan(r, set(range(8)) - {7, 4, 6}, takeover=True)
    assert r2.placement == [[0, 1, 2], [3], [5], []] and r2.meta["takeover"] == {}


def test_checkfree_combines_neighbours_by_gradient_norm():
    a, b = torch.ones(4), torch.full((4,), 3.0)
    w, coef = checkfree_combine([a, b], [1.0, 3.0])
    assert coef == [0.25, 0.75] and torch.allclose(w, torch.full((4,), 2.5))
    w, coef = checkfree_combine([a, b], [0.0, float("nan")])       # no usable norm: plain mean
    assert coef == [0.5, 0.5] and torch.allclose(w, torch.full((4,), 2.0))
    from skiptrain.model.transformer import StagedLM
    m = StagedLM(build_config("tiny").model, stages=[1, 2])
    t1, t2 = stage_tensors(m, 1), stage_tensors(m, 2)
    assert [(j, n, p.shape) for j, n, p in t1] == [(j, n, p.shape) for j, n, p in t2]   # layer j <-> layer j
    # a node serving stages 1 and 2 weighs each as a neighbour by that stage's gradient norm alone
    for s, (_, _, p) in ((1, t1[0]), (2, t2[0])):
        p.grad = torch.full_like(p, float(s))
    norms = stage_grad_norms(m, [1, 2])
    assert norms == {1: pytest.approx(t1[0][2].numel() ** 0.5), 2: pytest.approx(2 * t2[0][2].numel() ** 0.5)}


def test_join_challenge_response_needs_the_secret():
    nonce = "ab" * 32
    r = respond("s3cret", nonce, 4)
    assert verify("s3cret", nonce, 4, r)
    assert r != "s3cret" and "s3cret" not in r                    # the secret is not on the wire
    assert not verify("other", nonce, 4, respond("other2", nonce, 4))
    assert not verify("s3cret", "cd" * 32, 4, r)                  # bound to the nonce (no replay)
    assert not verify("s3cret", nonce, 5, r)                      # bound to the node id


def _shared_schedule() -> Schedule:
    """Nodes 2 and 3 serve stages 1 and 2 (listed first), node 4 stage 2 alone, node 5 stage 3;
    routes kept on their nodes, two of them skipping stage 1 (one straight to node 4)."""
    return Schedule(placement=[[0, 1], [2, 3], [2, 3, 4], [5]], memory=2, method="test", micro_batches=[
        MicroBatch(0, 0, [(1, 2), (2, 2), (3, 5)]), MicroBatch(1, 1, [(1, 3), (2, 3), (3, 5)]),
        MicroBatch(2, 0, [(2, 4), (3, 5)]), MicroBatch(3, 1, [(1, 3), (2, 3), (3, 5)])])


def test_replan_keeps_every_stage_of_a_shared_node_and_never_moves_it_into_a_lost_stage():
    """Nodes 2 and 3 serve stages 1 and 2, node 4 stage 2 alone: after node 3 dies, node 2 keeps
    both stages (its hops stay, a route may still visit it twice) and node 3's hops go to the
    survivors, kept on their nodes (a stage-2 hop after node 2's stage 1 stays on node 2; one
    straight from an originator may go to node 4); when stage 3 is lost, node 4 (alone on its
    stage) takes it over, never node 2."""
    sched = _shared_schedule()
    new = replan(sched, {0, 1, 2, 4, 5})
    assert new.placement == [[0, 1], [2], [2, 4], [5]]
    assert new.micro_batches[0].route == [(1, 2), (2, 2), (3, 5)]          # untouched: node 2 alive
    assert new.micro_batches[1].route == [(1, 2), (2, 2), (3, 5)]          # node 3's pair of stages
    assert new.micro_batches[2].route == [(2, 4), (3, 5)]                  # node 4 keeps its hops
    assert all(n != 3 for m in new.micro_batches for _, n in m.route)
    routes = [list(m.route) for m in new.micro_batches]
    assert [m.route for m in new.keep_on_nodes().micro_batches] == routes
    new.validate(claims=("placement", "originators", "stage0_ends", "no_repeat"))
    took = replan(sched, {0, 1, 2, 3, 4}, takeover=True)
    assert took.meta["takeover"] == {4: [2, 3]} and took.placement == [[0, 1], [2, 3], [2, 3], [4]]
    shared_only = Schedule(placement=[[0, 1], [2, 3], [2, 3], [4]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + k % 2), (2, 2 + k % 2), (3, 4)]) for k in range(4)])
    lost = replan(shared_only, {0, 1, 2, 3}, takeover=True)          # no donor serves one stage alone
    assert lost.meta["takeover"] == {} and lost.placement[3] == []
    assert all(m.stages == [1, 2] for m in lost.micro_batches)


def test_a_stage_lost_for_good_is_filled_from_the_job_checkpoint_in_the_merged_model(tmp_path):
    from skiptrain.checkpoint.manager import CheckpointManager
    from skiptrain.checkpoint.state import model_tensors
    from skiptrain.model.transformer import StagedLM
    from skiptrain.runtime.outputs import lost_stages_from_checkpoints

    cfg = build_config("tiny")
    job = Job(config=with_runtime(cfg.to_dict(), recover=True), data_path="-", run_dir=str(tmp_path),
              phases=[Phase("train", _schedule().to_dict(), iterations=4)])
    m2 = StagedLM(cfg.model, stages=[2], seed=5)
    mgr = CheckpointManager(tmp_path / "checkpoints", keep=2)
    mgr.save(3, model_tensors(m2), state={"stage": 2}, blocking=True)
    mgr.close()
    got = lost_stages_from_checkpoints(job, tmp_path, {"stage0", "stage1"})
    want = model_tensors(m2)
    init3 = model_tensors(StagedLM(cfg.model, stages=[3], seed=cfg.train.seed))   # no checkpoint: initial weights
    assert got.keys() == want.keys() | init3.keys()
    assert all(torch.equal(got[k], want[k]) for k in want) and all(torch.equal(got[k], init3[k]) for k in init3)
    notes = json.loads((tmp_path / "lost_stages.json").read_text())
    assert "checkpoint after iteration 3" in notes["2"] and "INITIAL (untrained) weights" in notes["3"]
