"""Issue 8: training that survives killed, hung and bad peers without a restart, and admits
only nodes that answer the join challenge.

Units: the re-plan for surviving nodes, payload checks, the HMAC challenge-response.
Multi-process: one 8-node run where one node lacks the join secret (refused before any process
group) and with four
faults at four iterations (a killed sole replica of a body stage mid-iteration, a killed stage-0
originator, a hung node found by the heartbeat deadline, a peer sending NaN activations); the run
finishes, every detection is logged with node, cause and time, and the samples trained over the
whole run are exactly the global sample cursor's, none lost, none repeated."""

from __future__ import annotations

import json
from pathlib import Path
from collections import Counter

import pytest
import torch

from conftest import launch_in_a_process, metrics_lines, processes_of_run, wait_for
from skiptrain.config import build_config
from skiptrain.runtime.failure import RuntimeFailure
from skiptrain.runtime.faults import faulty_job
from skiptrain.runtime.join import respond, verify
from skiptrain.runtime.job import Job, Phase, with_runtime
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.recovery import (BadPayload, RecoveryError, check_payload, checkfree_combine, replan,
                                        stage_grad_norms, stage_tensors, trained_samples)
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


# ---- multi-process ------------------------------------------------------------------------------

def _job(byte_data, run_dir, faults, iterations, deadline_s=4.0):
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1}})
    return Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=deadline_s, recover=True),
               data_path=str(byte_data), run_dir=str(run_dir),
               phases=[Phase("p", _schedule().to_dict(), iterations=iterations)], **faulty_job(faults))


def test_run_refuses_a_node_without_the_secret_and_survives_kill_originator_kill_hang_and_bad_peer(byte_data, tmp_path):
    faults = [
        {"node": 3, "kind": "wrong_secret"},                           # refused at admission
        {"node": 7, "kind": "kill", "iteration": 1, "where": "after_pipeline"},   # sole replica of stage 3, mid-iteration
        {"node": 1, "kind": "kill", "iteration": 2},                   # a stage-0 originator
        {"node": 4, "kind": "hang", "iteration": 3},                   # stage 1, found by heartbeat deadline
        {"node": 6, "kind": "nan", "iteration": 4},                    # stage 2 sends NaN activations
    ]
    iters = 6
    run = tmp_path / "run"
    res = launch(_job(byte_data, run, faults, iters), timeout_s=240)
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    by_node = {r["node"]: r for r in rec}
    assert set(by_node) == {3, 7, 1, 4, 6}, rec
    assert by_node[3]["refused"] and by_node[3]["gen"] == 0 and "wrong challenge response" in by_node[3]["cause"]
    log3 = (run / "logs" / "node3.log").read_text()
    assert "refused by the coordinator" in log3 and "generation" not in log3   # never entered a group
    rec = [r for r in rec if r["node"] != 3]
    assert "died (killed by SIGKILL)" in by_node[7]["cause"] and "died" in by_node[1]["cause"]
    assert "stopped responding" in by_node[4]["cause"] and by_node[4]["fenced"]
    assert "bad peer" in by_node[6]["cause"] and "non-finite" in by_node[6]["cause"] and by_node[6]["fenced"]
    assert all(r["detect_s"] is not None and r["detect_s"] >= 0 for r in rec)
    assert [r["gen"] for r in sorted(rec, key=lambda r: r["gen"])] == [1, 2, 3, 4]
    # training went on: one metrics row per iteration, finite losses, fewer nodes after failures
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, iters + 1))
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in rows)
    assert rows[0]["nodes"] == 7 and rows[-1]["nodes"] == 3
    # every global sample of the run's cursor trained exactly once: none lost, none repeated
    gb = 6 * build_config("tiny").train.micro_batch
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]   # dead nodes' too
    assert sorted(trained) == list(range(iters * gb))
    # survivors recorded their recoveries
    n0 = json.loads((run / "phases" / "p" / "node0.json").read_text())
    assert len(n0["recoveries"]) == 4 and n0["recoveries"][-1]["alive"] == [0, 2, 5]
    assert processes_of_run(run) == []


def test_losing_every_stage0_node_stops_the_run(byte_data, tmp_path):
    faults = [{"node": n, "kind": "kill", "iteration": 1} for n in (0, 1, 2)]
    run = tmp_path / "run"
    with pytest.raises(RuntimeFailure):
        launch(_job(byte_data, run, faults, 3), timeout_s=120)
    assert processes_of_run(run) == []


def test_a_replica_takes_over_a_lost_stage_with_checkfree_init(byte_data, tmp_path):
    """Stages 2/2/1/1: the sole stage-2 node dies; the higher-id stage-1 replica takes stage 2
    over, initialised by CheckFree from stages 1 and 3, and training goes on with every stage.
    The phase carries a (static) topology and cost model, so after the recovery rank 0 has the
    planner re-plan the routes for the surviving placement (recorded whether adopted or not)."""
    from skiptrain.net.topology import load_topology
    from skiptrain.runtime.job import build_cost

    sched = Schedule(placement=[[0, 1], [2, 3], [4], [5]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + (k // 2) % 2), (2, 4), (3, 5)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1}})
    run = tmp_path / "run"
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True, takeover=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=3, cost=build_cost(cfg).to_dict(),
                            topology=load_topology("cluster", 6).to_dict())],
              **faulty_job({"node": 4, "kind": "kill", "iteration": 1}))
    res = launch(job, timeout_s=180)
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] < 10 for r in rows)
    n3 = json.loads((run / "phases" / "p" / "node3.json").read_text())
    (tk,) = n3["takeovers"]
    assert tk["stage"] == 2 and tk["from_stage"] == 1 and tk["init"] == "checkfree"
    assert tk["neighbours"] == [1, 3] and abs(sum(tk["coef"]) - 1) < 1e-9 and all(g > 0 for g in tk["grad_norms"])
    assert n3["stage"] == 2 and n3["iterations"][-1]["n_processed"] == 4     # every micro-batch visits stage 2
    n0 = json.loads((run / "phases" / "p" / "node0.json").read_text())
    rp = [r for r in n0.get("replans", []) if r.get("trigger") == "recovery"]
    assert len(rp) == 1 and rp[0]["simulated_current_s"] is not None, n0.get("replans")
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(3 * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []


def test_a_second_failure_during_recovery_is_survived_too(byte_data, tmp_path):
    """Node 4 dies at iteration 1; node 2 dies as soon as it starts recovering from that (the
    others may be re-forming groups with it): the survivors recover again and finish."""
    sched = Schedule(placement=[[0, 1], [2, 3], [4], [5]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + (k // 2) % 2), (2, 4), (3, 5)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1}})
    run = tmp_path / "run"
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=6.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=3)], **faulty_job([{"node": 4, "kind": "kill", "iteration": 1},
                     {"node": 2, "kind": "kill", "iteration": 1, "where": "recover"}]))
    res = launch(job, timeout_s=180)
    assert [r["step"] for r in res.phase_iterations("p")] == [1, 2, 3]
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert {r["node"] for r in rec} == {4, 2} and all("died" in r["cause"] for r in rec)
    n0 = json.loads((run / "phases" / "p" / "node0.json").read_text())
    assert n0["recoveries"][-1]["alive"] == [0, 1, 3, 5]
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(3 * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []


def test_a_bad_peer_is_banned_after_its_strikes_and_its_stage_restarts_from_the_checkpoint(byte_data, tmp_path):
    """Stages 2/2/1/1, strikes = 2, job checkpoints every iteration: the sole stage-2 node sends
    NaN activations from iteration 2; the first rejection is a strike (the iteration is re-run with
    the same nodes), the second bans it; node 3 takes stage 2 over from the job's latest checkpoint
    (young enough: weights, optimizer and sync state), not CheckFree."""
    sched = Schedule(placement=[[0, 1], [2, 3], [4], [5]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + (k // 2) % 2), (2, 4), (3, 5)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1},
                                          "checkpoint": {"every": 1}})
    run = tmp_path / "run"
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True, takeover=True, strikes=2, ckpt_max_age=3),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=4)],
              **faulty_job({"node": 4, "kind": "nan", "iteration": 2}))
    res = launch(job, timeout_s=180)
    assert [r["step"] for r in res.phase_iterations("p")] == [1, 2, 3, 4]
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert [r["node"] for r in rec] == [4, 4]
    assert rec[0]["strike"] == 1 and not rec[0]["fenced"] and rec[0]["alive"] == list(range(6))
    assert "banned" in rec[1]["cause"] and rec[1]["fenced"] and 4 not in rec[1]["alive"]
    n3 = json.loads((run / "phases" / "p" / "node3.json").read_text())
    (tk,) = n3["takeovers"]
    assert tk["stage"] == 2 and tk["init"] == "checkpoint" and tk["checkpoint_age"] == 0
    assert tk["restored"] == ["weights", "optimizer", "sync"]
    assert "step-00000002" in tk["checkpoint"] and n3["stage"] == 2
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(4 * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []


def test_a_killed_coordinator_is_replaced_without_losing_the_run(byte_data, tmp_path):
    """restartable=True: the store lives in its own process; the launcher (coordinator) is
    SIGKILLed mid-run, the nodes keep training, ``python -m skiptrain.runtime.coordinator --run``
    takes over from the store, then handles a killed originator, and finishes the run (outputs
    merged, store stopped, no process left)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sched = Schedule(placement=[[0, 1], [2], [3], [4]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2), (2, 3), (3, 4)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 16
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True, restartable=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", sched.to_dict(), iterations=iters, save_weights=True)],
              **faulty_job({"node": 1, "kind": "kill", "iteration": 12}))
    run.mkdir()
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"))
    wait_for(lambda: metrics_lines(run) >= 2)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    coord = subprocess.run([sys.executable, "-m", "skiptrain.runtime.coordinator", "--run", str(run)], env=env,
                           capture_output=True, text=True, timeout=240)
    assert coord.returncode == 0, coord.stderr[-2000:]
    assert "restarted: generation 0" in coord.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r]               # (not the validation points)
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and rows[-1]["nodes"] == 4
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert rec[0]["restart"] and rec[1]["node"] == 1 and "died" in rec[1]["cause"] and rec[1]["gen"] == 1
    assert (run / "model.safetensors").is_file() and not (run / "join_secret").exists()
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
    time.sleep(0.5)
    assert processes_of_run(run) == []


def _drift_with_node_3_slowed(cfg, sched: Schedule, byte_data, run, iters: int = 8, **rt):
    """Launch ``sched`` on a 6-node cluster topology with emulated compute and drift re-planning
    (threshold 0.5) for ``iters`` iterations; node 3 computes 6x slower from iteration 2.  Every
    iteration runs, every sample once.  Returns (rank 0's adopted re-plans, node 3's hops in its
    first and last iteration)."""
    from skiptrain.net.topology import load_topology
    from skiptrain.runtime.job import build_cost

    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, drift_threshold=0.5, **rt),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", sched.to_dict(), iterations=iters, cost=build_cost(cfg).to_dict(),
                            topology=load_topology("cluster", 6).to_dict(), emulate_compute=True)],
              **faulty_job({"node": 3, "kind": "slow", "factor": 6.0, "iteration": 2}))
    res = launch(job, timeout_s=180)
    assert [r["step"] for r in res.phase_iterations("p")] == list(range(1, iters + 1))
    n0 = json.loads((run / "phases" / "p" / "node0.json").read_text())
    rp = [r for r in n0.get("replans", []) if r["adopted"]]
    assert rp and rp[0]["iteration"] >= 3, n0.get("replans")
    n3 = json.loads((run / "phases" / "p" / "node3.json").read_text())
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * len(sched.micro_batches) * cfg.train.micro_batch))
    assert processes_of_run(run) == []
    return rp, n3["iterations"][0]["n_processed"], n3["iterations"][-1]["n_processed"]


def test_drift_replans_routes_away_from_a_node_that_slowed_down(byte_data, tmp_path):
    """Emulated compute on a cluster topology, stages 2/2/1/1 (k=0): from iteration 2 node 3
    (a stage-1 replica) computes 6x slower.  The measured iteration time drifts past the planned
    one; rank 0 re-plans the routes on the measured topology (placement fixed) and every node
    switches: node 3 gets fewer stage-1 hops.  Training goes on, every sample once."""
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1},
                                          "runtime": {"s_per_sample_layer": 5e-3}})
    cfg.model.vocab_size = 256
    sched = Schedule(placement=[[0, 1], [2, 3], [4], [5]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + k % 2), (2, 4), (3, 5)]) for k in range(4)])
    rp, before, after = _drift_with_node_3_slowed(cfg, sched, byte_data, tmp_path / "run", heartbeat_s=0.2,
                                                  heartbeat_deadline_s=6.0, recover=True)
    assert rp[0]["compute_factors"]["3"] > 2 * rp[0]["compute_factors"]["2"]
    assert before == 2 and after < before                       # fewer micro-batches through the slow node


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


def test_nodes_serving_two_stages_survive_a_replica_dying_and_a_lost_stage_taken_over(byte_data, tmp_path):
    """``runtime.node_stages=0,0,1+2,1+2,2,3`` with recovery: node 3 (stages 1 and 2) dies at
    iteration 1, the sole stage-3 node at iteration 2; node 2 goes on serving both stages, node 4
    (stage 2 alone) takes stage 3 over, initialised from stage 2's first replica, node 2.  Every
    iteration runs, every sample once."""
    from skiptrain.net.topology import load_topology
    from skiptrain.runtime.job import build_cost

    sched = _shared_schedule()
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1},
                                          "runtime": {"nodes": 6, "node_stages": "0,0,1+2,1+2,2,3"}})
    run, iters = tmp_path / "run", 4
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0,
                                  recover=True, takeover=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", sched.to_dict(), iterations=iters, cost=build_cost(cfg).to_dict(),
                            topology=load_topology("cluster", 6).to_dict())],
              **faulty_job([{"node": 3, "kind": "kill", "iteration": 1}, {"node": 5, "kind": "kill", "iteration": 2}]))
    res = launch(job, timeout_s=180)
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and all(r["loss"] < 10 for r in rows)
    assert rows[0]["nodes"] == 6 and rows[-1]["nodes"] == 4
    n2 = json.loads((run / "phases" / "p" / "node2.json").read_text())
    assert n2["stages"] == [1, 2] and len(n2["recoveries"]) == 2
    n4 = json.loads((run / "phases" / "p" / "node4.json").read_text())
    (tk,) = n4["takeovers"]
    assert tk["stage"] == 3 and tk["from_stage"] == 2 and tk["neighbours"] == [2]
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []


def test_drift_replans_the_routes_of_nodes_that_serve_two_stages(byte_data, tmp_path):
    """Nodes 2 and 3 each serve stages 1 and 2 (``runtime.node_stages=0,0,1+2,1+2,3,3``); from
    iteration 2 node 3 computes 6x slower.  Rank 0 re-plans the routes on the measured topology
    with the shared placement kept, and every node switches: node 3 gets fewer visits.  Training
    goes on, every sample once."""
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1},
                                          "runtime": {"s_per_sample_layer": 5e-3, "nodes": 6,
                                                      "node_stages": "0,0,1+2,1+2,3,3"}})
    cfg.model.vocab_size = 256
    sched = Schedule(placement=[[0, 1], [2, 3], [2, 3], [4, 5]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + k % 2), (2, 2 + k % 2), (3, 4 + k % 2)]) for k in range(4)])
    _, before, after = _drift_with_node_3_slowed(cfg, sched, byte_data, tmp_path / "run")
    assert before == 4 and after < before, (before, after)     # two stages' visits per micro-batch before


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


def test_restarting_a_coordinator_before_generation_0_is_a_clear_error(byte_data, tmp_path, capsys):
    """A coordinator that died during admission left no generation to resume: the replacement
    says so (exit 2, no store timeout) and stops the store, so nodes still waiting exit too."""
    from skiptrain.runtime import coordinator, store

    sched = Schedule(placement=[[0], [1]], memory=2, method="test",
                     micro_batches=[MicroBatch(0, 0, [(1, 2)])])
    cfg = build_config("tiny")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, recover=True, restartable=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=1)])
    job.save(run / "job.json")
    (run / "join_secret").write_text("s" * 32)
    proc, _, _ = store.start(run)
    try:
        assert coordinator.main(["--run", str(run)]) == 2
        assert "no generation 0 yet" in capsys.readouterr().err
        assert proc.wait(timeout=10) is not None          # the store was stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_coordinator_restarted_after_the_run_ended_says_so(tmp_path, capsys):
    """The run's store is gone (its process exited): a restarted coordinator names that and the
    resume point in one line, exit status 2, instead of waiting on a store that never answers."""
    import subprocess
    import sys

    from skiptrain.runtime.coordinator import main

    run = tmp_path / "run"
    run.mkdir()
    Job(config=build_config("tiny").to_dict(), data_path=str(tmp_path / "data"), run_dir=str(run),
        phases=[Phase("p", _schedule().to_dict(), iterations=2)]).save(run / "job.json")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / "store.json").write_text(json.dumps({"host": "127.0.0.1", "port": 1, "pid": gone.pid}))
    (run / "join_secret").write_text("s")
    assert main(["--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert "store of" in err and "is gone, so the run has ended" in err and "--resume" in err
    assert len(err.strip().splitlines()) == 1
