"""Training that survives killed, hung and bad peers without a restart, and admits only nodes
that answer the join challenge: one 8-node run where one node lacks the join secret (refused
before any process group) and with four faults at four iterations (a killed sole replica of a
body stage mid-iteration, a killed stage-0 originator, a hung node found by the heartbeat
deadline, a peer sending NaN activations); the run finishes, every detection is logged with node,
cause and time, and the samples trained over the whole run are exactly the global sample
cursor's, none lost, none repeated.

The units (the re-plan for surviving nodes, payload checks, the HMAC challenge-response; no
process started) are in tests/unit/test_failure_recovery_units.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import launch_in_a_process, metrics_lines, processes_of_run, wait_for
from skiptrain.config import build_config
from skiptrain.runtime.failure import RuntimeFailure
from skiptrain.runtime.faults import faulty_job
from skiptrain.runtime.job import EmulationSpec, Job, Phase, with_runtime
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.recovery import trained_samples
from skiptrain.schedule.schedule import MicroBatch, Schedule
from unit.test_failure_recovery_units import _schedule, _shared_schedule


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


def test_an_iteration_committed_before_a_peer_died_keeps_its_metrics_line(byte_data, tmp_path):
    """A replica dies after the commit, before the step and the statistics: the survivors finish
    the iteration's sync and still write its metrics line (marked ``recovered``)."""
    run = tmp_path / "run"
    res = launch(_job(byte_data, run, [{"node": 5, "kind": "kill", "iteration": 1, "where": "after_commit"}], 3),
                 timeout_s=240)
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1].get("recovered") and rows[1]["nodes"] == 7 and rows[1]["loss"] < 10
    assert not rows[0].get("recovered") and not rows[2].get("recovered")
    gb = 6 * build_config("tiny").train.micro_batch
    assert sorted(i for s in trained_samples(run / "phases" / "p").values() for i in s) == list(range(3 * gb))


def _powersgd_run(byte_data, run, faults, iterations=5):
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 1.0, "steps": 20, "warmup_steps": 1},
                                          "dp": {"strategy": "powersgd", "check_every": 1}})
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", _schedule().to_dict(), iterations=iterations)],
              **faulty_job(faults))
    rows = launch(job, timeout_s=240).phase_iterations("p")
    recs = {n: json.loads((run / "phases" / "p" / f"node{n}.json").read_text()) for n in range(8)
            if (run / "phases" / "p" / f"node{n}.json").exists()}
    gb = 6 * cfg.train.micro_batch
    assert sorted(i for s in trained_samples(run / "phases" / "p").values() for i in s) == list(range(iterations * gb))
    assert processes_of_run(run) == []
    return rows, recs


def test_syncs_run_before_the_commit_are_rewound_when_it_fails_and_applied_when_it_held(byte_data, tmp_path):
    """PowerSGD keeps state and syncs each stage before the commit.  Node 7 (the sole stage-3
    replica) dies at iteration 1 once its sends are out and every other stage has synced: the
    iteration is committed nowhere, so every sync is rewound and the iteration runs again, as in
    the reference run where node 7 dies before the iteration does anything.  Node 4 dies after
    the commit at iteration 3 in both: its stage-1 partner applies the sync it holds.  Replicas
    end bit-identical (checked every step and at the end); every sample trained once."""
    late = {"node": 7, "kind": "kill", "iteration": 1, "where": "after_sync", "flush": True}
    after_commit = {"node": 4, "kind": "kill", "iteration": 3, "where": "after_commit"}
    rows, recs = _powersgd_run(byte_data, tmp_path / "late", [late, after_commit])
    ref, _ = _powersgd_run(byte_data, tmp_path / "ref", [{"node": 7, "kind": "kill", "iteration": 1}, after_commit])
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3, 4, 5]
    first = {n: next(r for r in rec["recoveries"] if r["iteration"] == 1) for n, rec in recs.items() if n not in (4, 7)}
    assert all(not r["committed"] and r["rewound_sync"] for r in first.values()), first
    causes = [r["cause"] for rec in recs.values() for r in rec["recoveries"]]
    assert not any("identical" in c or "consisten" in c for c in causes), causes
    assert any(r["redo_sync"] for r in recs[3]["recoveries"] if r["iteration"] == 3)
    for replicas in ([0, 1, 2], [5, 6]):
        assert len({tuple(recs[n]["sync_summary"]["param_hashes"]) for n in replicas}) == 1
    print("losses", [(r["loss"], q["loss"]) for r, q in zip(rows, ref)])
    for r, q in zip(rows, ref):          # (the same sums, perhaps in another order)
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-5, abs=0)


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
    SIGKILLed mid-run, the nodes keep training, ``python -m skiptrain.runtime.coordinator_restart --run``
    takes over from the store, then handles a killed originator (by its lease: no PID crosses
    from the old coordinator), and finishes the run (outputs
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
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    coord = subprocess.run([sys.executable, "-m", "skiptrain.runtime.coordinator_restart", "--run", str(run)], env=env,
                           capture_output=True, text=True, timeout=240)
    assert coord.returncode == 0, coord.stderr[-2000:]
    assert "restarted: generation 0" in coord.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r]               # (not the validation points)
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and rows[-1]["nodes"] == 4
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    # (the restarted coordinator started no process: it knows the kill by the exit report that the
    # node's supervisor, detached like the node, signed)
    assert rec[0]["restart"] and rec[1]["node"] == 1 and "killed by SIGKILL" in rec[1]["cause"] and rec[1]["gen"] == 1
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
                            topology=load_topology("cluster", 6).to_dict(),
                            emulation=EmulationSpec(compute=True))],
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


def test_restarting_a_coordinator_before_generation_0_is_a_clear_error(byte_data, tmp_path, capsys):
    """A coordinator that died during admission left no generation to resume: the replacement
    says so (exit 2, no store timeout) and stops the store, so nodes still waiting exit too."""
    from skiptrain.runtime import coordinator_restart, store

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
        assert coordinator_restart.main(["--run", str(run)]) == 2
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

    from skiptrain.runtime.coordinator_restart import main

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


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_each_node_of_a_recovery_launch_runs_under_a_supervisor_whose_signed_report_tells_its_death(byte_data,
                                                                                                     tmp_path):
    """As on hosts of their own: node r is the child of supervisor r, and the coordinator (which
    holds no handle on the nodes) learns of a ``kill -9`` from the exit report its supervisor signs."""
    import threading

    from skiptrain.runtime.node_processes import node_pids
    from skiptrain.runtime.store_client import connect

    run = tmp_path / "run"
    job = _job(byte_data, run, [{"node": 0, "kind": "hold", "iteration": 2, "key": "test/go"}], 5)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("res", launch(job, timeout_s=240)), daemon=True)
    th.start()
    wait_for(lambda: len(node_pids(run)) == 8 and len(node_pids(run, "supervisor*.log")) == 8, 60)
    nodes, supervisors = node_pids(run), node_pids(run, "supervisor*.log")
    assert {r: _parent_pid(nodes[r]) for r in range(8)} == supervisors
    info = json.loads((run / "join.json").read_text())
    store = connect(info["host"], int(info["port"]))
    wait_for(lambda: store.check(["fault/0"]), 60)           # node 0 holds iteration 2
    os.kill(nodes[4], signal.SIGKILL)
    wait_for(lambda: (run / "recoveries.jsonl").exists(), 30)
    store.set("test/go", "1")
    th.join(timeout=240)
    assert "res" in out, "the launch did not finish"
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert [(r["node"], r["cause"]) for r in rec] == [(4, "died (killed by SIGKILL)")]
    assert "node 4 killed by SIGKILL" in (run / "logs" / "supervisor4.log").read_text()
    assert [r["step"] for r in out["res"].phase_iterations("p")] == [1, 2, 3, 4, 5]
    assert processes_of_run(run) == []


def test_a_recovery_launch_of_fresh_interpreters_runs_its_supervisors_and_nodes_afresh(byte_data, tmp_path,
                                                                                      monkeypatch):
    """SKIPTRAIN_FRESH_NODES=1: each supervisor execs a new interpreter, and starts its node as one."""
    monkeypatch.setenv("SKIPTRAIN_FRESH_NODES", "1")
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1}})
    sched = Schedule(placement=[[0], [1], [2], [3]], memory=2, method="test",
                     micro_batches=[MicroBatch(k, 0, [(1, 1), (2, 2), (3, 3)]) for k in range(2)])
    run = tmp_path / "run"
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=30.0, heartbeat_s=0.2, recover=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=3)])
    res = launch(job, timeout_s=240)
    assert [r["step"] for r in res.phase_iterations("p")] == [1, 2, 3]
    for r in range(4):
        assert f"node {r} starting" in (run / "logs" / f"supervisor{r}.log").read_text()
        # (a node the supervisor forked would start its log with its PID line: this one was exec'd)
        assert not (run / "logs" / f"node{r}.log").read_text().startswith(f"skiptrain node {r}: pid")
    assert processes_of_run(run) == []
