"""Multi-process skip-pipeline runtime (skiptrain.runtime): units, exact equivalence with the
single-process trainer, a short training run, and failure handling (killed and hung peers).

The units (no process started) are in tests/unit/test_runtime_units.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import processes_of_run
from skiptrain.config import build_config
from skiptrain.runtime.failure import RuntimeFailure
from skiptrain.runtime.faults import faulty_job
from skiptrain.runtime.job import Job, build_cost, build_schedule, build_topology, phase_for, with_runtime
from skiptrain.runtime.launcher import launch
from skiptrain.schedule.schedule import Schedule
from skiptrain.schedule.timeline import check_no_overlap


# ---- multi-process ------------------------------------------------------------------------------

def _cfg(dp=None, **train):
    """The tiny model on a 6-node swarm (2/2/1/1) at the default settings (grad_clip 1.0)."""
    return build_config("tiny", overrides={
        "runtime": {"nodes": 6, "stage_sizes": "2,2,1,1", "mb_per_originator": 2, "timeout_s": 20},
        "train": {"steps": 10, "warmup_steps": 2, **train}, "dp": dp or {}})


EQUIV_ITERS = 3


def _reference(cfg, data, schedule, steps=EQUIV_ITERS):
    """The single-process Trainer (one node hosting every stage) for ``steps`` steps with the
    schedule's routes (micro-batch id order): its parameters, and the unclipped per-stage mean
    gradients of the first step."""
    import skiptrain.train.trainer as tr
    from skiptrain.data.dataset import TokenDataset

    mbs = sorted(schedule.micro_batches, key=lambda m: m.id)
    cfg.train.n_micro = len(mbs)
    orig = tr.draw_routes
    tr.draw_routes = lambda c, rng: [list(m.stages) for m in mbs]
    try:
        t = tr.Trainer(cfg, None, dataset=TokenDataset.open(data))
        assert t.cfg.train.grad_clip == 1.0
        for _ in range(steps):
            t.train_step()
        params = {n: p.detach() for n, p in t.model.named_parameters()}
        g_cfg = cfg_copy(cfg, grad_clip=0.0)
        g = tr.Trainer(g_cfg, None, dataset=TokenDataset.open(data))
        g.train_step()
        grads = {n: p.grad.clone() if p.grad is not None else None for n, p in g.model.named_parameters()}
        return params, grads
    finally:
        tr.draw_routes = orig


def cfg_copy(cfg, **train):
    from skiptrain.config import config_from_dict

    c = config_from_dict(cfg.to_dict())
    for k, v in train.items():
        setattr(c.train, k, v)
    return c


@pytest.fixture(scope="module")
def swarm(byte_data, tmp_path_factory):
    """One launch, three phases: k=0 full pipeline, a planner skip schedule (3 iterations each),
    and a short training run on the skip schedule with a higher learning rate."""
    cfg = _cfg()
    topo = build_topology(cfg, 6)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    full = build_schedule(cfg, "full_pipeline", topo, cost)
    cfg_k = _cfg(skip_ratio=0.5)
    skip = build_schedule(cfg_k, "planner", topo, cost)
    run_dir = tmp_path_factory.mktemp("swarm")
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=20),
              data_path=str(byte_data), run_dir=str(run_dir), phases=[phase_for(cfg, full, topo, cost, "full", EQUIV_ITERS, dump=True),
                      phase_for(cfg, skip, topo, cost, "skip", EQUIV_ITERS, dump=True),
                      phase_for(cfg, skip, topo, cost, "train", 8, dump=True)])
    job.config["train"]["lr"] = 3e-3
    res = launch(job, timeout_s=240)
    return {"res": res, "cfg": cfg, "full": full, "skip": skip, "data": byte_data, "dir": Path(run_dir)}


def _dist_params(run_dir: Path, phase: str, sched: Schedule) -> dict[str, torch.Tensor]:
    out = {}
    for n in sched.nodes():
        for k, v in torch.load(run_dir / "phases" / phase / f"params_node{n}.pt").items():
            out.setdefault(k, v)
    return out


def test_k0_swarm_equals_the_one_node_runtime_at_default_settings(swarm):
    full = swarm["full"]
    assert full.skip_ratio == 0 and all(m.stages == [1, 2, 3] for m in full.micro_batches)
    ref, _ = _reference(_cfg(), swarm["data"], full)
    got = _dist_params(swarm["dir"], "full", full)
    assert set(got) == set(ref)
    from skiptrain.model import StagedLM
    init = dict(StagedLM(_cfg().model, seed=_cfg().train.seed).named_parameters())
    assert max(float((ref[n] - init[n].detach()).abs().max()) for n in ref) > 1e-4   # the steps moved them
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0, msg=lambda m: f"{n}: {m}")


def test_the_default_clip_is_active_in_the_equivalence(swarm):
    """The swarm's first iteration has a global gradient norm above 1.0, so the equivalence
    above covers the global clip (summed across the swarm) and not only the unclipped path."""
    rows = swarm["res"].phase_iterations("full")
    assert rows and rows[0]["grad_norm"] > 1.0, rows[0]


def test_skip_schedule_gradients_and_steps_match_route_reference(swarm):
    skip = swarm["skip"]
    assert any(len(m.route) < 3 for m in skip.micro_batches)   # really skipping
    ref_p, ref_g = _reference(_cfg(skip_ratio=0.5), swarm["data"], skip)
    # per stage: sum of the replicas' summed gradients / micro-batches that visited the stage
    d = swarm["dir"] / "phases" / "skip"
    for s, nodes in enumerate(skip.placement):
        dumps = [torch.load(d / f"grads_node{n}.pt") for n in nodes]
        total = sum(x["n"] for x in dumps)
        assert total == skip.stage_visits()[s] if s else len(skip.micro_batches)
        for name, g in dumps[0]["grads"].items():
            acc = sum(x["grads"][name] for x in dumps) / total
            torch.testing.assert_close(acc, ref_g[name], atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    got = _dist_params(swarm["dir"], "skip", skip)
    for n in ref_p:
        torch.testing.assert_close(got[n], ref_p[n], atol=1e-5, rtol=0, msg=lambda m: f"{n}: {m}")


def test_demo_swarm_keeps_replicas_bit_identical(byte_data, tmp_path):
    """DeMo on the 2/2/1/1 swarm with a skip schedule: after 3 iterations every stage's replicas
    hold bit-identical parameters, and the parameters moved."""
    cfg = _cfg(dp={"strategy": "demo", "chunk": 16, "topk": 8, "values": "sign1", "indices": "u12",
                   "check_every": 1}, skip_ratio=0.5)
    topo = build_topology(cfg, 6)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    skip = build_schedule(cfg, "planner", topo, cost)
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=20), data_path=str(byte_data),
              run_dir=str(tmp_path / "run"),
              phases=[phase_for(cfg, skip, topo, cost, "demo", EQUIV_ITERS, dump=True)])
    launch(job, timeout_s=240)
    d = tmp_path / "run" / "phases" / "demo"
    from skiptrain.model import StagedLM
    init = dict(StagedLM(cfg.model, seed=cfg.train.seed).named_parameters())
    for nodes in skip.placement:
        first = torch.load(d / f"params_node{nodes[0]}.pt")
        assert max(float((first[k] - init[k].detach()).abs().max()) for k in first) > 1e-4
        for n in nodes[1:]:
            other = torch.load(d / f"params_node{n}.pt")
            assert all(torch.equal(first[k], other[k]) for k in first), f"replica {n} differs from {nodes[0]}"


def test_training_losses_fall_and_replicas_stay_identical(swarm):
    rows = swarm["res"].phase_iterations("train")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    skip = swarm["skip"]
    d = swarm["dir"] / "phases" / "train"
    for nodes in skip.placement:
        first = torch.load(d / f"params_node{nodes[0]}.pt")
        for n in nodes[1:]:
            other = torch.load(d / f"params_node{n}.pt")
            for k in first:
                assert torch.equal(first[k], other[k]), f"replica {n} differs from {nodes[0]} in {k}"


def test_the_start_margin_follows_the_slowest_receipt_of_the_start_time(swarm):
    """Each iteration starts at rank 0's clock plus a margin: 0.2 s in a phase's first
    iteration after launch, then twice the slowest node's receipt of the start time over the
    last 10 iterations, within 0.01 .. 0.2 s (the node keeps it across phases)."""
    rows = [r for p in ("full", "skip", "train") for r in swarm["res"].phase_iterations(p)]
    assert rows[0]["start_margin_s"] == 0.2
    delays = [r["start_delay_s"] for r in rows]
    assert all(0 <= d < 5 for d in delays)
    for i in range(1, len(rows)):
        want = min(0.2, max(0.01, 2 * max(delays[max(0, i - 10):i])))
        assert rows[i]["start_margin_s"] == pytest.approx(want, abs=2e-6), (i, rows[i], delays)


def test_metrics_split_each_iteration_into_its_pipeline_and_the_sync_after_it(swarm):
    """``iteration_s`` ends with the last event of the iteration (the data-parallel syncs and the
    optimizer step included), ``pipeline_s`` with its last compute task (forward, loss,
    backward): both read off the recorded timeline, rounded as the metrics are."""
    for phase in ("full", "skip", "train"):
        for i, row in enumerate(swarm["res"].phase_iterations(phase)):
            ev = swarm["res"].timeline(phase, i)
            compute = [e for e in ev if e.kind in ("fwd", "loss", "bwd")]
            assert row["iteration_s"] == pytest.approx(max(e.end for e in ev), abs=1e-4), (phase, i)
            assert row["pipeline_s"] == pytest.approx(max(e.end for e in compute), abs=1e-4), (phase, i)
            assert 0 < row["pipeline_s"] <= row["iteration_s"]


def test_cpu_seconds_are_those_each_iteration_used(swarm):
    """``cpu_s`` sums the node processes' CPU seconds from an iteration's common start to its
    stats gather: above zero (they computed) and within what this machine's cores can give
    between that start and the next one (not a count since the process started)."""
    cores = len(os.sched_getaffinity(0))
    for phase in ("full", "skip", "train"):
        rows = swarm["res"].phase_iterations(phase)
        rec = json.loads((swarm["dir"] / "phases" / phase / "node0.json").read_text())
        starts = [it["t0"] for it in rec["iterations"]]
        for i, row in enumerate(rows[:-1]):
            assert 0 < row["cpu_s"] <= cores * (starts[i + 1] - starts[i]) + 0.05, (phase, i, row["cpu_s"])


def test_timeline_is_recorded_in_simulator_format(swarm):
    ev = swarm["res"].timeline("skip", 0)
    kinds = {e.kind for e in ev}
    assert {"fwd", "bwd", "loss", "send", "recv", "sync"} <= kinds
    check_no_overlap(ev)
    skip = swarm["skip"]
    n_fwd = sum(1 + len(m.route) for m in skip.micro_batches)
    assert sum(e.kind == "fwd" for e in ev) == n_fwd and sum(e.kind == "bwd" for e in ev) == n_fwd
    assert sum(e.kind == "send" for e in ev) == sum(2 * (len(m.route) + 1) for m in skip.micro_batches if m.route)


@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_failed_peer_stops_the_run_with_an_error_naming_it(byte_data, tmp_path, kind):
    cfg = build_config("tiny", overrides={"runtime": {"nodes": 4, "stage_sizes": "1,1,1,1"}})
    topo = build_topology(cfg, 4)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    sched = build_schedule(cfg, "full_pipeline", topo, cost)
    victim = sched.placement[2][0]
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=4.0, heartbeat_s=0.25), data_path=str(byte_data),
              run_dir=str(tmp_path / "run"), phases=[phase_for(cfg, sched, topo, cost, "p", 3)],
              **faulty_job({"node": victim, "kind": kind, "iteration": 1}))
    with pytest.raises(RuntimeFailure) as ei:
        launch(job, timeout_s=180)
    e = ei.value
    assert e.node == victim, str(e)
    assert f"node {victim} (stage 2)" in str(e)
    assert ("died (killed by SIGKILL)" if kind == "kill" else "stopped responding") in str(e)
    assert e.detected_after_s is not None and e.detected_after_s < 30
    assert processes_of_run(tmp_path / "run") == []


def test_int8_hops_swarm_equals_the_one_node_runtime_with_the_same_codec(byte_data, tmp_path):
    """Every link compressed to int8 (activations and gradients, one scale per row): the swarm's
    wire path (encode, send the bytes, decode) and the one-process trainer's in-process codec
    give the same parameters after 3 iterations; what crosses the wire is the encoded bytes."""
    codec = {"act_codec": "int8", "act_fast_GBps": 1e9}
    cfg = _cfg()
    for k, v in codec.items():
        setattr(cfg.runtime, k, v)
    topo = build_topology(cfg, 6)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    assert cost.act_codec == "int8" and cost.hop_codec(topo, 0, 2) == "int8"
    full = build_schedule(cfg, "full_pipeline", topo, cost)
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=20), data_path=str(byte_data),
              run_dir=str(tmp_path / "run"),
              phases=[phase_for(cfg, full, topo, cost, "q", EQUIV_ITERS, dump=True)])
    res = launch(job, timeout_s=240)
    ref_cfg = _cfg()
    ref_cfg.runtime.act_codec = "int8"
    ref, _ = _reference(ref_cfg, byte_data, full)
    plain, _ = _reference(_cfg(), byte_data, full)
    got = _dist_params(tmp_path / "run", "q", full)
    assert max(float((ref[n] - plain[n]).abs().max()) for n in ref) > 1e-6      # the codec changed training
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0, msg=lambda m: f"{n}: {m}")
    from skiptrain.schedule.actcodec import encoded_bytes

    rows = cfg.train.micro_batch * cfg.model.seq_len
    sends = [e for e in res.timeline("q", 0) if e.kind == "send"]
    assert sends and all(e.bytes == encoded_bytes("int8", rows, cfg.model.d_model) for e in sends)
    assert all(e.bytes * 3.7 < rows * cfg.model.d_model * 4 for e in sends)    # d=64: 64 + 4 scale bytes a row


def test_bf16_swarm_equals_the_one_node_runtime_in_bf16_and_lowers_the_loss(byte_data, tmp_path):
    """train.precision=bf16 on the 2/2/1/1 swarm: every node runs its forwards and backwards
    under bf16 autocast with fp32 weights and AdamW state, and every hop carries bf16 (half the
    bytes of fp32).  The one-process trainer in bf16 (which passes every hop through the same
    bf16 encoding) ends 3 iterations with the same parameters, to the fp32 equivalence's 1e-5:
    the nodes compute the same bf16 operations on the same values, so only the summation order
    of the replica sync differs, as in fp32.  A further phase of 8 iterations lowers the loss."""
    cfg = _cfg(precision="bf16", lr=3e-3)
    topo = build_topology(cfg, 6)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    assert cost.act_plain == "bf16" and cost.hop_codec(topo, 0, 2) == "bf16"
    full = build_schedule(cfg, "full_pipeline", topo, cost)
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=20), data_path=str(byte_data),
              run_dir=str(tmp_path / "run"),
              phases=[phase_for(cfg, full, topo, cost, "eq", EQUIV_ITERS, dump=True),
                      phase_for(cfg, full, topo, cost, "train", 8)])
    res = launch(job, timeout_s=240)
    ref, _ = _reference(_cfg(precision="bf16", lr=3e-3), byte_data, full)
    fp32, _ = _reference(_cfg(lr=3e-3), byte_data, full)
    got = _dist_params(tmp_path / "run", "eq", full)
    assert all(v.dtype == torch.float32 for v in got.values())                   # fp32 master weights
    assert max(float((ref[n] - fp32[n]).abs().max()) for n in ref) > 1e-4         # bf16 changed training
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0, msg=lambda m: f"{n}: {m}")
    from skiptrain.schedule.actcodec import encoded_bytes

    rows = cfg.train.micro_batch * cfg.model.seq_len
    sends = [e for e in res.timeline("eq", 0) if e.kind == "send"]
    assert sends and all(2 * e.bytes == rows * cfg.model.d_model * 4 == 2 * encoded_bytes("bf16", rows, 64)
                         for e in sends)
    losses = [r["loss"] for r in res.phase_iterations("train")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    for s, nodes in enumerate(full.placement):        # each node printed its stage's memory estimate
        for n in nodes:
            log = (tmp_path / "run" / "logs" / f"node{n}.log").read_text()
            assert f"skiptrain node {n}: cpu, bf16: stage {s}: " in log and " GiB (parameters " in log, log[-500:]


# ---- a node serving several stages ------------------------------------------------------------

def _cfg_shared(**train):
    """The tiny model on 5 nodes, two of them serving stages 1 and 2 together (one large device
    each): stage 0 on nodes 0 and 1, stages 1+2 on nodes 2 and 3, stage 3 on node 4."""
    return build_config("tiny", overrides={
        "runtime": {"nodes": 5, "node_stages": "0,0,1+2,1+2,3", "method": "random_skip", "mb_per_originator": 2,
                    "timeout_s": 20},
        "train": {"steps": 10, "warmup_steps": 2, **train}, "checkpoint": {"final": True}})


@pytest.fixture(scope="module")
def shared(byte_data, tmp_path_factory):
    """One launch, two phases on the shared placement: the full pipeline (k=0) and random skip
    routes (k=0.25), 3 iterations each, parameters dumped, a final checkpoint."""
    cfg = _cfg_shared()
    topo = build_topology(cfg, 5)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    full = build_schedule(cfg, "full_pipeline", topo, cost)
    skip = build_schedule(_cfg_shared(skip_ratio=0.25), "random_skip", topo, cost)
    planned = build_schedule(_cfg_shared(skip_ratio=0.25), "planner", topo, cost)
    run_dir = tmp_path_factory.mktemp("shared")
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=20), data_path=str(byte_data), run_dir=str(run_dir),
              phases=[phase_for(cfg, full, topo, cost, "full", EQUIV_ITERS, dump=True),
                      phase_for(cfg, skip, topo, cost, "skip", EQUIV_ITERS, dump=True, config={"train": {"skip_ratio": 0.25}}),
                      phase_for(cfg, planned, topo, cost, "planned", EQUIV_ITERS, dump=True,
                                config={"train": {"skip_ratio": 0.25}}),
                      phase_for(cfg, skip, topo, cost, "demo", EQUIV_ITERS, dump=True, config={
                          "train": {"skip_ratio": 0.25}, "dp": {"strategy": "demo", "chunk": 16, "topk": 8,
                                                                "values": "sign1", "indices": "u12", "check_every": 1}})])
    res = launch(job, timeout_s=240)
    return {"res": res, "full": full, "skip": skip, "planned": planned, "data": byte_data, "dir": Path(run_dir)}


def test_a_node_serving_two_stages_equals_the_one_node_runtime(shared):
    """k=0, random skip routes and the planner's skip routes: the swarm whose nodes 2 and 3 each
    serve stages 1 and 2 (hops between them stay on the node, one sync strategy per stage, one
    optimizer) ends where the one-process runtime does, at the default clip."""
    full, skip, planned = shared["full"], shared["skip"], shared["planned"]
    assert full.placement == [[0, 1], [2, 3], [2, 3], [4]] and full.hosts_several()
    assert planned.placement == full.placement and planned.method == "planner"
    assert any(m.nodes[:2] == [m.nodes[0]] * 2 for m in full.micro_batches)        # a hop inside a node
    assert any(len(m.route) < 3 for m in skip.micro_batches)
    assert all(len(m.route) == 2 for m in planned.micro_batches)
    for name, sched, cfg in (("full", full, _cfg_shared()), ("skip", skip, _cfg_shared(skip_ratio=0.25)),
                             ("planned", planned, _cfg_shared(skip_ratio=0.25))):
        ref, _ = _reference(cfg, shared["data"], sched)
        got = _dist_params(shared["dir"], name, sched)
        assert set(got) == set(ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0, msg=lambda m: f"{name} {n}: {m}")
        for nodes in sched.placement:
            a, b = (torch.load(shared["dir"] / "phases" / name / f"params_node{x}.pt") for x in (nodes + nodes)[:2])
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_node_serving_two_stages_keeps_demo_replicas_bit_identical(shared):
    """DeMo, one strategy per stage: nodes 2 and 3 (stages 1+2) end bit-identical, and moved."""
    import json

    from skiptrain.model import StagedLM

    d = shared["dir"] / "phases" / "demo"
    a, b = (torch.load(d / f"params_node{n}.pt") for n in (2, 3))
    init = dict(StagedLM(_cfg_shared().model, seed=_cfg_shared().train.seed).named_parameters())
    assert {k.split(".")[1] for k in a if k.startswith("layers.")} == {"1", "2"}
    assert max(float((a[k] - init[k].detach()).abs().max()) for k in a) > 1e-4
    assert all(torch.equal(a[k], b[k]) for k in a)
    summ = json.loads((d / "node2.json").read_text())["sync_summary"]
    assert summ["syncs"] == EQUIV_ITERS and summ["ratio_payload_vs_fp32"] > 10


def test_a_node_serving_two_stages_checkpoints_both(shared):
    """The final checkpoint holds every stage once; its weights are the dumped ones."""
    from skiptrain.checkpoint import store
    from skiptrain.model import StagedLM
    from skiptrain.runtime.job_checkpoint import load_node_state

    cfg = _cfg_shared()
    model = StagedLM(cfg.model, seed=cfg.train.seed)
    ckpt = store.latest(shared["dir"] / "checkpoints" / "skip")
    load_node_state(ckpt, model)
    got = _dist_params(shared["dir"], "skip", shared["skip"])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), got[n]), n


def test_the_loop_validates_through_the_pipeline_what_the_merged_model_validates(shared):
    """The in-loop validation after each phase's last iteration runs through the pipeline (each
    validation micro-batch on one replica of every stage, the hop between stages 1 and 2 inside
    a node) and gives the loss of the merged model's one-process validation."""
    from skiptrain.data.dataset import TokenDataset
    from skiptrain.data.loader import SampleSource
    from skiptrain.model import StagedLM
    from skiptrain.runtime.evaluate import evaluate

    cfg = _cfg_shared()
    cfg.model.vocab_size = TokenDataset.open(shared["data"]).vocab_size
    val = SampleSource(TokenDataset.open(shared["data"]).tokens("val"), cfg.model.seq_len, shuffle=False)
    for name in ("full", "skip"):
        rows = [r for r in shared["res"].phase_metrics(name) if "val_loss" in r]
        assert [r["step"] for r in rows] == [EQUIV_ITERS] and rows[0]["seconds"] > 0
        model = StagedLM(cfg.model)
        model.load_state_dict(_dist_params(shared["dir"], name, shared[name]))
        want = evaluate(model, val, cfg.train.eval_batches, cfg.train.micro_batch)
        assert rows[0]["val_loss"] == pytest.approx(want, abs=1e-4), name


def test_a_node_serving_two_stages_resumes_exactly(shared, tmp_path):
    """The skip phase's final checkpoint (iteration 3), resumed on the same layout for one more
    iteration, ends where 4 uninterrupted one-process iterations do."""
    from skiptrain.checkpoint import store
    from skiptrain.runtime.job_checkpoint import resume_point

    cfg, skip = _cfg_shared(skip_ratio=0.25), shared["skip"]
    topo = build_topology(cfg, 5)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    start = {**resume_point(store.latest(shared["dir"] / "checkpoints" / "skip")), "phase": 0}
    assert start["iteration"] == EQUIV_ITERS
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=20), data_path=str(shared["data"]),
              run_dir=str(tmp_path / "run"), resume=start,
              phases=[phase_for(cfg, skip, topo, cost, "skip", EQUIV_ITERS + 1, dump=True)])
    launch(job, timeout_s=240)
    ref, _ = _reference(cfg, shared["data"], skip, steps=EQUIV_ITERS + 1)
    got = _dist_params(tmp_path / "run", "skip", skip)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0, msg=lambda m: f"{n}: {m}")
