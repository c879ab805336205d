"""One run across hosts: a coordinator and one ``skiptrain node`` per host, each in its own
network, PID and UTS namespace (:mod:`skiptrain.runtime.netns`), sharing no file system with the
coordinator.  A killed node process and a 20 s partition of another host: training goes on, each
comes back as a new node, and the coordinator's run directory is complete.  Skipped (with the
reason) where namespaces cannot be made."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from skiptrain.runtime.host_swarm import HostSwarm
from skiptrain.runtime.netns import Hosts
from skiptrain.runtime.recovery import trained_samples

OK, WHY = Hosts.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"cannot emulate hosts as network namespaces here: {WHY}"),
              pytest.mark.slow]

NODES = 5


def test_a_run_across_hosts_survives_a_kill_and_a_partition(bpe_data, tmp_path):
    with Hosts(NODES + 1) as hosts:
        swarm = HostSwarm(hosts, tmp_path, str(bpe_data),
                          ["--nodes", str(NODES), "--steps", "300", "--heartbeat-deadline", "5",
                           "--set", "train.eval_batches=2", "--set", "runtime.heartbeat_s=0.25"])
        swarm.start_coordinator()
        swarm.wait_secret()
        for i in (3, 1, 5, 2, 4):                       # any order
            swarm.start_node(i)
        swarm.wait_step(3, timeout_s=120)
        # a kill -9 of host 2's node process: its supervisor reports it and it joins again
        killed = swarm.node_ids(2)[-1]
        t_kill = time.time()
        swarm.signal_node(2, signal.SIGKILL)
        row = swarm.wait(lambda: next((e for e in swarm.events() if e.get("node") == killed), None), 30,
                         "the kill's detection")
        assert row["t_detect"] - t_kill < 3.0 and "SIGKILL" in row["cause"]
        swarm.wait(lambda: len(swarm.node_ids(2)) == 2, 60, "host 2's new node")
        swarm.wait(lambda: any(r.get("nodes") == NODES and r["time"] > t_kill for r in swarm.rows()), 120,
                   "the swarm back at full strength")
        # a 20 s partition of another host: fenced by its lease, back as a new node after the link returns
        h = swarm.replicated_host({2})                   # (a stage that keeps a replica: stage 0 must live on)
        cut = swarm.node_ids(h)[-1]
        hosts.cut(h)
        t_cut = time.time()
        row = swarm.wait(lambda: next((e for e in swarm.events() if e.get("node") == cut), None), 30,
                         "the partition's detection")
        step = swarm.last_step()
        swarm.wait_step(step + 3, timeout_s=60)          # the others keep training while it is cut off
        time.sleep(max(0.0, 20 - (time.time() - t_cut)))
        hosts.restore(h)
        swarm.wait(lambda: len(swarm.node_ids(h)) == 2, 120, f"host {h}'s new node")
        rc = swarm.finish(timeout_s=600)
    assert rc == 0, swarm.log("coordinator")[-3000:]
    run = swarm.run_dir
    for name in ("config.toml", "model.safetensors", "run.json", "metrics.jsonl", "schedule.json"):
        assert (run / name).is_file(), name
    steps = [r["step"] for r in swarm.rows() if "loss" in r]
    assert steps == list(range(1, 301))
    summary = json.loads((run / "run.json").read_text())
    kinds = [e["kind"] for e in summary["membership"]]
    assert kinds.count("failed") >= 2 and "joined" in kinds, kinds
    assert "no lease renewal" in row["cause"]
    stopped = json.loads((run / "errors" / f"node{cut}.json").read_text())       # shipped once the link was back
    assert "lease" in stopped["msg"] and stopped["time"] < row["t_detect"]     # it stopped itself first
    samples = [i for s in trained_samples(run / "phases" / "train").values() for i in s]
    assert len(samples) == len(set(samples))                  # nothing trained twice


def _run_across_hosts(hosts, root, data, kill_coordinator: bool) -> HostSwarm:
    swarm = HostSwarm(hosts, root, data, ["--nodes", "4", "--steps", "60", "--heartbeat-deadline", "5",
                                          "--set", "train.eval_batches=2", "--set", "runtime.heartbeat_s=0.25"])
    swarm.start_coordinator()
    swarm.wait_secret()
    for i in range(1, 5):
        swarm.start_node(i)
    if kill_coordinator:
        swarm.wait(lambda: swarm.committed_step() >= 16, 240, "a checkpoint at step 16")
        swarm.kill_coordinator()                          # its host's whole process tree with it
        time.sleep(6)                                     # the nodes stop: nobody renews their leases
        swarm.start_coordinator("--resume")
    assert swarm.finish(timeout_s=600) == 0, swarm.log("coordinator")[-3000:]
    return swarm


def test_a_new_coordinator_resumes_the_run_exactly_from_its_checkpoint(bpe_data, tmp_path):
    """The coordinator's host dies; a new coordinator started with ``--resume`` takes the run over
    from the checkpoint committed in its run directory (the nodes sent their parts there), the
    nodes waiting for it join, and the run ends bit-identical to one that was never interrupted."""
    from safetensors.torch import load_file

    with Hosts(5) as hosts:
        ref = _run_across_hosts(hosts, tmp_path / "ref", str(bpe_data), kill_coordinator=False)
        run = _run_across_hosts(hosts, tmp_path / "killed", str(bpe_data), kill_coordinator=True)
    assert "resuming from" in run.log("coordinator")
    losses = [{r["step"]: r["loss"] for r in s.rows() if "loss" in r} for s in (ref, run)]
    assert sorted(losses[1]) == list(range(1, 61)) and losses[0] == losses[1]
    a, b = load_file(ref.run_dir / "model.safetensors"), load_file(run.run_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    samples = [i for s in trained_samples(run.run_dir / "phases" / "train").values() for i in s]
    assert len(samples) == len(set(samples)) == 60 * 16             # each once, across both coordinators
    assert (run.run_dir / "checkpoints" / "LATEST").read_text().strip() == "step-00000060"


def test_the_nodes_train_on_while_the_coordinators_process_is_dead_and_stop_when_none_comes(bpe_data, tmp_path):
    """The coordinator's process dies and its host lives: the run's store (a process of its own)
    serves on, the nodes keep training, and ``coordinator --resume`` takes the live run over (no
    node fenced, no iteration re-run).  Then it dies again and none comes within
    ``runtime.coordinator_wait_s``: the nodes stop at a boundary, the store exits, and ``--resume``
    continues from the last committed checkpoint.  Every iteration is recorded once, every
    sample trained once, and the run directory is complete."""
    steps = 600                        # (long enough for both absences: about 6 iterations a second here)
    with Hosts(5) as hosts:
        swarm = HostSwarm(hosts, tmp_path, str(bpe_data),
                          ["--nodes", "4", "--steps", str(steps), "--heartbeat-deadline", "5",
                           "--set", "train.eval_batches=2", "--set", "runtime.heartbeat_s=0.25",
                           "--set", "runtime.coordinator_wait_s=15"])
        swarm.start_coordinator(host_lives=True)
        swarm.wait_secret()
        for i in range(1, 5):
            swarm.start_node(i)
        swarm.wait(lambda: swarm.committed_step() >= 10, 240, "a checkpoint at step 10")
        swarm.kill_coordinator_process()
        step = swarm.local_last_step()
        swarm.wait(lambda: swarm.local_last_step() >= step + 5, 15, "iterations without a coordinator")
        swarm.start_coordinator("--resume", host_lives=True)
        swarm.wait(lambda: "taking over the live run" in swarm.log("coordinator"), 60, "the take-over")
        swarm.wait(lambda: swarm.committed_step() > step + 5, 240, "a checkpoint committed by the new coordinator")
        assert all(len(swarm.node_ids(i)) == 1 for i in range(1, 5))           # nobody was fenced
        swarm.kill_coordinator_process()                                       # and now none comes
        swarm.wait(lambda: all(swarm.node_pid(i) is None for i in range(1, 5)), 90,
                   "every node stopped for want of a coordinator")
        swarm.start_coordinator("--resume")
        rc = swarm.finish(timeout_s=600)
    log = swarm.log("coordinator")
    assert rc == 0, log[-3000:]
    assert "resuming from" in log
    assert all("no coordinator for too long" in swarm.log(f"node_h{i}") for i in range(1, 5))
    run = swarm.run_dir
    for name in ("config.toml", "model.safetensors", "run.json", "metrics.jsonl", "schedule.json"):
        assert (run / name).is_file(), name
    assert [r["step"] for r in swarm.rows() if "loss" in r] == list(range(1, steps + 1))
    samples = [i for s in trained_samples(run / "phases" / "train").values() for i in s]
    assert len(samples) == len(set(samples)) == steps * 16
    causes = [e["cause"] for e in swarm.events()]
    assert not any(e.get("node") is not None and not e.get("join") for e in swarm.events()), causes
