"""Only the run's members can speak in its membership: the store listens on loopback only, and
the coordinator acts only on heartbeats, reports and PIDs signed with a member key; a process that
reaches the store port without the secret can neither get nodes fenced nor get anything signalled.

The units (no process started) are in tests/unit/test_membership_units.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import launch_in_a_process, metrics_lines, processes_of_run, wait_for
from skiptrain.config import build_config
from skiptrain.runtime.job import Job, Phase, with_runtime
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.membership import member_key, sign
from skiptrain.runtime.recovery import trained_samples
from skiptrain.schedule.schedule import MicroBatch, Schedule


REPO = Path(__file__).resolve().parents[2]


def test_a_runs_store_process_stops_only_on_the_coordinators_signed_request(tmp_path):
    from skiptrain.runtime.outputs import stop_store
    from skiptrain.runtime.store import start

    (tmp_path / "logs").mkdir()
    proc, host, port = start(tmp_path, secret="s3cret")
    try:
        client = _store_client(host, port)
        client.set("store/stop", "1")                          # a process without the secret
        client.set("store/stop", sign(member_key("guess", -1), "store/stop", "1"))
        time.sleep(1.0)
        assert proc.poll() is None, "a forged stop ended the run's store"
        stop_store(proc, client, "s3cret")                      # the coordinator's own request
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _store_client(host: str, port: int):
    import torch.distributed as dist

    return dist.TCPStore(host, port, 1, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def _sentinel() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _forge(info: dict, stop: threading.Event, sentinel_pid: int, done: dict) -> None:
    """A process that reached the store port but has no secret: bad-peer reports against both
    stage-0 nodes, PIDs pointing at an unrelated process, stale heartbeats, a joiner's hello,
    generation records that drop a node, and a request to stop."""
    import torch.distributed as dist

    store = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    j = int(store.add("nodes/next", 1)) - 1
    store.set(f"join/hello/{j}", json.dumps({"t": time.time(), "pid": sentinel_pid}))
    while not stop.is_set():
        try:
            for gen in range(3):
                for r in range(2, 6):
                    store.set(f"report/{gen}/{r}", json.dumps({"rank": r, "node": r % 2, "bad_peer": True,
                                                               "cause": "forged", "t": time.time()}))
            for r in range(6):
                store.set(f"pid/{r}", str(sentinel_pid))
                store.set(f"hb/{r}", "1.0:run")
            for gen in (1, 2):                   # generations that drop node 5, then the counter
                store.set(f"gen/{gen}", json.dumps({"alive": [0, 1, 2, 3, 4], "dead": {"5": "forged"}, "t": 0.0}))
            store.set("gen", "2")
            store.set("stop", "1")               # a stop request
            done["writes"] = done.get("writes", 0) + 1
        except Exception:  # noqa: BLE001 - the run ended and its store went away
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_forged_store_writes_kill_nothing_and_are_logged(byte_data, tmp_path):
    sched = Schedule(placement=[[0, 1], [2, 3], [4], [5]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + (k // 2) % 2), (2, 4), (3, 5)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 8
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=2.0, recover=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", sched.to_dict(), iterations=iters, save_weights=True)])
    sentinel = _sentinel()
    stop, done, out = threading.Event(), {}, {}
    th = threading.Thread(target=lambda: out.setdefault("res", launch(job, timeout_s=240)), daemon=True)
    th.start()
    try:
        deadline = time.time() + 60
        while not (run / "join.json").exists() and time.time() < deadline:
            time.sleep(0.02)
        info = json.loads((run / "join.json").read_text())
        forger = threading.Thread(target=_forge, args=(info, stop, sentinel.pid, done), daemon=True)
        forger.start()
        th.join(timeout=240)
    finally:
        stop.set()
    assert "res" in out, "the launch did not finish"
    assert done.get("writes", 0) > 3, "the forger never wrote"
    assert sentinel.poll() is None, "an unrelated process was signalled"
    sentinel.kill()
    sentinel.wait()
    rows = out["res"].phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and all(r["nodes"] == 6 for r in rows)
    rec = run / "recoveries.jsonl"
    assert not rec.exists() or rec.read_text().strip() == ""              # nobody fenced or banned
    rejected = [json.loads(x) for x in (run / "rejected_writes.jsonl").read_text().splitlines()]
    names = {r["forged"] for r in rejected}
    assert {"report/0/2", "report/0/3", "hb/0", "hb/5"} <= names, names
    assert all("does not verify" in r["why"] or "replayed" in r["why"] for r in rejected)
    trained = [i for s in trained_samples(run / "phases" / "p").values() for i in s]
    assert sorted(trained) == list(range(iters * 4 * cfg.train.micro_batch))
    assert (run / "model.safetensors").is_file()
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_a_restarted_coordinator_never_signals_a_process_it_did_not_start(byte_data, tmp_path):
    """restartable=True: the launcher is SIGKILLed, a process without the secret writes an
    unrelated process's PID where older versions kept node PIDs (``pid/<r>``), then the
    replacement coordinator takes over: it signals no process at all (it started none), the
    unrelated process lives, and the run finishes."""
    import os
    import signal

    import torch.distributed as dist

    sched = Schedule(placement=[[0, 1], [2], [3], [4]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2), (2, 3), (3, 4)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 40, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 10
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=True, restartable=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("p", sched.to_dict(), iterations=iters, save_weights=True)])
    run.mkdir()
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"))
    sentinel = _sentinel()
    try:
        wait_for(lambda: metrics_lines(run) >= 2)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        info = json.loads((run / "store.json").read_text())
        forger = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=10))
        for r in (2, 3):
            forger.set(f"pid/{r}", str(sentinel.pid))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        coord = subprocess.run([sys.executable, "-m", "skiptrain.runtime.coordinator_restart", "--run", str(run)], env=env,
                               capture_output=True, text=True, timeout=240)
        assert coord.returncode == 0, coord.stderr[-2000:]
        assert sentinel.poll() is None, "an unrelated process was signalled"
    finally:
        sentinel.kill()
        sentinel.wait()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r]               # (not the validation points)
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and rows[-1]["nodes"] == 5
    assert (run / "model.safetensors").is_file()
    time.sleep(0.5)
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_a_restartable_runs_store_killed_is_one_line_and_the_run_resumes(byte_data, tmp_path):
    """kill -9 of the store process of a ``--restartable`` run: every node stops, and the user
    reads one line naming the store's death and the command that resumes (it used to end in a
    traceback, the launcher's store client dumping C++ stacks)."""
    import signal

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "skiptrain.cli", "launch", "--preset", "tiny", "--nodes", "4", "--recover",
           "--restartable", "--data", str(byte_data), "--out", str(run), "--ckpt-every", "5"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([*cmd, "--steps", "400"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: metrics_lines(run) >= 12)
        os.kill(json.loads((run / "store.json").read_text())["pid"], signal.SIGKILL)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    last = err.strip().splitlines()[-1]
    assert "the run's store process died (killed by SIGKILL)" in last and "--resume --out" in last, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    again = subprocess.run([*cmd, "--steps", "30", "--resume"], env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run / "model.safetensors").is_file()
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_renewals_written_back_while_a_new_coordinator_takes_over_fence_nobody(byte_data, tmp_path):
    """``--restartable``: a process without the secret copies every node's signed renewal, the
    launcher is SIGKILLed, and while the replacement coordinator takes over the copies are
    written back 500 times a second.  Before, the replacement read only the old values and
    fenced every live node (the run died); now the run finishes with every node."""
    import os
    import signal

    import torch.distributed as dist

    sched = Schedule(placement=[[0, 1], [2], [3], [4]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2), (2, 3), (3, 4)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 300, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 120
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=3.0, recover=True,
                                  restartable=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=iters, save_weights=True)])
    run.mkdir()
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"))
    wait_for(lambda: metrics_lines(run) >= 10)
    info = json.loads((run / "store.json").read_text())
    forger = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    old = {f"hb/{r}": forger.get(f"hb/{r}") for r in range(5)}
    time.sleep(1.0)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    stop, writes = threading.Event(), [0]

    def replay():
        while not stop.is_set():
            try:
                for k, v in old.items():
                    forger.set(k, v)
            except Exception:  # noqa: BLE001 - the run ended and its store went away
                return
            writes[0] += 1
            time.sleep(0.002)
    threading.Thread(target=replay, daemon=True).start()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        coord = subprocess.run([sys.executable, "-m", "skiptrain.runtime.coordinator_restart", "--run", str(run)], env=env,
                               capture_output=True, text=True, timeout=300)
    finally:
        stop.set()
    assert writes[0] > 100, "the replay never ran"
    assert coord.returncode == 0, coord.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and rows[-1]["nodes"] == 5
    rec = run / "recoveries.jsonl"
    assert all(json.loads(x).get("restart") for x in rec.read_text().splitlines() if x.strip())   # nobody fenced
    assert (run / "model.safetensors").is_file()
    time.sleep(0.5)
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_a_launcher_stopped_past_the_lease_fences_nobody(byte_data, tmp_path):
    """SIGSTOP of the launcher (the coordinator) for 3 leases, then SIGCONT: before, its store
    stopped with it, no node could renew, every node stopped itself and the run was lost; the
    store is now a process of its own, so the nodes renew meanwhile and the coordinator, once it
    runs again, restarts their lease clocks instead of judging them on the time it was away."""
    import os
    import signal

    sched = Schedule(placement=[[0, 1], [2], [3], [4]], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2), (2, 3), (3, 4)]) for k in range(4)])
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 300, "warmup_steps": 1}})
    run = tmp_path / "run"
    iters = 60
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=3.0, recover=True),
              data_path=str(byte_data), run_dir=str(run), phases=[Phase("p", sched.to_dict(), iterations=iters, save_weights=True)])
    run.mkdir()
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"), capture=True)
    wait_for(lambda: metrics_lines(run) >= 10)
    os.kill(launcher.pid, signal.SIGSTOP)
    time.sleep(9.0)
    os.kill(launcher.pid, signal.SIGCONT)
    out, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0 and "finished" in out, err[-2000:]
    assert "this process did not run for" in err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, iters + 1)) and rows[-1]["nodes"] == 5
    rec = run / "recoveries.jsonl"
    assert not rec.exists() or rec.read_text().strip() == ""              # nobody fenced
    assert processes_of_run(run) == []
