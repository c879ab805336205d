"""Joining a running job: a node started with ``--join HOST:PORT`` passes the HMAC challenge, is
placed on the stage where it shortens the iteration most, receives weights, optimizer and sync
state from the live replicas over the wire (moves planned by the layout-change core) and starts at
an iteration boundary; a process with a wrong secret is refused and never enters a process group.
Units: ``add_replica``, ``choose_stage``, ``join_transfers``, the state by name from several
senders.

The units (no process started) are in tests/unit/test_join_units.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import processes_of_run
from skiptrain.config import build_config
from skiptrain.runtime.job import Job, Phase, with_runtime
from skiptrain.runtime.join import EXIT_REFUSED
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.join_placement import add_replica
from skiptrain.runtime.recovery import trained_samples
from skiptrain.schedule.schedule import MicroBatch, Schedule
from unit.test_join_units import _sched


REPO = Path(__file__).resolve().parents[2]


# ---- multi-process ------------------------------------------------------------------------------

def _joiner(run: Path, info: dict, secret: str, name: str) -> subprocess.Popen:
    env = dict(os.environ, SKIPTRAIN_JOIN_SECRET=secret, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    log = open(run / "logs" / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.node", "--join",
                             f"{info['host']}:{info['port']}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _launch_joinable(job: Job, run: Path) -> tuple[threading.Thread, dict, dict]:
    """Launch ``job`` in a thread; (the thread, its result holder, the run's join.json)."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("res", launch(job, timeout_s=240)), daemon=True)
    th.start()
    deadline = time.time() + 60
    while not (run / "join.json").exists() and time.time() < deadline:
        time.sleep(0.05)
    return th, out, json.loads((run / "join.json").read_text())


def _answer_the_challenge_wrongly(info: dict) -> dict:
    """A process without the secret that says hello through the store and answers the nonce with
    a guess; returns its node id and the join result it got (the coordinator's signed value)."""
    from datetime import timedelta

    import torch.distributed as dist

    from skiptrain.runtime.membership import strip_tag

    store = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    j = int(store.add("nodes/next", 1)) - 1
    store.set(f"join/hello/{j}", json.dumps({"t": time.time(), "pid": 1}))
    store.wait([f"join/nonce/{j}"])
    store.set(f"join/resp/{j}", "00" * 32)
    store.wait([f"join/result/{j}"])
    return {"node": j, "result": strip_tag(store.get(f"join/result/{j}").decode())}


def test_a_node_joins_a_running_job_and_a_wrong_secret_is_refused(byte_data, tmp_path):
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 18                     # margin for the joiner's start-up (it joins at iteration 1-3 here)
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", _sched().to_dict(), iterations=iters, dump=True)])
    th, out, info = _launch_joinable(job, run)
    secret = Path(info["secret_file"]).read_text()
    good = _joiner(run, info, secret, "joiner")
    bad = _joiner(run, info, "not-the-secret", "intruder")
    answer = _answer_the_challenge_wrongly(info)
    th.join(timeout=240)
    good.wait(timeout=30)
    bad.wait(timeout=30)
    assert "res" in out, "the launch did not finish"
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    joined = [r for r in rec if r.get("join") and not r.get("refused")]
    refused = [r for r in rec if r.get("refused")]
    assert len(joined) == 1 and len(refused) == 1, rec
    j = joined[0]["node"]
    assert j >= 5 and joined[0]["choice"]["stage"] == 1           # tie on hops per replica: lowest stage
    # a process that answers the challenge without the secret is refused by the coordinator ...
    assert "wrong challenge response" in refused[0]["cause"] and refused[0]["node"] == answer["node"]
    assert answer["result"] == "refused"
    # ... and a node with a wrong secret stops before it says hello: the job it read does not verify
    assert bad.returncode == EXIT_REFUSED
    intruder_log = (run / "logs" / "intruder.log").read_text()
    assert "does not verify with this SKIPTRAIN_JOIN_SECRET" in intruder_log and "generation" not in intruder_log
    assert good.returncode == 0
    rows = out["res"].phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, iters + 1))
    nj = json.loads((run / "phases" / "p" / f"node{j}.json").read_text())
    it_j = nj["joined"]["iteration"]
    assert nj["stage"] == 1 and nj["joined"]["from_nodes"] == [2] and 0 <= it_j < iters
    assert [r["nodes"] for r in rows] == [5] * it_j + [6] * (iters - it_j)     # from the boundary on
    assert len(nj["iterations"]) == iters - nj["joined"]["iteration"]
    assert all(e["n_processed"] > 0 for e in nj["iterations"])     # it took hops of stage 1
    # weights and optimizer state came over the wire: the two replicas stay identical
    pa = torch.load(run / "phases" / "p" / "params_node2.pt")
    pb = torch.load(run / "phases" / "p" / f"params_node{j}.pt")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []


def test_a_node_joins_a_job_whose_node_serves_two_stages(byte_data, tmp_path):
    """``runtime.node_stages=0,0,1+2,3``: node 2 serves stages 1 and 2.  A joiner is placed on
    one of them and takes that stage's weights, optimizer and sync state from node 2 (which sends
    from both stages' state by name); node 2 goes on serving both stages with its groups rebuilt,
    the joiner's stage stays bit-identical on the two replicas, every sample once."""
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1},
                                          "runtime": {"nodes": 4, "node_stages": "0,0,1+2,3"}})
    sched = Schedule(placement=[[0, 1], [2], [2], [3]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2), (2, 2), (3, 3)]) for k in range(4)])
    run, iters = tmp_path / "run", 18
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0,
                                  recover=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=iters, dump=True)])
    th, out, info = _launch_joinable(job, run)
    good = _joiner(run, info, Path(info["secret_file"]).read_text(), "joiner")
    th.join(timeout=240)
    good.wait(timeout=30)
    assert "res" in out and good.returncode == 0, "the launch did not finish"
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    (joined,) = [r for r in rec if r.get("join") and not r.get("refused")]
    j, stage = joined["node"], joined["choice"]["stage"]
    assert stage in (1, 2)
    nj = json.loads((run / "phases" / "p" / f"node{j}.json").read_text())
    assert nj["stage"] == stage and nj["joined"]["from_nodes"] == [2]
    assert all(e["n_processed"] > 0 for e in nj["iterations"])
    n2 = json.loads((run / "phases" / "p" / "node2.json").read_text())
    assert n2["stages"] == [1, 2] and len(n2["iterations"]) == iters
    pa = torch.load(run / "phases" / "p" / "params_node2.pt")
    pb = torch.load(run / "phases" / "p" / f"params_node{j}.pt")
    assert set(pb) < set(pa) and all(torch.equal(pa[k], pb[k]) for k in pb)     # node 2 holds both stages
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []


def test_a_node_placed_as_the_run_ends_is_told_the_join_was_cancelled(byte_data, tmp_path):
    """The joiner is placed while node 0 holds the last iteration, so no node passes another
    boundary to take the join up: the coordinator cancels it when the run's nodes finish, the
    joiner exits at once naming why (not after the group timeout), and the run ends whole."""
    from datetime import timedelta

    import torch.distributed as dist

    from skiptrain.runtime.faults import faulty_job

    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters, timeout = 4, 60.0
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=timeout, heartbeat_s=0.2, heartbeat_deadline_s=4.0,
                                  recover=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", _sched().to_dict(), iterations=iters, dump=True)],
              **faulty_job({"node": 0, "kind": "hold", "iteration": iters - 1, "where": "after_pipeline",
                            "key": "join/assign/5", "timeout_s": 50}))
    th, out, info = _launch_joinable(job, run)
    store = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    store.wait(["fault/0"])                                   # node 0 holds the last iteration
    joiner = _joiner(run, info, Path(info["secret_file"]).read_text(), "joiner")
    t0 = time.time()
    joiner.wait(timeout=120)
    th.join(timeout=120)
    assert "res" in out, "the launch did not finish"
    log = (run / "logs" / "joiner.log").read_text()
    assert joiner.returncode == EXIT_REFUSED, log
    assert "join cancelled by the coordinator: the run ended before its nodes took this join up" in log, log
    assert time.time() - t0 < timeout, "the joiner waited out the group timeout"
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert [(r["node"], r.get("cancelled")) for r in rec] == [(5, True)], rec
    assert [r["step"] for r in out["res"].phase_iterations("p")] == list(range(1, iters + 1))
    assert {r["nodes"] for r in out["res"].phase_iterations("p")} == {5}
    assert processes_of_run(run) == []


@pytest.mark.slow
@pytest.mark.parametrize("died_after", ["the assignment", "the record"])
def test_a_join_its_dead_coordinator_left_half_published_is_taken_up_under_the_replacement(byte_data, tmp_path,
                                                                                          died_after):
    """The coordinator dies after assigning a joiner its generation and before publishing it, or
    after writing the generation's record and before its counter (both played here by the test,
    which holds the secret): the replacement (``python -m skiptrain.runtime.coordinator_restart --run``)
    publishes the join again, or the counter, the joiner takes it up, and it trains in."""
    import signal
    from datetime import timedelta

    import torch.distributed as dist

    from conftest import launch_in_a_process, wait_for
    from skiptrain.runtime.faults import faulty_job
    from skiptrain.runtime.join import assign_join, challenge, check_response
    from skiptrain.runtime.membership import COORDINATOR, member_key, strip_tag
    from skiptrain.runtime.recovery import publish_generation

    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 6
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=90.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0,
                                  recover=True, restartable=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", _sched().to_dict(), iterations=iters, dump=True)],
              **faulty_job({"node": 0, "kind": "hold", "iteration": 2, "key": "test/release", "timeout_s": 80}))
    run.mkdir()
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"))
    joiner = coord = None
    try:
        wait_for(lambda: (run / "join.json").exists(), 60)
        info = json.loads((run / "join.json").read_text())
        store = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        store.wait(["fault/0"])                               # node 0 holds iteration 2
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        secret = (run / "join_secret").read_text()
        joiner = _joiner(run, info, secret, "joiner")
        wait_for(lambda: store.check(["join/hello/5"]), 60)    # the dead coordinator's part: admit,
        nonce = challenge(store, 5)
        wait_for(lambda: check_response(store, 5, nonce, secret) is not None, 60)
        assign_join(store, 5, secret, 1)                      # assign,
        if died_after == "the record":                        # publish the record, not the counter
            cur = json.loads(strip_tag(store.get("sched/cur").decode()))
            new = add_replica(Schedule.from_dict(cur["schedule"]), 5, 1, _sched())
            publish_generation(store, 1, [0, 1, 2, 3, 4, 5], {}, {"kind": "join", "join": {"5": 1}, "phase": 0,
                               "schedule": new.to_dict(), "choice": {"rule": "test"}},
                               key=member_key(secret, COORDINATOR))
            store.set("gen", "0")
        coord = subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.coordinator_restart", "--run", str(run)],
                                 env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        wait_for(lambda: '"restart": true' in (run / "recoveries.jsonl").read_text()
                 if (run / "recoveries.jsonl").exists() else False, 60)
        store.set("test/release", "1")                        # node 0 goes on
        err = coord.communicate(timeout=120)[1]
        joiner.wait(timeout=60)
        assert coord.returncode == 0, err[-2000:]
        assert joiner.returncode == 0, (run / "logs" / "joiner.log").read_text()[-2000:]
        rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
        assert [(r["gen"], r["node"]) for r in rec if r.get("join")] == [(1, 5)], rec
        nj = json.loads((run / "phases" / "p" / "node5.json").read_text())
        assert nj["stage"] == 1 and 2 <= nj["joined"]["iteration"] < iters
        trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
        assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
        assert processes_of_run(run) == []
    finally:                                                # (a failed run leaves nothing behind)
        left = [p.pid for p in (launcher, joiner, coord) if p is not None and p.poll() is None]
        for pid in processes_of_run(run) + left:
            os.kill(pid, signal.SIGKILL)


def test_below_min_nodes_the_swarm_pauses_until_a_node_joins(byte_data, tmp_path):
    """``runtime.min_nodes=5`` on 5 nodes: a killed stage-0 replica leaves 4, so the survivors
    train nothing and wait at the next boundary; a node that joins brings the swarm back to 5 and
    training goes on from there.  No iteration is trained by 4 nodes, every sample once."""
    from skiptrain.runtime.faults import faulty_job

    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1}})
    run, iters = tmp_path / "run", 8
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0,
                                  recover=True, min_nodes=5),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", _sched().to_dict(), iterations=iters)],
              **faulty_job({"node": 1, "kind": "kill", "iteration": 2}))
    th, out, info = _launch_joinable(job, run)
    log0 = run / "logs" / "node0.log"
    deadline = time.time() + 120
    while "paused before iteration" not in (log0.read_text() if log0.exists() else "") and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(3.0)                                     # paused: nothing trains meanwhile
    rows_paused = out.get("res") is None and len((run / "metrics.jsonl").read_text().splitlines())
    good = _joiner(run, info, Path(info["secret_file"]).read_text(), "joiner")
    th.join(timeout=240)
    good.wait(timeout=30)
    assert "res" in out and good.returncode == 0, "the launch did not finish"
    rows = out["res"].phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, iters + 1))
    assert all(r["nodes"] == 5 for r in rows) and rows_paused == 2     # iterations 1-2, then the pause
    n0 = json.loads((run / "phases" / "p" / "node0.json").read_text())
    assert n0["pauses"][0]["iteration"] == 2 and n0["pauses"][0]["paused_s"] > 3.0
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
    assert processes_of_run(run) == []
