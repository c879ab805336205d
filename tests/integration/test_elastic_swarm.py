"""Elastic freezing in a swarm of node processes: the rule decides for the whole swarm, the
pipeline shrinks across processes, state moves between them by name, checkpoints resume into
the transitioned layout, and a node killed mid-transition is recovered like any failure.

The units (no process started) are in tests/unit/test_elastic_swarm_units.py."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.checkpoint.weights import load_weights
from skiptrain.data.dataset import TokenDataset
from skiptrain.runtime.job import Job, build_cost, build_schedule, build_topology, phase_for
from skiptrain.runtime.job_checkpoint import resume_point
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.live import load_live_records
from skiptrain.runtime.recovery import trained_samples
from unit.test_elastic_swarm_units import GB, ITERS, _cfg, one_process_freezing


def _job(cfg, data: Path, run: Path, iterations: int = ITERS, resume: dict | None = None,
         s_per_sample_layer: float = 0.001, **kw) -> Job:
    cfg.model.vocab_size = TokenDataset.open(data).vocab_size
    topo = build_topology(cfg, cfg.runtime.nodes)
    cost = build_cost(cfg, s_per_sample_layer=s_per_sample_layer)
    sched = build_schedule(cfg, "full_pipeline", topo, cost)
    return Job(config=cfg.to_dict(), data_path=str(data), run_dir=str(run),
               phases=[phase_for(cfg, sched, topo, cost, "p", iterations, save_weights=True, dump=True)],
               resume=resume, **kw)


def _log(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "elastic.jsonl").read_text().splitlines()]


def _node_params(run: Path) -> dict[int, tuple[int, dict]]:
    out = {}
    for f in sorted((run / "phases" / "p").glob("params_node*.pt")):
        r = int(f.stem.removeprefix("params_node"))
        rec = json.loads((run / "phases" / "p" / f"node{r}.json").read_text())
        out[r] = (rec["stage"], torch.load(f))
    return out


# ---- the swarm -------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_swarm_freezes_shrinks_and_trains_what_the_single_process_trainer_trains(byte_data, tmp_path):
    """6 node processes (2/2/1/1, k=0): the rule freezes 1 then 2 layers; the pipeline shrinks
    across processes; replicas of every final stage are bit-identical; every sample trained
    once; frozen weights never change after their freeze; and the swarm ends where the
    one process freezing the same way (same rule, same data) ends."""
    run = tmp_path / "run"
    res = launch(_job(_cfg(), byte_data, run), timeout_s=300)
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1))
    log = _log(run)
    tr = [r for r in log if r.get("action") == "transition"]
    assert [(t["frozen_before"], t["frozen_after"], t["step"]) for t in tr] == [(0, 1, 4), (1, 2, 6)]
    assert tr[0]["transfer_messages"] > 0 and tr[0]["transfer_bytes"] > 0 and tr[0]["stages_after"] < 4
    decisions = [r for r in log if "window" in r]
    assert all(r["val_loss"] is not None for r in decisions)          # the originators' guard ran
    # replicas bit-identical after the transitions
    params = _node_params(run)
    by_stage: dict[int, list[dict]] = {}
    for r, (s, p) in params.items():
        if s is not None:
            by_stage.setdefault(s, []).append(p)
    assert len(by_stage) == tr[-1]["stages_after"] and max(len(v) for v in by_stage.values()) >= 2
    for s, reps in by_stage.items():
        for p in reps[1:]:
            assert p.keys() == reps[0].keys()
            assert all(torch.equal(p[k], reps[0][k]) for k in p), f"stage {s} replicas differ"
    # no sample repeated or skipped across the transitions
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(per_it) == list(range(ITERS))
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * GB))
    # the frozen prefix stopped changing at its freeze (checkpoint at the boundary after step 4)
    at4 = CheckpointReader(run / "checkpoints" / "step-00000004")
    final = load_weights(run / "model.safetensors")
    saved = at4.read_many([n for n in final if n.startswith(("layers.0.", "tok_emb."))])
    assert len(saved) > 2 and all(torch.equal(final[n], t) for n, t in saved.items())
    # one process freezing the same way (the simple reference), same rule and data, 4 micro-batches
    transitions, ref = one_process_freezing(_cfg(n_micro=4), byte_data, ITERS)
    assert transitions == [(0, 1, 4), (1, 2, 6)]
    worst = max((final[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < 1e-4, f"swarm and one process differ by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("node_stages,strategy", [("0,1+2,3", "allreduce"), ("0,1+2,3", "demo"),
                                                   ("0+1+2+3", "allreduce")])
def test_nodes_serving_several_stages_freeze_with_the_swarm_and_resume_before_the_move(byte_data, tmp_path,
                                                                                       node_stages, strategy):
    """4 stages on 3 nodes (node 1 serving stages 1 and 2; all-reduce, or DeMo, whose momentum is
    sync state that must move with its stage) or on one node serving all: the rule
    freezes at steps 4 and 6 as in a swarm of one stage per node.  AutoPipe's memory budget is
    the most a node held at the start, so on 3 nodes the first transition moves node 1's stages'
    state (with both sync strategies') out, and each node then serves one stage at most; the one
    node goes to one stage and moves nothing.  Either swarm ends where one process freezing the
    same way ends (under DeMo, where a swarm of a node per stage ends: the reference's layout
    change starts its sync afresh); a job resumed from the checkpoint taken before the first
    transition (the pending freeze in it) ends with the same losses."""
    cfg = _cfg(runtime={"nodes": len(node_stages.split(",")), "stage_sizes": "", "node_stages": node_stages})
    cfg.dp.strategy = strategy
    run = tmp_path / "run"
    res = launch(_job(cfg, byte_data, run), timeout_s=300)
    tr = [r for r in _log(run) if r.get("action") == "transition"]
    assert [(t["frozen_before"], t["frozen_after"], t["step"]) for t in tr] == [(0, 1, 4), (1, 2, 6)]
    for t in tr:          # at most one stage per node after a transition
        placed = [n for p in t["placement"] for n in p]
        assert len(placed) == len(set(placed)) and set(placed) <= set(range(cfg.runtime.nodes))
    assert (tr[0]["transfer_messages"] > 0) == (cfg.runtime.nodes > 1)
    assert sorted(i for s in trained_samples(run / "phases" / "p").values() for i in s) == list(range(ITERS * 16))
    final = load_weights(run / "model.safetensors")
    if strategy == "demo":      # node 1's two stages' momentum moves with them: as with a node per stage
        one_each = _cfg(runtime={"nodes": 4, "stage_sizes": "", "node_stages": "0,1,2,3"})
        one_each.dp.strategy = strategy
        launch(_job(one_each, byte_data, tmp_path / "one_each"), timeout_s=300)
        ref = load_weights(tmp_path / "one_each" / "model.safetensors")
    else:
        transitions, ref = one_process_freezing(_cfg(n_micro=2), byte_data, ITERS)
        assert transitions == [(0, 1, 4), (1, 2, 6)]
    worst = max((final[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < 1e-4, f"swarm and one process differ by {worst:.3g}"
    start = resume_point(run / "checkpoints" / "step-00000004")
    assert CheckpointReader(run / "checkpoints" / "step-00000004").state["elastic"]["pending"] == 1
    res2 = launch(_job(cfg, byte_data, tmp_path / "resumed", resume=start), timeout_s=300)
    ref_loss = {r["step"]: r["loss"] for r in res.phase_iterations("p")}
    assert [(r["step"], r["loss"]) for r in res2.phase_iterations("p")] == \
        [(s, ref_loss[s]) for s in range(5, ITERS + 1)]


def test_skiptrain_train_freezes_as_a_swarm_of_one_node(byte_data, tmp_path):
    """``skiptrain train`` with freezing on and one process is the swarm's freezing on one node
    that serves every stage, with the one-process run's ``train.n_micro`` micro-batches: its run
    directory is a swarm's, its first transition makes the model one stage and moves nothing,
    and it ends where one process freezing the same way ends."""
    from skiptrain.cli import main
    from skiptrain.config import save_toml

    cfg = _cfg(runtime={"nodes": 0, "stage_sizes": ""}, n_micro=4)      # (runtime.mb_per_originator 2)
    save_toml(cfg, tmp_path / "cfg.toml")
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "cfg.toml"), "--data", str(byte_data), "--out", str(run),
                 "--quiet"]) == 0
    job = json.loads((run / "job.json").read_text())
    assert json.loads(json.dumps(job["config"]["runtime"]))["node_stages"] == "0+1+2+3"
    tr = [r for r in _log(run) if r.get("action") == "transition"]
    assert [(t["frozen_after"], t["step"], t["placement"], t["transfer_messages"]) for t in tr] == \
        [(1, 4, [[0]], 0), (2, 6, [[0]], 0)]
    transitions, ref = one_process_freezing(_cfg(n_micro=4), byte_data, ITERS)
    assert transitions == [(0, 1, 4), (1, 2, 6)]
    final = load_weights(run / "model.safetensors")
    worst = max((final[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < 1e-4, f"skiptrain train and one process differ by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "demo"])
def test_an_undo_after_a_one_stage_layout_gives_the_pipeline_back_its_memory_credits(byte_data, tmp_path,
                                                                                      strategy):
    """4 nodes, 2 stages, the cache on: both freezable layers freeze at step 4 and, the prefix
    cached, AutoPipe picks one stage of 4 replicas (its schedule holds one credit: one
    micro-batch per originator).  Every replica's last feed-forward weight is then pushed off
    (the same on all, so they stay identical), the guard sees the validation loss jump and
    undoes the freeze at step 6: the 2-stage layout it goes back to
    has the phase's 3 credits again, not the one-stage layout's 1, and every sample is trained
    once.  Under DeMo the layers trainable again had no sync state while frozen: theirs starts
    afresh (zero momentum) on every replica, which stay bit-identical."""
    from skiptrain.runtime.faults import faulty_job

    cfg = _cfg(runtime={"nodes": 4, "stage_sizes": "2,2"})
    cfg.dp.strategy = strategy
    cfg.model.n_stages = 2
    cfg.elastic.alpha, cfg.elastic.guard_tol = 1.0, 0.0
    cfg.elastic.cache, cfg.elastic.prefill_min_gain, cfg.elastic.prefill_hold = "on", 0, 0
    run = tmp_path / "run"
    faults = [{"node": n, "kind": "diverge", "iteration": 5, "tensor": "layers.3.ffn.w2.weight", "by": 1.0}
              for n in range(4)]
    launch(_job(cfg, byte_data, run, **faulty_job(faults)), timeout_s=300)
    tr = [r for r in _log(run) if r.get("action") == "transition"]
    assert [(t["step"], t["frozen_after"], t["counts"], t["memory"]) for t in tr] == [(4, 2, [4], 1),
                                                                                     (6, 0, [2, 2], 3)]
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * GB))
    params = _node_params(run)
    for stage in {s for s, _ in params.values()}:
        reps = [p for s, p in params.values() if s == stage]
        assert len(reps) == 2 and all(torch.equal(reps[0][k], reps[1][k]) for k in reps[0])


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["off", "on"])
def test_a_checkpoint_after_a_transition_resumes_into_the_transitioned_layout(byte_data, tmp_path, cache):
    """The checkpoint after iteration 6 holds the 3-stage layout of the first freeze and the
    second freeze still pending: a job resumed from it rebuilds that layout, applies the pending
    transition at its first iteration and ends with the uninterrupted run's weights, losses,
    decisions and final layout.  With the activation cache on, the resumed job's originators
    (a new run directory: empty caches) prefill their share before their first step."""
    iters = 8
    ref = tmp_path / "ref"
    cfg = _cfg()
    cfg.elastic.cache = cache
    cfg.elastic.prefill_min_gain = 0     # prefill at every freeze, though each window is read once here
    cfg.elastic.prefill_hold = 0
    res = launch(_job(cfg, byte_data, ref, iterations=iters), timeout_s=300)
    ckpt = shutil.copytree(ref / "checkpoints" / "step-00000006", tmp_path / "saved" / "step-00000006")
    saved = CheckpointReader(ckpt).state["elastic"]
    assert saved["frozen"] == 1 and saved["pending"] == 2 and len(saved["counts"]) < 4
    start = resume_point(ckpt)
    assert start["iteration"] == 6 and start["cursor"] == 6 * GB
    run = tmp_path / "run"
    res2 = launch(_job(cfg, byte_data, run, iterations=iters, resume=start), timeout_s=300)
    ref_loss = {r["step"]: r["loss"] for r in res.phase_iterations("p")}
    assert [(r["step"], r["loss"]) for r in res2.phase_iterations("p")] == [(s, ref_loss[s]) for s in (7, 8)]
    a, b = load_weights(ref / "model.safetensors"), load_weights(run / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run differs from the uninterrupted one by {worst:.3g}"
    tr_ref = [r for r in _log(ref) if r.get("action") == "transition"]
    tr_run = [r for r in _log(run) if r.get("action") == "transition"]
    assert [(t["step"], t["frozen_after"], t["placement"]) for t in tr_run] == \
        [(t["step"], t["frozen_after"], t["placement"]) for t in tr_ref if t["step"] >= 6]
    stages = {r: s for r, (s, _) in _node_params(ref).items()}
    assert {r: s for r, (s, _) in _node_params(run).items()} == stages
    if cache == "on":
        pre = [(r["step"], r["frozen"]) for r in _log(run) if r.get("action") == "prefill"]
        assert pre == [(6, 2)] and saved["prefix_cached"]


@pytest.mark.slow
def test_a_node_killed_mid_transition_is_recovered_and_training_goes_on(byte_data, tmp_path):
    """Recovery mode: a replica of a body stage is SIGKILLed inside the first transition (after
    the plan, before its messages): the survivors abandon the transition, re-form without it,
    plan the transition again over the five of them and train to the end; every sample is
    trained once and the replicas of every final stage are bit-identical."""
    from skiptrain.runtime.faults import faulty_job

    cfg = _cfg(runtime={"recover": True, "heartbeat_s": 0.2, "heartbeat_deadline_s": 4.0})
    probe = _job(cfg, byte_data, tmp_path / "probe")
    victim = max(probe.phases[0].schedule["placement"][1])
    run = tmp_path / "run"
    res = launch(_job(cfg, byte_data, run, **faulty_job({"node": victim, "kind": "kill", "iteration": 4,
                                                         "where": "transition"})), timeout_s=300)
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1)) and rows[-1]["nodes"] == 5
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    assert [r["node"] for r in rec] == [victim] and "died" in rec[0]["cause"]
    tr = [r for r in _log(run) if r.get("action") == "transition"]
    assert [(t["frozen_after"], t["step"]) for t in tr] == [(1, 4), (2, 6)]
    assert all(victim not in p for t in tr for p in t["placement"])
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(per_it) == list(range(ITERS))
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * GB))
    by_stage: dict[int, list[dict]] = {}
    for r, (s, p) in _node_params(run).items():
        if s is not None and r != victim:
            by_stage.setdefault(s, []).append(p)
    for s, reps in by_stage.items():
        assert all(torch.equal(p[k], reps[0][k]) for p in reps[1:] for k in p), f"stage {s} replicas differ"
    # the merged model is the trained one (no stage of the start layout counts as lost)
    merged = load_weights(run / "model.safetensors")
    trained = {k: v for reps in by_stage.values() for k, v in reps[0].items()}
    assert merged.keys() == trained.keys() and all(torch.equal(merged[k], trained[k]) for k in merged)
    assert not (run / "lost_stages.json").exists()


@pytest.mark.slow
def test_the_swarm_serves_the_frozen_prefix_from_prefilled_caches(byte_data, tmp_path):
    """``elastic.cache=on`` in the swarm: at each freeze the originators prefill the windows they
    will start (data parallel, each window computed once, rows sent between caches), so after the prefill every
    lookup hits; the run trains what one process freezing the same way trains (same
    decisions; weights within 1e-4: the swarm averages the replicas' gradients, the single
    process sums the whole batch, a float-order difference), replicas bit-identical, every sample
    once."""
    cfg = _cfg()
    cfg.elastic.cache = "on"
    cfg.elastic.prefill_min_gain = 0     # prefill at every freeze, though each window is read once here
    cfg.elastic.prefill_hold = 0
    run = tmp_path / "run"
    launch(_job(cfg, byte_data, run), timeout_s=300)
    log = _log(run)
    tr = [r for r in log if r.get("action") == "transition"]
    assert [(t["frozen_after"], t["step"], t["prefix_cached"]) for t in tr] == [(1, 4, True), (2, 6, True)]
    pre = [r for r in log if r.get("action") == "prefill"]
    assert [(p["step"], p["frozen"]) for p in pre] == [(4, 1), (6, 2)]
    # the first prefill computes each originator's windows of iterations 4..9 (one layer each);
    # the second extends every window by one layer where it is held, and a window an originator
    # newly starts arrives from the cache that extended it instead of running both layers
    # (originators keep their micro-batches where an even deal allows: 3 of 4 here)
    assert pre[0]["rows"] == pre[0]["layer_rows"] == (ITERS - 4) * GB and pre[0]["received_rows"] == 0
    assert pre[1]["rows"] == pre[1]["layer_rows"] == (ITERS - 6) * GB
    assert pre[1]["received_rows"] == (ITERS - 6) * GB // 4
    caches = {}
    for f in (run / "phases" / "p").glob("node*.json"):
        rec = json.loads(f.read_text())
        if "cache" in rec:
            caches[rec["rank"]] = rec["cache"]
    assert caches and all(c["misses"] == 0 and c["extended"] == 0 for c in caches.values())
    assert sum(c["hits"] for c in caches.values()) == (ITERS - 4) * GB     # every frozen-prefix lookup hit
    live = load_live_records(run, "p")                                        # (what the dashboard shows)
    assert sum(r["totals"].get("cache_hits", 0) for r in live) == (ITERS - 4) * GB
    _assert_trains_what_the_cached_trainer_trains(run, tmp_path, byte_data)


@pytest.mark.slow
def test_the_prefill_gate_weighs_modelled_seconds_saved_against_the_prefill(byte_data, tmp_path):
    """``elastic.prefill_min_gain``: at each freeze the layout is planned with the prefix cached
    and recomputed, and the transition logs the gain (simulated seconds saved until the end of
    the phase over the prefill's).  With the gate at 0 both freezes are prefilled; with the gate
    just above the first freeze's gain that layout is planned with the prefix recomputed,
    nothing is prefilled then, the cache fills lazily, and every sample is still trained once."""
    gains = {}
    for name, gate in (("open", 0.0), ("shut", None)):
        cfg = _cfg()
        cfg.elastic.cache = "on"
        cfg.elastic.prefill_min_gain = gate if gate is not None else gains["open"][0] * 1.01
        cfg.elastic.prefill_hold = 0
        run = tmp_path / name
        launch(_job(cfg, byte_data, run), timeout_s=300)
        log = _log(run)
        tr = [r for r in log if r.get("action") == "transition"]
        gains[name] = [t["prefill_gain"] for t in tr]
        pre = [r["step"] for r in log if r.get("action") == "prefill"]
        cached = [t["step"] for t in tr if t["prefix_cached"]]
        assert all(g is not None and g > 0 for g in gains[name])
        if gate == 0.0:
            assert [t["step"] for t in tr] == [4, 6] and cached == pre == [4, 6]
        else:
            assert 4 not in cached and 4 not in pre and cached == pre
            caches = [json.loads(f.read_text()).get("cache") for f in (run / "phases" / "p").glob("node*.json")]
            assert sum(c["misses"] for c in caches if c) > 0
        per_it = trained_samples(run / "phases" / "p")
        assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * GB))
    assert gains["shut"][0] == gains["open"][0]     # the same state at the first freeze, the same gain


@pytest.mark.slow
def test_originators_of_one_location_share_a_cache_and_prefill_each_window_once(byte_data, tmp_path):
    """``elastic.cache_share=location`` (the cluster topology: one location): the originators
    open one cache and prefill disjoint parts of the union of their windows, so every window is
    computed once at the first freeze and extended once at the second (a window that moved to
    another originator is not recomputed); every lookup then hits; the run trains what the
    one process freezing the same way trains."""
    cfg = _cfg()
    cfg.elastic.cache = "on"
    cfg.elastic.prefill_min_gain = 0     # prefill at every freeze, though each window is read once here
    cfg.elastic.prefill_hold = 0
    cfg.elastic.cache_share = "location"
    run = tmp_path / "run"
    launch(_job(cfg, byte_data, run), timeout_s=300)
    log = _log(run)
    pre = [r for r in log if r.get("action") == "prefill"]
    assert [(p["step"], p["frozen"]) for p in pre] == [(4, 1), (6, 2)]
    dirs = sorted((run / "elastic_cache").iterdir())
    assert [d.name for d in dirs] == ["loc-" + "".join(c if c.isalnum() else "_" for c in
                                                       build_topology(cfg, 6).nodes[0].location)]
    tags = np.fromfile(dirs[0] / "tags.i64", dtype=np.int64).reshape(-1, 3)
    held = tags[tags[:, 0] >= 0]
    # every window of iterations 4..9 computed once (one layer); those of 6..9 extended once
    assert pre[0]["rows"] == pre[0]["layer_rows"] == len(held)
    assert pre[1]["rows"] == pre[1]["layer_rows"] == int((held[:, 1] == 2).sum())
    caches = [json.loads(f.read_text()).get("cache") for f in (run / "phases" / "p").glob("node*.json")]
    caches = [c for c in caches if c]
    assert caches and all(c["misses"] == 0 and c["extended"] == 0 for c in caches)
    assert sum(c["hits"] for c in caches) == (ITERS - 4) * GB
    _assert_trains_what_the_cached_trainer_trains(run, tmp_path, byte_data)


@pytest.mark.slow
def test_a_prefill_waits_until_the_depth_held_a_window_and_resumes_with_it_pending(byte_data, tmp_path):
    """``elastic.prefill_hold=1``: the freezes at steps 4 and 6 recompute the prefix (no prefill:
    the depth at step 4 lasts one window); once depth 2 has held a window, the layout is planned
    again with the prefix cached (AutoPipe then needs fewer stages: the state moves) and the
    prefill runs at step 8, after which every lookup hits.  The run trains what the
    one process freezing the same way trains.  The checkpoint after iteration 8 holds
    the cache-in still pending: a job resumed from it prefills at its first iteration and ends
    with the uninterrupted run's weights and losses."""
    cfg = _cfg()
    cfg.elastic.cache, cfg.elastic.prefill_min_gain, cfg.elastic.prefill_hold = "on", 0, 1
    ref = tmp_path / "ref"
    res = launch(_job(cfg, byte_data, ref), timeout_s=300)
    log = _log(ref)
    tr = [r for r in log if r.get("action") == "transition"]
    assert [(t["step"], t["frozen_before"], t["frozen_after"], t["prefix_cached"]) for t in tr] == \
        [(4, 0, 1, False), (6, 1, 2, False), (8, 2, 2, True)]
    # AutoPipe takes the prefix off stage 0 once it is cached: 3 stages -> 2, state moved by name
    assert (tr[1]["counts"], tr[2]["counts"]) == ([2, 1, 1], [3, 1]) and tr[2]["transfer_bytes"] > 0
    pre = [r for r in log if r.get("action") == "prefill"]
    assert [(p["step"], p["frozen"]) for p in pre] == [(8, 2)]
    caches = [json.loads(f.read_text()).get("cache") for f in (ref / "phases" / "p").glob("node*.json")]
    caches = [c for c in caches if c]
    assert sum(c["hits"] for c in caches) >= (ITERS - 8) * GB      # iterations 8, 9: every lookup hits
    _assert_trains_what_the_cached_trainer_trains(ref, tmp_path, byte_data)

    ckpt = shutil.copytree(ref / "checkpoints" / "step-00000008", tmp_path / "saved" / "step-00000008")
    saved = CheckpointReader(ckpt).state["elastic"]
    assert saved["frozen"] == 2 and saved["pending_cache"] and not saved["prefix_cached"]
    run = tmp_path / "run"
    res2 = launch(_job(cfg, byte_data, run, resume=resume_point(ckpt)), timeout_s=300)
    ref_loss = {r["step"]: r["loss"] for r in res.phase_iterations("p")}
    assert [(r["step"], r["loss"]) for r in res2.phase_iterations("p")] == [(s, ref_loss[s]) for s in (9, 10)]
    assert [(r["step"], r["frozen"]) for r in _log(run) if r.get("action") == "prefill"] == [(8, 2)]
    a, b = load_weights(ref / "model.safetensors"), load_weights(run / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.slow
def test_a_cache_in_that_keeps_the_layout_moves_nothing_and_every_lookup_then_hits(byte_data, tmp_path):
    """One stage of 4 replicas (plain data parallelism), both freezable layers frozen at step 4,
    the prefix recomputed for a window, then cached in place at step 6 (AutoPipe keeps the one
    stage): no state moves, only the cost model and the prefill change; afterwards every lookup
    hits, every sample is trained once and the replicas stay bit-identical."""
    cfg = _cfg(runtime={"nodes": 4, "stage_sizes": "4"})
    cfg.model.n_stages = 1
    cfg.elastic.alpha = 1.0
    cfg.elastic.cache, cfg.elastic.prefill_min_gain, cfg.elastic.prefill_hold = "on", 0, 1
    run = tmp_path / "run"
    launch(_job(cfg, byte_data, run), timeout_s=300)
    log = _log(run)
    tr = [r for r in log if r.get("action") == "transition"]
    assert [(t["step"], t["frozen_after"], t["counts"], t["prefix_cached"]) for t in tr] == \
        [(4, 2, [4], False), (6, 2, [4], True)]
    assert tr[1]["move_s"] == 0.0 and tr[1]["transfer_messages"] == 0 and tr[1]["placement"] == tr[0]["placement"]
    assert [(p["step"], p["frozen"]) for p in log if p.get("action") == "prefill"] == [(6, 2)]
    caches = [json.loads(f.read_text()).get("cache") for f in (run / "phases" / "p").glob("node*.json")]
    gb = 4 * 2 * 8                       # 4 originators x 2 micro-batches x micro_batch 8
    assert sum(c["hits"] for c in caches if c) >= (ITERS - 6) * gb
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * gb))
    reps = [p for _, p in _node_params(run).values()]
    assert len(reps) == 4 and all(torch.equal(p[k], reps[0][k]) for p in reps[1:] for k in p)


def _assert_trains_what_the_cached_trainer_trains(run: Path, tmp_path: Path, byte_data: Path) -> None:
    """Every sample once, replicas bit-identical, and the final weights within 1e-4 of one
    process freezing the same way (same decisions at the same steps; the cache changes where
    the prefix's output comes from, not its value)."""
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * GB))
    by_stage: dict[int, list[dict]] = {}
    for r, (s, p) in _node_params(run).items():
        if s is not None:
            by_stage.setdefault(s, []).append(p)
    for s, reps in by_stage.items():
        assert all(torch.equal(p[k], reps[0][k]) for p in reps[1:] for k in p), f"stage {s} replicas differ"
    transitions, ref = one_process_freezing(_cfg(n_micro=4), byte_data, ITERS)
    assert [(after, step) for _, after, step in transitions] == [(1, 4), (2, 6)]
    final = load_weights(run / "model.safetensors")
    worst = max((final[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < 1e-4, f"swarm (cached) and one process differ by {worst:.3g}"


@pytest.mark.slow
def test_drift_re_planning_goes_on_after_a_transition(byte_data, tmp_path):
    """With drift re-planning on, the monitor follows each freeze transition (the new layout's
    placement and cost model): rank 0 still checks the measured iteration time against the
    simulated one after the pipeline has shrunk (a threshold of ~0 makes every check re-plan; a
    cost model with next to no compute keeps the measured time above the simulated one, whatever
    the machine's load)."""
    run = tmp_path / "run"
    launch(_job(_cfg(runtime={"drift_threshold": 1e-9}), byte_data, run, s_per_sample_layer=1e-6), timeout_s=300)
    tr = [r for r in _log(run) if r.get("action") == "transition"]
    assert [t["step"] for t in tr] == [4, 6]
    checks = [int(x.split("iteration ", 1)[1].split(":", 1)[0])
              for x in (run / "logs" / "node0.log").read_text().splitlines() if "re-planned routes" in x]
    assert any(i > 6 for i in checks), f"drift checks at iterations {checks}: none after the last transition"


@pytest.mark.slow
def test_a_node_joins_a_freezing_job_after_its_transitions_and_trains_the_frozen_layout(byte_data, tmp_path):
    """Recovery mode, DeMo: after both freezes (iterations 4 and 6) a node joins with
    ``--join``: it gets the rule's state and the layout in force from the lowest node, builds its
    stage for that partition and frozen depth, takes a live replica's state and trains; its
    stage's replicas end bit-identical, every sample is trained once."""
    from skiptrain.runtime.faults import faulty_job
    from test_join import _joiner

    iters = 16
    # node 0 holds the job at iteration 8 until the joiner (node 6) is placed, so the join lands
    # mid-run however long the joiner takes to start (the peers wait within the 60 s timeout)
    cfg = _cfg(runtime={"recover": True, "heartbeat_s": 0.2, "heartbeat_deadline_s": 4.0, "timeout_s": 60},
               steps=iters)
    cfg.dp.strategy = "demo"
    run = tmp_path / "run"
    job = _job(cfg, byte_data, run, iterations=iters,
               **faulty_job({"node": 0, "kind": "hold", "iteration": 8, "key": "join/assign/6", "timeout_s": 50}))
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("res", launch(job, timeout_s=300)), daemon=True)
    th.start()
    deadline = time.time() + 120
    while time.time() < deadline and th.is_alive() and not any(
            r.get("action") == "transition" and r["frozen_after"] == 2 for r in _log_or_empty(run)):
        time.sleep(0.05)
    info = json.loads((run / "join.json").read_text())
    joiner = _joiner(run, info, Path(info["secret_file"]).read_text(), "joiner")
    th.join(timeout=300)
    joiner.wait(timeout=30)
    assert "res" in out, "the launch did not finish"
    assert joiner.returncode == 0, (run / "logs" / "joiner.log").read_text()[-2000:]
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    joined = [r for r in rec if r.get("join") and not r.get("refused")]
    assert len(joined) == 1, rec
    j = joined[0]["node"]
    nj = json.loads((run / "phases" / "p" / f"node{j}.json").read_text())
    assert nj["joined"]["iteration"] > 6 and nj["stage"] is not None
    assert all(e["n_processed"] > 0 for e in nj["iterations"])
    params = _node_params(run)
    mates = [r for r, (s, _) in params.items() if s == nj["stage"] and r != j]
    assert mates and all(torch.equal(params[j][1][k], params[mates[0]][1][k]) for k in params[j][1])
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(i for s in per_it.values() for i in s) == list(range(iters * GB))


def _log_or_empty(run: Path) -> list[dict]:
    try:
        return _log(run)
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_a_freezing_demo_job_saved_after_a_failure_resumes_on_all_its_nodes(byte_data, tmp_path):
    """Recovery mode, DeMo: a body replica is SIGKILLed after both freezes; the checkpoint after
    it holds a layout without that node.  The job resumed from it with all six nodes seats the
    saved layout on them (the node left over becomes a replica), trains to the end, and no
    sample is lost or repeated over both launches."""
    from skiptrain.runtime.faults import faulty_job

    cfg = _cfg(runtime={"recover": True, "heartbeat_s": 0.2, "heartbeat_deadline_s": 4.0})
    cfg.dp.strategy = "demo"
    probe = _job(cfg, byte_data, tmp_path / "probe")
    victim = max(probe.phases[0].schedule["placement"][1])
    run = tmp_path / "run"
    launch(_job(cfg, byte_data, run, iterations=8, **faulty_job({"node": victim, "kind": "kill", "iteration": 7})),
           timeout_s=300)
    saved = CheckpointReader(run / "checkpoints" / "step-00000008").state
    assert saved["elastic"]["frozen"] == 2 and victim not in {n for p in saved["placement"] for n in p}
    start = resume_point(run / "checkpoints" / "step-00000008")
    res = launch(_job(cfg, byte_data, run, iterations=ITERS, resume=start), timeout_s=300)
    rows = res.phase_iterations("p")
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1))     # (1-8: the first launch's, kept)
    assert [r["nodes"] for r in rows[8:]] == [6, 6]
    stages = {r: s for r, (s, _) in _node_params(run).items()}
    assert stages[victim] is not None          # the node left over trains as a replica
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * GB))


@pytest.mark.slow
def test_a_demo_node_left_without_a_stage_takes_one_in_a_later_transition(byte_data, tmp_path):
    """5 nodes on 2 stages under DeMo: a transition that leaves a node over (``N // S``
    replicas per stage) and a later one that hands it a stage again.  The node had no sync
    strategy while idle; it builds the stage it is handed with the config's optimizer rule
    (DeMo's sign step), loads the state moved to it, and the run ends with every replica of a
    stage bit-identical and every sample trained once."""
    from skiptrain.runtime.faults import faulty_job

    cfg = _cfg(runtime={"nodes": 5, "stage_sizes": "2,3"})
    cfg.model.n_stages = 2
    cfg.dp.strategy = "demo"
    cfg.elastic.alpha, cfg.elastic.guard_tol = 1.0, 0.0
    cfg.elastic.cache, cfg.elastic.prefill_min_gain, cfg.elastic.prefill_hold = "on", 0, 0
    cfg.elastic.prefill_after_undo = 0
    run = tmp_path / "run"
    faults = [{"node": n, "kind": "diverge", "iteration": 5, "tensor": "layers.3.ffn.w2.weight", "by": 1.0}
              for n in range(5)]
    launch(_job(cfg, byte_data, run, iterations=14, **faulty_job(faults)), timeout_s=300)
    tr = [r for r in _log(run) if r.get("action") == "transition"]
    assert [(t["step"], t["frozen_after"], t["placement"]) for t in tr] == [
        (4, 2, [[0, 1, 2, 3, 4]]), (6, 0, [[2, 3], [0, 1]]), (12, 2, [[0, 1, 2, 3, 4]])]     # node 4 idle in 6-11
    per_it = trained_samples(run / "phases" / "p")
    assert sorted(i for s in per_it.values() for i in s) == list(range(14 * GB))
    params = _node_params(run)
    assert sorted(params) == [0, 1, 2, 3, 4] and {s for s, _ in params.values()} == {0}
    first = params[0][1]
    assert all(torch.equal(p[k], first[k]) for _, p in params.values() for k in first)
