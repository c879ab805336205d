"""Joining a running job: a node started with ``--join HOST:PORT`` passes the HMAC challenge, is
placed on the stage where it shortens the iteration most, receives weights, optimizer and sync
state from the live replicas over the wire (moves planned by the layout-change core) and starts at
an iteration boundary; a process with a wrong secret is refused and never enters a process group.
Units: ``add_replica``, ``choose_stage``, ``join_transfers``, the state by name from several
senders."""

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
from skiptrain.net.topology import load_topology
from skiptrain.runtime.job import Job, Phase, build_cost, with_runtime
from skiptrain.runtime.join import EXIT_REFUSED
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.recovery import add_replica, choose_stage, join_transfers, replan, trained_samples
from skiptrain.schedule.schedule import MicroBatch, Schedule

REPO = Path(__file__).resolve().parents[1]


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


def test_garbled_join_input_is_refused_not_a_crash_and_claimed_pids_are_never_dangerous():
    from skiptrain.runtime.failure import pid_running
    from skiptrain.runtime.join import hello_pid, respond, verify
    from skiptrain.runtime.membership import member_key, sign

    nonce = "ab" * 32
    good = respond("s3cret", nonce, 7)
    assert verify("s3cret", nonce, 7, good)
    assert not verify("s3cret", nonce, 8, good) and not verify("other", nonce, 7, good)
    for bad in ["", "\u00e9" * 64, "\ufffd", good[:-1], good + "0", None, 12]:
        assert verify("s3cret", nonce, 7, bad) is False          # wrong, never an exception
    def signed(value, node=7, secret="s3cret"):
        return sign(member_key(secret, node), f"join/hello/{node}", value)

    assert hello_pid("s3cret", 7, signed(json.dumps({"pid": 4321}))) == 4321
    for hello in ['{"pid": -1}', '{"pid": 0}', '{"pid": 1}', '{"pid": [1]}', '{"pid": 1e400}', '{"pid": true}',
                  json.dumps({"pid": os.getpid()}), '{"pid": "12"}', "not json", "[]", '{"pid": 99999999999}']:
        assert hello_pid("s3cret", 7, signed(hello)) == 0, hello
    # a PID not signed with node 7's member key (no tag, another node's key, another secret) is never used
    for forged in [json.dumps({"pid": 4321}), signed(json.dumps({"pid": 4321}), node=8),
                   signed(json.dumps({"pid": 4321}), secret="guess"), signed(json.dumps({"pid": 4321})) + "0"]:
        assert hello_pid("s3cret", 7, forged) == 0, forged
    assert not pid_running(-1) and not pid_running(0) and not pid_running(1)


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


@pytest.mark.slow
@pytest.mark.parametrize("died_after", ["the assignment", "the record"])
def test_a_join_its_dead_coordinator_left_half_published_is_taken_up_under_the_replacement(byte_data, tmp_path,
                                                                                          died_after):
    """The coordinator dies after assigning a joiner its generation and before publishing it, or
    after writing the generation's record and before its counter (both played here by the test,
    which holds the secret): the replacement (``python -m skiptrain.runtime.coordinator --run``)
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
        coord = subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.coordinator", "--run", str(run)],
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
