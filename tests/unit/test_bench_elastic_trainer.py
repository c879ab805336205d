"""The elastic bench's one-process harness (bench/_elastic_trainer.py), planning for 8 emulated
nodes: transitions in training, cache on == off, exact resume after a transition."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch

from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.config import build_config
from skiptrain.data.dataset import TokenDataset
from bench._elastic_trainer import ElasticTrainer

Elastic = functools.partial(ElasticTrainer, n_nodes=8)


def _cfg(data, cache="on", steps=24, **ckpt):
    # tol huge: the gradient signal always agrees, so the alpha bound alone sets the schedule
    # (windows of 4 steps, freezing from window 2: 2 layers at step 8, 3 at step 12; no learning-
    # rate warm-up, so the guard's reference points start at step 4).
    return build_config("tiny", overrides={
        "data": {"path": str(data)},
        "model": {"n_layers": 5, "n_stages": 4, "stage0_layers": -1},
        "train": {"steps": steps, "eval_every": 0, "progress": False, "n_micro": 2, "micro_batch": 4,
                  "warmup_steps": 0},
        "elastic": {"enabled": True, "check_every": 4, "tol": 1e9, "alpha": 0.5, "min_active": 1,
                    "start_window": 2, "stable_windows": 1, "guard": True, "guard_tol": 1.0, "cache": cache},
        "checkpoint": {"every": 6, "keep": 5, **ckpt}})


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_transitions_cache_and_sample_order(byte_data, tmp_path):
    tr = Elastic(_cfg(byte_data, steps=16), tmp_path / "on")
    seen = []
    next_batch = tr.loader.next_batch

    def spy():
        seen.extend(tr.loader.indices())
        return next_batch()

    tr.loader.next_batch = spy
    tr.fit()
    # no sample repeated or skipped across the transitions
    assert seen == list(range(16 * 8))
    frozen = [l.frozen for l in tr.layouts]
    assert frozen == [0, 2, 3, 4]
    assert [l.step for l in tr.layouts] == [0, 8, 12, 16]
    assert all(sum(l.counts) == 5 and l.counts[0] >= l.frozen for l in tr.layouts)
    assert all(l.replicas * l.n_stages <= 8 for l in tr.layouts)
    assert tr.layouts[-1].n_stages < tr.layouts[0].n_stages and tr.layouts[-1].replicas > 1
    assert tr.model.partition.to_list() == tr.layouts[-1].counts   # the trainer runs the layout in force
    # frozen layers did not change after they froze: every cache entry (written with the
    # weights of its time, fingerprinted) is still valid at the end
    st = tr.cache.stats()
    assert st["misses"] > 0 and st["entries"] == st["writes"] - st["extended"] > 0
    assert tr.runner.set_frozen(tr.frozen) == 0
    logged = [json.loads(l) for l in (tmp_path / "on" / "elastic.jsonl").read_text().splitlines()]
    assert [r["action"] for r in logged] == ["warmup", "freeze", "freeze", "freeze"]
    assert all("changes" in r and "transition" in r for r in logged[1:])
    # the cache changes nothing: the same run without it has bit-identical losses and weights
    off = Elastic(_cfg(byte_data, cache="off", steps=16), tmp_path / "off")
    off.fit()
    assert _losses(tmp_path / "on") == _losses(tmp_path / "off")
    for (n, a), (_, b) in zip(tr.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), n
    assert all(set(r) <= set(range(1, tr.layouts[-1].n_stages)) for r in tr.train_step().routes)


def test_resume_after_a_transition_reproduces_the_run(byte_data, tmp_path):
    full = Elastic(_cfg(byte_data), tmp_path / "full")
    full.fit()
    ref = _losses(tmp_path / "full")
    assert sorted(ref) == list(range(1, 25))

    part = Elastic(_cfg(byte_data, final=False), tmp_path / "part")
    part.fit(steps=16)  # killed at 16: latest checkpoint step 12, right at a transition
    st = CheckpointReader(tmp_path / "part" / "checkpoints").state
    assert st["step"] == 12 and st["freeze"]["frozen_layers"] == 3
    assert len(st["freeze"]["layouts"]) == 3 and st["freeze"]["cache"]["entries"] > 0

    # a run cannot take such a checkpoint over (it freezes in the runtime, whose state differs)
    from skiptrain.checkpoint.format import CheckpointError
    from skiptrain.runtime.job_checkpoint import resume_point
    with pytest.raises(CheckpointError, match="one-process elastic trainer of an earlier version"):
        resume_point(tmp_path / "part" / "checkpoints")
    again = Elastic(_cfg(byte_data), tmp_path / "part")
    again.resume()
    again.fit()
    assert _losses(tmp_path / "part") == ref
    got = CheckpointReader(tmp_path / "part" / "checkpoints").state["freeze"]
    want = CheckpointReader(tmp_path / "full" / "checkpoints").state["freeze"]
    assert got["rule"] == want["rule"]
    assert [l for l in got["layouts"]] == [l for l in want["layouts"]]
    logged = (tmp_path / "part" / "elastic.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in logged] == [4, 8, 12, 16, 20, 24]


def test_frozen_prefix_costs_no_backward_and_cache_hits_skip_its_forward(byte_data, tmp_path):
    # 2 layers freeze at step 8 (cache on); then every window is cached and revisited
    cfg = _cfg(byte_data, steps=40)
    cfg.elastic.prefill = False   # the cache fills one miss at a time
    tr = Elastic(cfg, tmp_path / "run", dataset=_forty_windows(cfg, byte_data))
    assert tr.train_src.n == 40
    tr.rule.alpha, tr.rule.min_active = 1.0, 3  # 2 layers freeze at step 8 and no more
    calls = {i: 0 for i in range(5)}
    grads_seen = {i: 0 for i in range(5)}
    for i in range(5):
        tr.model.layers[str(i)].register_forward_hook(lambda mod, inp, out, i=i: calls.__setitem__(i, calls[i] + 1))
    for _ in range(8):
        tr.train_step()
    assert tr.frozen == 2 and tr.runner.enabled
    for _ in range(100):                       # until every window is cached at depth 2
        if tr.cache.stats()["entries"] == tr.train_src.n:
            break
        tr.train_step()
    assert tr.cache.stats()["entries"] == tr.train_src.n and tr.frozen == 2
    while tr.step % 4:                          # 3 steps inside one window: no guard validation
        tr.train_step()
    for k in calls:
        calls[k] = 0
    hits0, misses0 = tr.cache.hits, tr.cache.misses
    for _ in range(3):
        tr.train_step()
        for i in range(5):
            grads_seen[i] += any(p.grad is not None for p in tr.model.layers[str(i)].parameters())
    assert tr.cache.hits - hits0 == 3 * 8 and tr.cache.misses == misses0
    # frozen layers: no forward (their output comes from the cache), never a gradient
    assert calls[0] == calls[1] == 0 and grads_seen[0] == grads_seen[1] == 0
    assert tr.model.tok_emb.weight.grad is None
    # active layers: forward per micro-batch, gradients every step
    assert all(calls[i] == 3 * 2 for i in (2, 3, 4)) and all(grads_seen[i] == 3 for i in (2, 3, 4))


def _forty_windows(cfg, data):
    ds = TokenDataset.open(data)
    full = ds.tokens  # the training text cut to 40 windows, so that windows come back soon
    ds.tokens = lambda split: full(split)[:40 * cfg.model.seq_len + 1] if split == "train" else full(split)
    return ds


def test_prefill_at_a_freeze_then_every_step_hits_and_the_run_is_unchanged(byte_data, tmp_path):
    runs = {}
    for name, cache, prefill in (("prefill", "on", True), ("lazy", "on", False), ("off", "off", True)):
        cfg = _cfg(byte_data, cache=cache, steps=24, every=0)
        cfg.elastic.prefill = prefill
        tr = Elastic(cfg, tmp_path / name, dataset=_forty_windows(cfg, byte_data))
        tr.fit()
        runs[name] = tr
    pre, lazy = runs["prefill"], runs["lazy"]
    # the first freeze (step 8) filled all 40 windows; later freezes extended them; no step missed
    first = pre.transitions[0]
    assert first["step"] == 8 and first["prefill"]["rows"] == 40 and first["expected_hit"] == 1.0
    assert first["autopipe"]["prefix_cached"] and first["prefill"]["cpu_s"] >= 0
    assert [t["prefill"]["layer_rows"] for t in pre.transitions] == [40 * 2, 40 * 1, 40 * 1]
    assert pre.cache.misses == 0 and pre.cache.extended == 0 and pre.cache.hits == 16 * 8
    assert lazy.cache.misses > 0 and "prefill" not in lazy.transitions[0]
    assert not lazy.transitions[0]["autopipe"]["prefix_cached"]
    # same losses and weights, bit for bit, whichever way the prefix was obtained
    assert _losses(tmp_path / "prefill") == _losses(tmp_path / "lazy") == _losses(tmp_path / "off")
    for (n, a), (_, b) in zip(pre.model.named_parameters(), runs["off"].model.named_parameters()):
        assert torch.equal(a, b), n


def test_no_prefill_while_freezing_is_unsettled(byte_data, tmp_path):
    # an undo at step 4 (as the guard would log it): the freeze at step 8 is within
    # prefill_after_undo windows of it, so the cache fills lazily; with 0 windows it prefills
    for quiet, prefilled in ((4, False), (0, True)):
        cfg = _cfg(byte_data, steps=16, every=0)   # 1.6 visits per window left at step 8
        cfg.elastic.prefill_after_undo = quiet
        tr = Elastic(cfg, tmp_path / f"q{quiet}", dataset=_forty_windows(cfg, byte_data))
        tr.rule.history.append({"step": 4, "action": "undo"})
        tr.fit()
        rec = tr.transitions[0]
        assert rec["step"] == 8 and rec["prefill_settled"] is prefilled and ("prefill" in rec) is prefilled
        assert rec["autopipe"]["prefix_cached"] is prefilled and tr.runner.enabled
        assert (tr.cache.misses > 0) is not prefilled


def test_resume_refills_a_prefilled_cache_and_continues_exactly(byte_data, tmp_path):
    cfg = _cfg(byte_data, steps=24)
    full = Elastic(cfg, tmp_path / "full", dataset=_forty_windows(cfg, byte_data))
    full.fit()
    cfg = _cfg(byte_data, steps=24, final=False)
    part = Elastic(cfg, tmp_path / "part", dataset=_forty_windows(cfg, byte_data))
    part.fit(steps=16)  # killed at 16; the step-16 freeze extended every entry past the step-12 checkpoint
    again = Elastic(cfg, tmp_path / "part", dataset=_forty_windows(cfg, byte_data))
    again.resume()
    assert again.step == 12 and again.frozen == 3
    # the entries were one layer too deep for the checkpoint: dropped, and refilled at once
    assert again.resume_prefill["rows"] == 40 and again.runner.complete()
    assert again.cache.misses == full.cache.misses == 0
    again.fit()
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")
    st, want = again.cache.stats(), full.cache.stats()
    assert (st["hits"], st["misses"], st["extended"]) == (want["hits"], want["misses"], want["extended"])
    assert [t["prefill"]["layer_rows"] for t in again.transitions] == [t["prefill"]["layer_rows"]
                                                                       for t in full.transitions]
    assert [t["counts"] for t in again.transitions] == [t["counts"] for t in full.transitions]


def test_a_prefill_is_timed_apart_from_its_transition(byte_data, tmp_path, monkeypatch):
    cfg = _cfg(byte_data, steps=16, every=0)   # the freeze at step 8 prefills (1.6 visits per window left)
    tr = Elastic(cfg, tmp_path / "t", dataset=_forty_windows(cfg, byte_data))
    real = tr.runner.prefill

    def slow_prefill(*a, **k):
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.5:   # CPU work, not a sleep
            pass
        return real(*a, **k)

    monkeypatch.setattr(tr.runner, "prefill", slow_prefill)
    tr.fit()
    rec = tr.transitions[0]
    assert rec["prefill"]["cpu_s"] >= 0.5 and rec["prefill"]["seconds"] >= 0.5
    assert rec["cpu_s"] < 0.25 and rec["seconds"] < rec["prefill"]["seconds"]


def test_guard_keeps_the_frozen_prefix_of_its_windows_and_equals_evaluate(byte_data, tmp_path):
    from skiptrain.runtime.evaluate import evaluate
    tr = Elastic(_cfg(byte_data, steps=16, every=0), tmp_path / "g")
    for _ in range(8):
        tr.train_step()
    assert tr.frozen == 2
    e, t = tr.cfg.elastic, tr.cfg.train
    calls = {i: 0 for i in range(5)}
    for i in range(5):
        tr.model.layers[str(i)].register_forward_hook(lambda mod, inp, out, i=i: calls.__setitem__(i, calls[i] + 1))
    ref = evaluate(tr.model, tr.val_src, e.guard_batches, t.micro_batch)
    assert tr._guard_val() == ref                          # bit for bit; computes and keeps the prefix
    for k in calls:
        calls[k] = 0
    assert tr._guard_val() == ref                          # the next check: the kept prefix, same value
    assert calls[0] == calls[1] == 0 and calls[2] == e.guard_batches
    # a changed prefix (an undo lets it train) is recomputed, not read stale
    with torch.no_grad():
        tr.model.layers["0"].attn.wq.weight.mul_(1.5)
    tr.runner.set_frozen(tr.frozen)
    ref2 = evaluate(tr.model, tr.val_src, e.guard_batches, t.micro_batch)
    assert tr._guard_val() == ref2 != ref


def test_before_any_freeze_the_elastic_trainer_is_the_trainer_bit_for_bit(byte_data, tmp_path):
    from skiptrain.train.trainer import Trainer
    cfg = _cfg(byte_data, steps=8, every=0)
    cfg.elastic.start_window = 100              # windows close (rule, guard) but nothing freezes
    el = Elastic(cfg, tmp_path / "el")
    plain = Trainer(_cfg(byte_data, steps=8, every=0), tmp_path / "plain")
    for _ in range(8):
        a, b = el.train_step(), plain.train_step()
        assert (a.loss, a.grad_norm, a.routes) == (b.loss, b.grad_norm, b.routes)
    assert el.frozen == 0 and len(el.rule.history) == 2
    for (n, p), (_, q) in zip(el.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(p, q), n
