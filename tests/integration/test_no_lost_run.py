"""No run is lost: a recovering swarm whose body stage has a single node keeps per-stage
checkpoints by default, so losing that node still ends in a complete, loadable model; SIGTERM to
the launcher stops every process it started and saves the newest complete set of stage checkpoints.

The units (no process started) are in tests/unit/test_no_lost_run_units.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import launch_in_a_process, metrics_lines, processes_of_run, wait_for
from skiptrain.config import build_config
from skiptrain.runtime.faults import faulty_job
from skiptrain.runtime.job import Job, Phase, with_runtime
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.node_processes import node_pids
from skiptrain.schedule.schedule import MicroBatch, Schedule
from skiptrain.train.rundir import load_run
from unit.test_no_lost_run_units import PLACEMENT


REPO = Path(__file__).resolve().parents[2]


def _sched() -> Schedule:
    return Schedule(placement=[list(p) for p in PLACEMENT], memory=2, method="test", micro_batches=[
        MicroBatch(k, k % 2, [(1, 2 + (k // 2) % 2), (2, 4), (3, 5)]) for k in range(4)])


def _cfg(every: int = 100):
    return build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1},
                                          "checkpoint": {"every": every}})


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [3, 4])
def test_losing_the_only_node_of_a_body_stage_still_ends_in_a_complete_model(byte_data, tmp_path, kill_at):
    """Killed at the start of 0-based iteration 3, or of 4: right after the save of iteration 4
    began, its part perhaps still being written (the save is then abandoned when the generation
    changes, not waited for until the run's end); either way the stage comes from the newest
    complete checkpoint and the run ends complete."""
    cfg = _cfg(every=2)
    iters = 6
    run = tmp_path / "run"
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=3.0, recover=True),
              data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("train", _sched().to_dict(), iterations=iters, save_weights=True)],
              **faulty_job({"node": 4, "kind": "kill", "iteration": kill_at}))     # sole node of stage 2
    launch(job, timeout_s=240)
    notes = json.loads((run / "lost_stages.json").read_text())
    assert list(notes) == ["2"] and "checkpoint after iteration" in notes["2"]
    from skiptrain.config import save_toml

    save_toml(cfg, run / "config.toml")            # load_run needs the config (the swarm CLI writes it)
    _, model, _ = load_run(run)                   # every layer present, checksum verified
    assert model.num_parameters() > 0
    assert processes_of_run(run) == []


def _restartable_job(cfg, byte_data, run: Path) -> Job:
    return Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0,
                                   recover=True, restartable=True),
               data_path=str(byte_data), run_dir=str(run),
               phases=[Phase("train", _sched().to_dict(), iterations=200, save_weights=True)])


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_node_at_a_boundary_and_keeps_the_final_weights(byte_data, tmp_path):
    """SIGTERM: the nodes agree at the next iteration boundary, checkpoint the job there, every
    stage's first replica writes its weights, the launch merges them and returns interrupted; the
    store process and every node are gone."""
    cfg = _cfg(every=50)
    run = tmp_path / "run"
    run.mkdir()
    launcher = launch_in_a_process(_restartable_job(cfg, byte_data, run).save(tmp_path / "job.json"),
                                   capture=True)
    wait_for(lambda: metrics_lines(run) >= 2)
    store_pid = json.loads((run / "store.json").read_text())["pid"]
    os.kill(launcher.pid, signal.SIGTERM)
    out, err = launcher.communicate(timeout=90)
    assert out.strip() == "interrupted", err[-2000:]
    assert "[launch] stopping:" in err and "[launch] interrupted: every node stopped after iteration" in err
    done = max(json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x)
    assert 2 <= done < 200
    assert f"holds iteration {done}" in err
    assert (run / "checkpoints" / "LATEST").read_text().strip() == f"step-{done:08d}"   # the resume point
    from skiptrain.checkpoint.weights import load_weights
    from skiptrain.model.transformer import StagedLM

    state = load_weights(run / "model.safetensors")
    init = StagedLM(cfg.model, seed=cfg.train.seed).state_dict()
    assert state.keys() == init.keys() and not torch.equal(state["layers.2.attn.wq.weight"], init["layers.2.attn.wq.weight"])
    time.sleep(0.5)
    assert processes_of_run(run) == []
    assert not Path(f"/proc/{store_pid}").exists() or "Z" in Path(f"/proc/{store_pid}/stat").read_text().split()[2]


@pytest.mark.slow
def test_sigterm_after_a_node_was_lost_and_recovered_still_stops_cleanly(byte_data, tmp_path):
    """A replica of stage 1 is killed at iteration 1 and the run recovers without it; SIGTERM
    later stops the survivors at a boundary: the node that died earlier is not a failure of the
    stop, so the launch returns interrupted with the merged weights."""
    cfg = _cfg(every=50)
    run = tmp_path / "run"
    run.mkdir()
    job = dataclasses.replace(_restartable_job(cfg, byte_data, run),
                              **faulty_job({"node": 3, "kind": "kill", "iteration": 1}))
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"), capture=True)
    wait_for(lambda: metrics_lines(run) >= 4)
    os.kill(launcher.pid, signal.SIGTERM)
    out, err = launcher.communicate(timeout=90)
    assert out.strip() == "interrupted", err[-2000:]
    assert "[launch] interrupted: every node stopped after iteration" in err, err[-2000:]
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert [r["node"] for r in rec] == [3]
    from skiptrain.checkpoint.weights import load_weights
    from skiptrain.model.transformer import StagedLM

    assert load_weights(run / "model.safetensors").keys() == StagedLM(cfg.model, seed=0).state_dict().keys()
    time.sleep(0.5)
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_a_stop_that_arrives_in_the_last_iteration_leaves_a_finished_run(byte_data, tmp_path):
    """Node 0 holds the last iteration until the launcher has asked for the stop: no boundary
    is left to stop at, every iteration ran, so the launch reports finished, not interrupted."""
    from datetime import timedelta

    import torch.distributed as dist

    cfg = _cfg(every=50)
    run = tmp_path / "run"
    run.mkdir()
    iters = 4
    job = dataclasses.replace(_restartable_job(cfg, byte_data, run),
                              **faulty_job({"node": 0, "kind": "hold", "iteration": iters - 1,
                                            "where": "after_pipeline", "key": "stop", "timeout_s": 60}))
    job.phases[0].iterations = iters
    launcher = launch_in_a_process(job.save(tmp_path / "job.json"), capture=True)
    wait_for(lambda: (run / "store.json").exists())
    info = json.loads((run / "store.json").read_text())
    store = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    store.wait(["fault/0"])                               # node 0 is in the last iteration
    os.kill(launcher.pid, signal.SIGTERM)
    out, err = launcher.communicate(timeout=90)
    assert out.strip() == "finished", err[-2000:]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == list(range(1, iters + 1))
    time.sleep(0.5)
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_a_second_sigterm_stops_at_once_and_salvages_the_job_checkpoint(byte_data, tmp_path):
    cfg = _cfg(every=1)
    run = tmp_path / "run"
    run.mkdir()
    launcher = launch_in_a_process(_restartable_job(cfg, byte_data, run).save(tmp_path / "job.json"),
                                   capture=True)
    wait_for(lambda: (run / "checkpoints" / "LATEST").exists())
    os.kill(launcher.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.kill(launcher.pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert "[launch] interrupted:" in err and "holds the weights of checkpoint" in err, err[-2000:]
    assert json.loads((run / "interrupted.json").read_text())["iteration"] >= 1
    from skiptrain.checkpoint.weights import load_weights
    from skiptrain.model.transformer import StagedLM

    assert load_weights(run / "model.safetensors").keys() == StagedLM(cfg.model, seed=0).state_dict().keys()
    time.sleep(0.5)
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_ctrl_c_while_the_nodes_start_stops_every_node(byte_data, tmp_path, monkeypatch):
    """Ctrl-C after the node processes were requested, before their starts are reported: every
    one is stopped (none trains on behind the interrupt) and the interrupt goes up."""
    from skiptrain.runtime.node_processes import ForkedNodes

    def interrupted(self, timeout_s: float = 0.0):
        raise KeyboardInterrupt

    monkeypatch.setattr(ForkedNodes, "wait_started", interrupted)
    run = tmp_path / "run"
    job = Job(config=with_runtime(_cfg().to_dict(), timeout_s=15.0), data_path=str(byte_data), run_dir=str(run),
              phases=[Phase("train", _sched().to_dict(), iterations=20)])
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        launch(job, timeout_s=120)
    assert time.time() - t0 < 30
    time.sleep(1.0)
    assert processes_of_run(run) == []
    assert not any('"loss"' in line for line in (run / "metrics.jsonl").read_text().splitlines())


def _default_sigint() -> None:
    """In the child: Ctrl-C's default action, even when the tests run as a background job (a
    shell starts those with SIGINT ignored, and Python then keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["launcher", "terminal"])
def test_ctrl_c_of_a_swarm_training_writes_a_final_checkpoint(byte_data, tmp_path, to):
    """`skiptrain train --nodes 4` and SIGINT, to the launcher alone or, as a terminal's Ctrl-C
    does, to its whole process group: exit 130 with one line naming the resume point, a
    checkpoint whose step is the iterations done and whose weights are the merged model's."""
    out = tmp_path / "swarm"
    p = subprocess.Popen([sys.executable, "-m", "skiptrain.cli", "train", "--preset", "tiny", "--data", str(byte_data),
                          "--out", str(out), "--nodes", "4", "--steps", "300", "--set", "runtime.stage_sizes=1,1,1,1"],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_default_sigint, start_new_session=True)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2)
    if to == "launcher":
        p.send_signal(signal.SIGINT)
    else:
        os.killpg(p.pid, signal.SIGINT)      # the session leader's group: the launcher and its fork server
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["interrupted"] and 2 <= summary["step"] < 300
    assert f"interrupted after iteration {summary['step']} of 300" in err
    assert f"continues from the checkpoint of iteration {summary['step']}" in err
    from skiptrain.checkpoint.reader import CheckpointReader

    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    assert latest == f"step-{summary['step']:08d}"
    r = CheckpointReader(out / "checkpoints" / latest)
    assert r.verify() > 0 and r.names("optim.exp_avg.")            # a resume point: optimizer state too
    _, model, _ = load_run(out)
    got = r.read_many(["layers.1.attn.wq.weight"])["layers.1.attn.wq.weight"]
    assert torch.equal(got, model.state_dict()["layers.1.attn.wq.weight"])
    assert processes_of_run(out) == []


@pytest.mark.slow
def test_sigterm_to_single_process_training_writes_the_weights_and_resume_continues(byte_data, tmp_path):
    from skiptrain.checkpoint import store
    from skiptrain.checkpoint.weights import load_weights

    run = tmp_path / "run"
    args = ["--preset", "tiny", "--quiet", "--data", str(byte_data), "--out", str(run), "--set", "checkpoint.every=2",
            "--set", "train.eval_every=0", "--set", "train.eval_batches=1"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "skiptrain.cli", "train", *args, "--steps", "100000"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "LATEST").exists() and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert "interrupted at step" in err and "model.safetensors holds its weights; --resume continues from" in err
    assert "Traceback" not in err
    assert load_weights(run / "model.safetensors")             # complete, checksummed
    step = store.latest(run / "checkpoints").name
    n = int(step.split("-")[1])
    r = subprocess.run([sys.executable, "-m", "skiptrain.cli", "train", *args, "--steps", str(n + 1), "--resume"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"at step {n}" in r.stdout, r.stderr[-2000:]


def test_a_store_left_behind_exits_once_every_node_is_done_or_silent(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    from skiptrain.runtime.lease import Renewal
    from skiptrain.runtime.store import start

    (tmp_path / "logs").mkdir()
    proc, host, port = start(tmp_path, idle_exit_s=1.0)
    try:
        client = dist.TCPStore(host, port, 1, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
        client.add("nodes/next", 2)
        client.set("hb/0", Renewal("a", 1, 0, "done", 1.0).encode())
        t_end, seq = time.time() + 3, 0
        while time.time() < t_end:                        # node 1 keeps renewing: the store serves on
            seq += 1
            client.set("hb/1", Renewal("b", seq, 0, "run", 1.0).encode())
            time.sleep(0.2)
        assert proc.poll() is None
        proc.wait(timeout=10)                             # node 1 falls silent: the store exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "every node has been done or silent for 1 s" in (tmp_path / "logs" / "store.log").read_text()


def _node_pid(run: Path, rank: int) -> int | None:
    """PID of the running node process of ``run`` with rank ``rank`` (its log's first line)."""
    return node_pids(run).get(rank)


@pytest.mark.slow
def test_kill_9_of_the_only_stage_2_node_in_a_2_2_1_1_swarm_still_gives_a_usable_run(byte_data, tmp_path):
    """The documented layout through the CLI, --recover and no --ckpt-every: the sole stage-2 node
    is SIGKILLed mid-run; the run finishes, writes run.json and a model that eval accepts."""
    import threading

    from skiptrain.cli import main

    run = tmp_path / "run"
    out: dict = {}
    argv = ["train", "--preset", "tiny", "--quiet", "--data", str(byte_data), "--nodes", "6", "--steps", "14",
            "--set", "runtime.stage_sizes=2,2,1,1", "--set", "runtime.recover=true", "--set", "runtime.timeout_s=15",
            "--set", "runtime.heartbeat_deadline_s=3", "--set", "train.eval_batches=1", "--out", str(run)]
    th = threading.Thread(target=lambda: out.setdefault("rc", main(argv)), daemon=True)
    th.start()
    deadline = time.time() + 180
    victim = None
    while time.time() < deadline and victim is None:
        m = run / "metrics.jsonl"
        if (run / "schedule.json").exists() and m.exists() and len(m.read_text().splitlines()) >= 3:
            rank = json.loads((run / "schedule.json").read_text())["placement"][2][0]
            victim = _node_pid(run, rank)
        time.sleep(0.05)
    assert victim is not None, "the stage-2 node was not found"
    os.kill(victim, signal.SIGKILL)
    th.join(timeout=300)
    assert out.get("rc") == 0
    summary = json.loads((run / "run.json").read_text())
    assert summary["step"] == 14
    notes = json.loads((run / "lost_stages.json").read_text())
    assert list(notes) == ["2"] and "from the checkpoint after iteration" in notes["2"]
    assert main(["eval", str(run), "--batches", "1"]) == 0
    assert processes_of_run(run) == []


@pytest.mark.slow
def test_an_interrupt_before_the_first_checkpoint_says_how_to_train_again(byte_data, tmp_path):
    """SIGTERM before any checkpoint: the weights so far are written, and the one line says what
    works next (--overwrite), not a --resume that has nothing to resume; that command then runs."""
    run = tmp_path / "run"
    args = ["--preset", "tiny", "--quiet", "--data", str(byte_data), "--out", str(run), "--set", "checkpoint.every=0",
            "--set", "checkpoint.final=false", "--set", "train.eval_every=0", "--set", "train.eval_batches=1"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "skiptrain.cli", "train", *args, "--steps", "100000"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert "model.safetensors holds its weights; no checkpoint was written yet" in err
    assert "train again with --overwrite" in err and "Traceback" not in err
    again = subprocess.run([sys.executable, "-m", "skiptrain.cli", "train", *args, "--steps", "2", "--overwrite"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
