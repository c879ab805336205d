"""Elastic pipelining by freezing: freeze rule, AutoPipe, AutoDP transfers, AutoCache."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

from skiptrain.config import build_config
from skiptrain.data.loader import shard_indices
from skiptrain.elastic.cache import (ActivationCache, PrefixRunner, at_depth, expected_hit, measure,
                                    worth_it)
from skiptrain.elastic.freeze import FreezeRule
from skiptrain.elastic.freezer import Freezer, layer_sq_norms
from skiptrain.elastic.prefill import plan_prefill
from skiptrain.elastic.repartition import autopipe, iteration_units, layer_compute, stage_memory
from skiptrain.checkpoint.wire import pack_state, unpack_state
from skiptrain.elastic.replicas import assign_nodes
from skiptrain.layout import Layout
from skiptrain.layout.transfer import transfer_plan
from skiptrain.model import StagedLM
from skiptrain.model.partition import Partition
from skiptrain.optim import build_adamw


# ---- freeze rule --------------------------------------------------------------------------


def _window(rule, step, norms, val=None):
    for _ in range(rule.check_every):
        rule.observe(norms)
    return rule.decide(step, None if val is None else (lambda: val))


def test_freeze_rule_gradient_prefix_bounded_by_alpha():
    rule = FreezeRule(8, alpha=0.5, check_every=2, tol=0.05, min_active=2, start_window=2, guard=False,
                      stable_windows=1)
    d = _window(rule, 2, {l: 1.0 for l in range(8)})
    assert d.action == "warmup" and rule.frozen == 0
    # layers 0-4 stable, layer 5 moved 50%: converged prefix is 0..4, bound ceil(0.5 * 6) = 3
    d = _window(rule, 4, {**{l: 1.01 for l in range(5)}, 5: 1.5, 6: 1.0, 7: 1.0})
    assert (d.candidate, d.bound, d.action, rule.frozen) == (5, 3, "freeze", 3)
    assert d.changes["5"] == pytest.approx(0.5, abs=1e-4) and "alpha bound" in d.reason
    # layer 3 now moves: nothing more freezes
    d = _window(rule, 6, {3: 2.0, 4: 1.01, 5: 1.5, 6: 1.0, 7: 1.0})
    assert d.action == "hold" and rule.frozen == 3
    # everything stable: bound 3 + ceil(0.5 * 3) = 5; min_active keeps the top 2
    d = _window(rule, 8, {3: 2.0, 4: 1.01, 5: 1.5, 6: 1.0, 7: 1.0})
    assert (d.bound, rule.frozen) == (5, 5)
    _window(rule, 10, {5: 1.5, 6: 1.0, 7: 1.0})
    assert rule.frozen == 6
    assert _window(rule, 12, {6: 1.0, 7: 1.0}).action == "max"


def test_freeze_rule_needs_a_stable_streak():
    rule = FreezeRule(4, alpha=1.0, check_every=1, tol=0.05, min_active=1, start_window=1, guard=False,
                      stable_windows=3)
    seq = [1.0, 1.01, 1.5, 1.51, 1.52, 1.53]   # layer 0: calm, jump, then calm for 3 windows
    acts = [_window(rule, s + 1, {0: g, 1: 9.0 * (s + 1), 2: 1.0, 3: 1.0}).action for s, g in enumerate(seq)]
    # window 2 is calm once (streak 1), the jump resets it, windows 4-6 rebuild it to 3
    assert acts == ["hold", "hold", "hold", "hold", "hold", "freeze"]
    assert rule.frozen == 1 and rule.history[-1]["stable"]["0"] == 3
    assert rule.history[1]["stable"]["0"] == 1 and rule.history[2]["stable"]["0"] == 0
    assert "needs 3" in rule.history[3]["reason"]


def test_freeze_guard_is_cumulative_against_the_unfrozen_projection():
    # a loss curve v = 4 - 0.5 ln(step) without freezing; every freeze costs 0.6% of loss on top
    rule = FreezeRule(6, alpha=0.25, check_every=10, tol=1.0, min_active=1, start_window=1, guard=True,
                      guard_tol=0.01, guard_delay=1, stable_windows=1, guard_ref=3)
    norms = {l: 1.0 for l in range(6)}
    import math

    def clean(step):
        return 4 - 0.5 * math.log(step)

    acts = []
    for w in range(1, 9):
        step = 10 * w
        # each freeze in force adds 0.6%: one alone passes the 1% guard, two do not
        cost = 1 + 0.006 * len(rule.freezes)
        acts.append(_window(rule, step, norms, val=clean(step) * cost).action)
    # windows 1-2: reference points (window 1 has no gradient history); window 2 freezes 2 layers
    # (bound ceil(0.25 * 5)); window 3 freezes 1 more (0.6% each: under tol alone, 1.2% together);
    # window 4 sees 1.2% > 1% above the projection -> undo the latest freeze, delay one window
    assert acts[:5] == ["hold", "freeze", "freeze", "undo", "delay"]
    h = rule.history
    assert h[3]["frozen_before"] == 3 and h[3]["frozen_after"] == 2 and "window 3" in h[3]["reason"]
    assert h[2]["projected"] == pytest.approx(clean(30), rel=1e-9)  # the fit recovers the clean curve
    assert rule.ref == [[10, clean(10)], [20, clean(20)]]  # only unfrozen points are references
    # a per-freeze guard (each freeze vs the loss just before it) would never have fired here
    assert all(h[i]["val_loss"] <= h[i - 1]["val_loss"] * 1.01 for i in range(1, 4))
    # the state is JSON and round-trips exactly
    import json
    clone = FreezeRule(6, alpha=0.25, check_every=10, tol=1.0, min_active=1, guard_ref=3)
    clone.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert clone.state_dict() == rule.state_dict()


def test_freeze_guard_waits_for_a_reference_and_undoes_step_by_step():
    rule = FreezeRule(6, alpha=1.0, check_every=1, tol=1.0, min_active=1, start_window=1, guard=True,
                      guard_tol=0.01, guard_delay=0, stable_windows=1, guard_ref=2)
    norms = {l: 1.0 for l in range(6)}
    assert _window(rule, 1, norms, val=3.0).action == "hold"       # no gradient history yet
    # gradients are stable, but only one reference point existed before this window's
    rule.ref.clear()
    d = _window(rule, 2, norms, val=2.9)
    assert d.action == "hold" and "reference" in d.reason and rule.ref == [[2, 2.9]]
    rule.alpha = 0.2
    assert _window(rule, 3, norms, val=2.85).action == "freeze" and rule.frozen == 1
    assert _window(rule, 4, norms, val=2.80).action == "freeze" and rule.frozen == 2
    # far above the projection twice: each window undoes one freeze, newest first
    d = _window(rule, 5, norms, val=3.5)
    assert (d.action, d.frozen_after) == ("undo", 1)
    d = _window(rule, 6, norms, val=3.5)
    assert (d.action, d.frozen_after) == ("undo", 0) and rule.freezes == []


def test_freeze_guard_reference_starts_after_the_warmup_and_waits_for_min_ref_points():
    import math

    def clean(step):
        return 4 - 0.5 * math.log(step)

    # the warm-up windows (steps <= 20) fall much faster than the trajectory after them: a fit
    # through them would project far too pessimistic a loss and never see a freeze's cost
    warm = {10: clean(10) + 0.5, 20: clean(20) + 0.2}
    rule = FreezeRule(6, alpha=0.2, check_every=10, tol=1.0, min_active=1, start_window=1, guard=True,
                      guard_tol=0.01, guard_delay=0, stable_windows=1, guard_ref=4, guard_min_ref=3,
                      ref_after=20)
    norms = {l: 1.0 for l in range(6)}
    acts = [_window(rule, s, norms, val=warm.get(s, clean(s))) for s in (10, 20, 30, 40, 50)]
    assert [d.action for d in acts] == ["hold", "hold", "hold", "hold", "freeze"]
    assert "2 of the 3" in acts[3].reason and "after step 20" in acts[3].reason
    assert rule.ref == [[30, clean(30)], [40, clean(40)], [50, clean(50)]]   # no warm-up points
    # nor is a warm-up window's validation pass run at all: nothing would use it
    assert [d.val_loss for d in acts[:3]] == [None, None, clean(30)]
    calls = []
    probe = FreezeRule(6, guard=True, check_every=1, start_window=1, ref_after=2)
    for s in (1, 2, 3):
        probe.observe(norms)
        probe.decide(s, lambda: calls.append(s) or 3.0)
    assert calls == [3]
    # the projection is the post-warm-up trajectory, so a 1.5% cost is seen and undone
    d = _window(rule, 60, norms, val=clean(60) * 1.015)
    assert d.projected == pytest.approx(clean(60), rel=1e-9) and d.action == "undo"
    with pytest.raises(ValueError, match="guard_min_ref"):
        FreezeRule(6, guard_min_ref=1)


def test_freeze_guard_confirm_ignores_a_one_window_blip_and_undoes_a_lasting_excess():
    import json
    rule = FreezeRule(6, alpha=0.2, check_every=1, tol=1.0, min_active=1, start_window=1, guard=True,
                      guard_tol=0.01, guard_delay=0, stable_windows=1, guard_ref=2, guard_confirm=2)
    norms = {l: 1.0 for l in range(6)}
    assert _window(rule, 1, norms, val=3.0).action == "hold"
    assert _window(rule, 2, norms, val=2.9).action == "freeze" and rule.frozen == 1
    # one window far above the projection: not yet an undo, but no freezing either
    d = _window(rule, 3, norms, val=3.5)
    assert (d.action, d.frozen_after, rule.above) == ("delay", 1, 1) and "1 of the 2" in d.reason
    # back under it: the blip is forgotten and freezing goes on
    d = _window(rule, 4, norms, val=2.5)
    assert d.action == "freeze" and rule.above == 0 and rule.frozen == 2
    # two windows in a row above it: the second undoes the newest freeze
    assert _window(rule, 5, norms, val=3.5).action == "delay"
    clone = FreezeRule(6, alpha=0.2, check_every=1, tol=1.0, min_active=1, start_window=1, guard=True,
                       guard_tol=0.01, guard_delay=0, stable_windows=1, guard_ref=2, guard_confirm=2)
    clone.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    for r in (rule, clone):   # the count of windows above survives a checkpoint
        d = _window(r, 6, norms, val=3.5)
        assert (d.action, d.frozen_before, d.frozen_after) == ("undo", 2, 1)
    with pytest.raises(ValueError, match="guard_confirm"):
        FreezeRule(6, guard_confirm=0)


def test_the_first_window_the_guard_does_not_doubt_is_found_in_the_history():
    """A window above the guard's projection that does not undo yet (guard_confirm 2) is a
    doubted one: the swarm puts a cache prefill for the depth off until the first window that
    is not (``first_undoubted``); the count is in each decision, so it survives a checkpoint."""
    import json
    rule = FreezeRule(6, alpha=0.2, check_every=1, tol=1.0, min_active=1, start_window=1, guard=True,
                      guard_tol=0.01, guard_delay=0, stable_windows=1, guard_ref=2, guard_confirm=2)
    norms = {l: 1.0 for l in range(6)}
    _window(rule, 1, norms, val=3.0)
    assert _window(rule, 2, norms, val=2.9).action == "freeze"
    assert rule.first_undoubted(2) == 2
    assert (_window(rule, 3, norms, val=3.5).above, rule.first_undoubted(3)) == (1, None)
    clone = FreezeRule(6, alpha=0.2, check_every=1, tol=1.0, min_active=1, start_window=1, guard=True,
                       guard_tol=0.01, guard_delay=0, stable_windows=1, guard_ref=2, guard_confirm=2)
    clone.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    for r in (rule, clone):
        assert _window(r, 4, norms, val=2.5).above == 0
        assert r.first_undoubted(3) == 4 and r.first_undoubted(5) is None


# ---- AutoPipe -----------------------------------------------------------------------------


def test_layer_norms_sum_each_layers_parameters_and_skip_the_rest():
    g = torch.Generator().manual_seed(0)
    updates = {"embed.weight": torch.randn(5, 3, generator=g), "layers.0.attn.wq.weight": torch.randn(3, 3, generator=g),
               "layers.0.mlp.w1.weight": torch.randn(4, 3, generator=g), "layers.11.norm.weight": torch.randn(3, generator=g)}
    ref = {0: float(updates["layers.0.attn.wq.weight"].pow(2).sum() + updates["layers.0.mlp.w1.weight"].pow(2).sum()),
           11: float(updates["layers.11.norm.weight"].pow(2).sum())}
    got = layer_sq_norms(updates)
    assert sorted(got) == [0, 11] and all(got[k] == pytest.approx(v, rel=1e-6) for k, v in ref.items())


def test_the_freezer_feeds_active_layers_and_answers_only_at_a_windows_end():
    cfg = build_config(preset="tiny", overrides=["elastic.enabled=true", "elastic.check_every=2", "elastic.guard=false",
                                                  "model.n_layers=4"])
    fr = Freezer(cfg)
    asked = []
    fr.observe({0: 4.0, 1: 9.0, 2: 16.0, 3: 1.0}, frozen=2)    # layers 0 and 1 are frozen: not fed
    assert fr.rule.sums[0] == 0 and fr.rule.sums[1] == 0 and fr.rule.sums[2] == 4.0 and fr.rule.sums[3] == 1.0
    assert fr.decide(1, lambda: asked.append(1) or 1.0) is None
    d = fr.decide(2, lambda: asked.append(2) or 1.0)
    assert d is not None and d.step == 2 and asked == []      # the guard is off: never asked
    cfg.elastic.guard = True
    guarded = Freezer(cfg)
    assert guarded.decide(2, None).val_loss is None           # a guard that cannot be measured: none asked


def test_autopipe_picks_the_fewest_stages_that_fit_the_start_memory():
    counts, ev = autopipe(16, 0, 8, 8, cached=False)
    assert len(counts) == 8 and sum(counts) == 16
    budget = ev["memory_budget"]
    assert [t["stages"] for t in ev["tried"]] == list(range(8, 0, -1))
    counts, ev = autopipe(16, 12, 8, 8, cached=True)
    assert sum(counts) == 16 and counts[0] >= 12  # the frozen prefix sits on stage 0
    assert max(stage_memory(counts, 12)) <= budget + 1e-9
    assert len(counts) < 8
    # exactly the candidates within the budget were scored, and none that fits has fewer stages
    # with an estimate as good (one node per current stage, one sample each)
    for t in ev["tried"]:
        assert t["fits"] == (t["max_memory"] <= budget + 1e-9) == (t["estimate"] is not None)
    best = min(t["estimate"] for t in ev["tried"] if t["fits"])
    assert all(t["estimate"] > best * 1.001 for t in ev["tried"] if t["fits"] and t["stages"] < len(counts))
    with_frozen = autopipe(16, 6, 8, 8, cached=False)[0]
    assert len(with_frozen) >= len(counts)


def test_autopipe_estimate_knows_the_nodes_and_an_undo_grows_the_pipeline_back():
    # 8 layers, 6 frozen and cached: at most 3 stages.  On 16 nodes 3 stages leave a node idle and
    # split 16 samples over 5 replicas; 2 stages x 8 replicas is faster and fits
    counts, ev = autopipe(8, 6, 4, 4, cached=True, stage0_compute=2.0, stage0_memory=1.0,
                          n_nodes=16, global_batch=16, n_micro=4)
    est = {t["stages"]: t["estimate"] for t in ev["tried"]}
    assert len(counts) == 2 and est[2] < est[3]
    assert iteration_units([1.0, 1.0], 16, 16, 4) == 3 * 1.0   # 8 replicas x 2 samples, M=2: 3 slots
    assert iteration_units([1.0, 1.0, 1.0], 16, 16, 4) == 6.0  # 5 replicas: 4 samples, M=4: 6 slots
    # a caller's own profile (seconds) decides instead of the estimate
    counts3, _ = autopipe(8, 6, 4, 4, cached=True, stage0_compute=2.0, stage0_memory=1.0,
                          seconds=lambda c: 1.0 if len(c) == 3 else 2.0)
    assert len(counts3) == 3
    # ... and with a profile each count's balanced split competes with its one-layer neighbours
    from skiptrain.elastic.repartition import neighbour_splits
    assert sorted(neighbour_splits([6, 1, 1], 6)) == []            # prefix stays, body stages keep a layer
    assert sorted(neighbour_splits([2, 3, 3], 1)) == [[1, 4, 3], [2, 2, 4], [2, 4, 2], [3, 2, 3]]
    shifted, ev3 = autopipe(8, 2, 4, 4, cached=False, stage0_compute=2.0, stage0_memory=1.0,
                            seconds=lambda c: 1.0 if c == [2, 3, 3] else 2.0)
    balanced = [t["counts"] for t in ev3["tried"] if t["stages"] == 3][0]
    assert shifted == [2, 3, 3] != balanced
    # an undo back to nothing frozen must return to a layout within the start memory: 2 stages
    # of 4 active layers do not fit, so the pipeline grows back
    counts0, ev0 = autopipe(8, 0, 4, len(counts), cached=False, stage0_compute=2.0, stage0_memory=1.0,
                            n_nodes=16, global_batch=16, n_micro=4)
    assert not [t for t in ev0["tried"] if t["stages"] == 2][0]["fits"]
    assert len(counts0) > 2 and max(stage_memory(counts0, 0, 1.0)) <= ev0["memory_budget"] + 1e-9


def test_autopipe_budgets_a_node_serving_several_stages_by_all_it_held_at_the_start():
    """The memory budget is the largest node's at the start: a node that served stages 1 and 2
    held both, so a layout whose stage is that large fits it; one node that served every stage
    holds the whole model, so on one node the pipeline becomes one stage (one stage per node
    is the only layout that leaves no stage without a node)."""
    start = stage_memory([2, 2, 2, 2], 0, 1.0)
    _, one_each = autopipe(8, 1, 4, 4, cached=False, stage0_memory=1.0, n_nodes=3)
    three, ev = autopipe(8, 1, 4, 4, cached=False, stage0_memory=1.0, n_nodes=3, start_groups=[[0], [1, 2], [3]])
    assert one_each["memory_budget"] == round(max(start), 4)
    assert ev["memory_budget"] == round(max(start[0], start[1] + start[2], start[3]), 4)
    # 3 stages of [3, 2, 3] layers: too big for a node that held one start stage, not for node 1
    assert [t["fits"] for t in one_each["tried"] if t["stages"] == 3] == [False]
    assert any(t["fits"] for t in ev["tried"] if t["stages"] == 3) and len(three) == 3
    whole, ev1 = autopipe(8, 1, 4, 4, cached=False, stage0_memory=1.0, n_nodes=1, start_groups=[[0, 1, 2, 3]])
    assert whole == [8] and ev1["memory_budget"] == round(sum(start), 4)
    assert [t["stages"] for t in ev1["tried"]] == [1]        # no count with more stages than nodes is tried


def test_autopipe_never_plans_more_stages_than_nodes_and_keeps_the_start_grouping_as_a_candidate():
    """Nothing frozen (an undo back to the start) on 3 nodes that served 0, 1+2 and 3: the
    balanced 3-stage split has a stage 0 too big for what node 0 held, but the start's own
    grouping as 3 stages ([2, 4, 2]: node 1's two stages as one) fits by construction; with a
    node gone, 2 stages at most, the least memory when none fits (said in the evidence)."""
    kw = dict(cached=False, stage0_memory=1.8, global_batch=16, n_micro=4, start_groups=[[0], [1, 2], [3]])
    counts, ev = autopipe(8, 0, 4, 4, n_nodes=3, **kw)
    assert len(counts) <= 3 and max(stage_memory(counts, 0, 1.8)) <= ev["memory_budget"] + 1e-9
    assert [2, 4, 2] in [t["counts"] for t in ev["tried"]] and not ev.get("over_budget")
    two, ev2 = autopipe(8, 0, 4, 4, n_nodes=2, **kw)
    assert len(two) <= 2 and max(t["stages"] for t in ev2["tried"]) <= 2
    if not any(t["fits"] for t in ev2["tried"]):
        assert ev2["over_budget"] and max(stage_memory(two, 0, 1.8)) == min(t["max_memory"] for t in ev2["tried"])


def test_autopipe_counts_the_embedding_frozen_with_the_prefix():
    from skiptrain.config import ModelConfig
    from skiptrain.elastic.repartition import autopipe_for, embedding_units, stage0_units
    # the embedding is 2 units of stage 0's 3; frozen, it costs 1/6 of that
    assert stage_memory([2, 2], 0, 3.0, embedding_memory=2.0) == [5.0, 2.0]
    assert stage_memory([2, 2], 1, 3.0, embedding_memory=2.0) == pytest.approx([1 + 1 / 6 + 1 + 2 / 6, 2.0])
    # the bench's model: 8 layers d=128, a 4096-token vocabulary (embedding ~2.8 layers), 4 stages
    # at the start (stage 0 holds no layer then).  With 6 layers frozen the stage-0 memory
    # drops by 5/6 of the embedding, so 2 stages x 8 replicas fit and are picked on 16 nodes
    cfg = ModelConfig(vocab_size=4096, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, seq_len=64, n_stages=4)
    assert embedding_units(cfg) > 2.5 and stage0_units(cfg)[1] > 2 * embedding_units(cfg) - 1e-9
    counts, ev = autopipe_for(cfg, 6, 4, 4, 1.0, n_nodes=16, global_batch=16, n_micro=4)
    assert len(counts) == 2 and counts[0] >= 6
    assert max(ev["stage_memory"]) <= ev["memory_budget"] + 1e-9


def test_autopipe_plans_without_a_fully_cached_prefix():
    from skiptrain.config import ModelConfig
    from skiptrain.elastic.repartition import autopipe_for, embedding_units
    # a prefilled cache serves every sample: frozen layers and the embedding are not resident
    assert stage_memory([3, 1], 2, 3.0, embedding_memory=2.0, prefix_cached=True) == [1.0 + 1.0, 1.0]
    assert stage_memory([3, 1], 0, 3.0, embedding_memory=2.0, prefix_cached=True) == [6.0, 1.0]  # nothing frozen
    # the bench's model with 6 of 8 layers frozen: 2 active layers + the head fit one device only
    # without the prefix, and one stage x 16 replicas (no pipeline bubble) is then the fastest
    cfg = ModelConfig(vocab_size=4096, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, seq_len=64, n_stages=4)
    kept, ev_kept = autopipe_for(cfg, 6, 4, 2, 1.0, n_nodes=16, global_batch=16, n_micro=4)
    gone, ev_gone = autopipe_for(cfg, 6, 4, 2, 1.0, n_nodes=16, global_batch=16, n_micro=4, prefix_cached=True)
    assert len(kept) == 2 and not [t for t in ev_kept["tried"] if t["stages"] == 1][0]["fits"]
    assert gone == [8] and ev_gone["prefix_cached"]
    # the start's largest stage is the embedding + head; now the head + 2 active layers
    assert ev_gone["stage_memory"] == [pytest.approx(ev_kept["memory_budget"] - embedding_units(cfg) + 2.0, abs=1e-3)]


def test_autopipe_costs_a_cached_prefix_by_its_expected_hits():
    assert layer_compute(4, 2, True, 1.5) == [0.0, 0.0, 2.5, 2.5]
    assert layer_compute(4, 2, False, 1.5) == [1.0, 1.0, 2.5, 2.5]
    assert layer_compute(4, 2, 0.25, 1.5) == [0.75, 0.75, 2.5, 2.5]
    # a prefix that will mostly miss weighs on stage 0: it gets fewer active layers than a free one
    free = autopipe(16, 6, 4, 4, cached=1.0)[0]
    missing = autopipe(16, 6, 4, 4, cached=0.2)[0]
    assert free[0] - 6 > missing[0] - 6 and sum(free) == sum(missing) == 16


# ---- AutoCache ----------------------------------------------------------------------------


@pytest.fixture
def tiny_model():
    cfg = build_config("tiny").model
    return StagedLM(cfg, seed=3)


def test_cache_equals_recompute_extends_and_invalidates(tiny_model, tmp_path):
    m = tiny_model
    n_win, T, d = 40, m.cfg.seq_len, m.cfg.d_model
    tokens = torch.randint(0, 256, (n_win, T), generator=torch.Generator().manual_seed(0))
    cache = ActivationCache(tmp_path / "c", n_win, T, d, max_bytes=30 * T * d * 4)
    assert cache.capacity == 30
    run = PrefixRunner(m, cache)
    run.set_frozen(1)
    wins = list(range(0, 20))
    ref1 = PrefixRunner(m).__class__(m)
    ref1.frozen = 1
    assert torch.equal(run(tokens[wins], wins), ref1.compute(tokens[wins]))
    assert cache.misses == 20 and cache.entries == 20
    assert torch.equal(run(tokens[wins], wins), ref1.compute(tokens[wins])) and cache.hits == 20
    # one more layer freezes: cached depth-1 rows are extended, not recomputed
    run.set_frozen(2)
    ref1.frozen = 2
    wins2 = list(range(10, 40))
    out = run(tokens[wins2], wins2)
    assert torch.equal(out, ref1.compute(tokens[wins2]))
    assert cache.extended == 10 and cache.entries == 30  # bounded: 10 windows did not fit
    # persisted: a reopened cache serves the same rows after validation
    cache.flush()
    again = ActivationCache(tmp_path / "c", n_win, T, d, max_bytes=30 * T * d * 4)
    run2 = PrefixRunner(m, again)
    assert run2.set_frozen(2) == 0 and again.entries == 30
    assert torch.equal(run2(tokens[wins2], wins2), out)
    # changed weights of layer 1 (e.g. an undone freeze that then trained): the 20 depth-2
    # entries are dropped, the 10 depth-1 entries (windows 0-9) stay valid
    with torch.no_grad():
        m.layers["1"].ffn.w1.weight.add_(0.01)
    assert run2.set_frozen(2) == 20 and again.entries == 10
    assert torch.equal(run2(tokens[wins2], wins2), run2.compute(tokens[wins2]))
    assert again.misses == 10 + 30 and again.extended == 0
    # an undo to a shallower prefix drops the deeper entries only
    assert run2.set_frozen(1) == 20 and again.entries == 10
    assert torch.equal(run2(tokens[:10], list(range(10))), run2.compute(tokens[:10]))
    with torch.no_grad():
        m.tok_emb.weight.add_(0.01)
    assert run2.set_frozen(1) == 10 and again.entries == 0


def test_cache_prefill_equals_recompute_and_extends_what_is_there(tiny_model, tmp_path):
    m = tiny_model
    n_win, T, d = 40, m.cfg.seq_len, m.cfg.d_model
    tokens = torch.randint(0, 256, (n_win, T), generator=torch.Generator().manual_seed(1))
    cache = ActivationCache(tmp_path / "c", n_win, T, d, max_bytes=n_win * T * d * 4)
    run = PrefixRunner(m, cache)
    run.set_frozen(1)
    run(tokens[:20], list(range(20)))           # a step cached windows 0-19 at depth 1
    assert not run.complete()
    run.set_frozen(2)
    asked = []

    def tokens_of(ws):
        asked.extend(ws)
        return tokens[ws]

    got = run.prefill(tokens_of, batch=7)
    # windows 0-19 extended by one layer, 20-39 computed from their tokens through both
    assert got["rows"] == 40 and got["layer_rows"] == 20 * 1 + 20 * 2
    assert sorted(asked) == list(range(20, 40)) and cache.stats()["prefilled"] == 40
    assert run.complete() and cache.misses == 20 and cache.hits == 0   # prefill is not a step's lookup
    ref = PrefixRunner(m)
    ref.frozen = 2
    assert torch.equal(run(tokens, list(range(n_win))), ref.compute(tokens))   # bit for bit
    assert cache.hits == 40 and cache.misses == 20 and cache.extended == 0
    assert run.prefill(tokens_of, batch=7)["rows"] == 0        # already complete: nothing to do
    # changed prefix weights: entries dropped, no longer complete
    with torch.no_grad():
        m.layers["1"].attn.wq.weight.mul_(1.1)
    run.set_frozen(2)
    assert not run.complete()
    small = PrefixRunner(m, ActivationCache(tmp_path / "s", n_win, T, d, max_bytes=10 * T * d * 4))
    small.set_frozen(1)
    with pytest.raises(ValueError, match="cache_mb"):
        small.prefill(tokens_of, batch=7)


def test_a_shared_cache_is_prefilled_once_per_window_by_its_processes_in_disjoint_parts(tiny_model, tmp_path):
    """Three processes (three cache objects on one directory) prefill their parts of the union
    of the windows they will read (the prefill plan's work, one cache with three workers): every window is computed once, each process then reads every
    window of the union from the file (bit for bit the recomputation), a training step's miss is
    computed but not written (only the prefill writes a shared cache), and the next freeze
    extends the rows whichever process computed them."""
    m = tiny_model
    n_win, T, d = 30, m.cfg.seq_len, m.cfg.d_model
    tokens = torch.randint(0, 256, (n_win, T), generator=torch.Generator().manual_seed(2))
    shares = [[3, 1, 4, 15, 9], [2, 6, 5, 3, 5, 8], [9, 7, 9, 3, 2, 1, 20]]
    union = list(dict.fromkeys(w for sh in shares for w in sh))
    parts = list(plan_prefill({"loc": union}, {}, {"loc": [0, 1, 2]}, 1, lambda a, b: 0.0).work.values())
    assert sorted(w for p in parts for w in p) == sorted(union)     # disjoint, together the union
    caches = [ActivationCache(tmp_path / "loc", n_win, T, d, n_win * T * d * 4, shared=True) for _ in range(3)]
    runs = [PrefixRunner(m, c, store=False) for c in caches]
    for r in runs:
        r.set_frozen(1)
    got = [r.prefill(lambda ws: tokens[ws], 4, p) for r, p in zip(runs, parts)]
    assert sum(g["rows"] for g in got) == len(union) == sum(g["layer_rows"] for g in got)
    for c in caches:
        c.flush()
        c.refresh()
        assert sorted(c.slot_of) == sorted(union)
    ref = PrefixRunner(m)
    ref.frozen = 1
    for r, sh in zip(runs, shares):
        assert torch.equal(r(tokens[sh], sh), ref.compute(tokens[sh]))
    assert [c.hits for c in caches] == [len(sh) for sh in shares] and all(c.misses == 0 for c in caches)
    # a window outside the union: computed in the step, not written
    writes = caches[0].writes
    assert torch.equal(runs[0](tokens[[11]], [11]), ref.compute(tokens[[11]]))
    assert caches[0].misses == 1 and caches[0].writes == writes and all(c.lookup([11]) == [None] for c in caches)
    # a deeper prefix: each process extends its new part, whoever computed the depth-1 rows
    for r in runs:
        r.set_frozen(2)
    parts = list(plan_prefill({"loc": union}, {"loc": dict.fromkeys(union, 1)}, {"loc": [0, 1, 2]}, 2,
                              lambda a, b: 0.0).work.values())
    got = [r.prefill(lambda ws: tokens[ws], 4, parts[(i + 1) % 3]) for i, r in enumerate(runs)]
    assert sum(g["rows"] for g in got) == len(union) == sum(g["layer_rows"] for g in got)
    ref.frozen = 2
    caches[2].refresh()
    assert runs[2].complete() is False and torch.equal(runs[2](tokens[union], union), ref.compute(tokens[union]))
    with pytest.raises(ValueError, match="room for all"):
        ActivationCache(tmp_path / "small", n_win, T, d, 10 * T * d * 4, shared=True)


def test_validating_a_shared_cache_while_another_process_invalidates_its_rows(tmp_path):
    """Every originator sharing a location's cache validates it after a freeze change, at the
    same time: a row another process invalidates (window tag -1) between this one's index and
    its read of the tags is dropped, not looked up as window -1.  The other process's write is
    made in the gap (after the index is read); the reference is the rows' own validity."""
    n_win, T, d = 6, 4, 2
    mine = ActivationCache(tmp_path / "loc", n_win, T, d, n_win * T * d * 4, shared=True)
    other = ActivationCache(tmp_path / "loc", n_win, T, d, n_win * T * d * 4, shared=True)
    row = torch.zeros(T, d)
    for w in range(n_win):
        mine.write(w, 2 if w < 3 else 1, 7, row)          # windows 0-2 at depth 2, 3-5 at depth 1
    mine.flush()
    reindex = mine._reindex

    def index_then_the_other_process_invalidates():
        reindex()
        other.tags[[0, 1]] = -1                          # (what its validate writes for rows it drops)
        other.flush()

    mine._reindex = index_then_the_other_process_invalidates
    dropped = mine.validate({1: 7}, frozen=1)            # depth 2 no longer valid: rows 0-2 go
    assert dropped == 3 and sorted(mine.slot_of) == [3, 4, 5]
    assert [x is not None for x in mine.lookup(range(n_win))] == [False] * 3 + [True] * 3
    assert (np.asarray(other.tags[:3, 0]) == -1).all()


def test_cache_decision_rule():
    m = {"recompute_s": 1.0, "write_s": 0.1, "read_s": 0.05}
    assert not worth_it(m, 1.0)       # one visit: nothing to reuse
    assert worth_it(m, 3.0)
    assert not worth_it({"recompute_s": 0.01, "write_s": 0.1, "read_s": 0.05}, 10.0)


def test_expected_hit_counts_coverage_capacity_and_visits(tmp_path):
    c = ActivationCache(tmp_path / "c", n_windows=10, seq_len=4, d_model=2, max_bytes=8 * 4 * 2 * 4)
    assert c.capacity == 8
    assert expected_hit(c, 2, 0.0) == 0.0                      # nothing cached, no visits left
    assert expected_hit(c, 2, 4.0) == pytest.approx((0.8 * 4 - 0.8) / 4)   # 8 of 10 cacheable, each misses once
    row = torch.zeros(4, 2)
    for w in range(4):
        c.write(w, 2, 0, row)                                  # 4 windows at full depth
    c.write(4, 1, 0, row)                                      # 1 at half depth: extension saves half
    cover = (4 + 0.5) / 10
    assert expected_hit(c, 2, 0.0) == pytest.approx(cover)
    assert expected_hit(c, 2, 2.0) == pytest.approx((0.8 * 2 - (0.8 - cover)) / 2)
    # half a visit left: a window is looked up at most once, and hits when it is already cached
    assert expected_hit(c, 2, 0.5) == pytest.approx(cover)


def test_cache_measurement_rescales_to_other_depths(tiny_model, tmp_path):
    tokens = torch.randint(0, tiny_model.cfg.vocab_size, (2, tiny_model.cfg.seq_len))
    m = measure(tiny_model, 1, tokens, tmp_path, repeats=1)
    assert m["depth"] == 1 and min(m["recompute_s"], m["write_s"], m["read_s"]) > 0
    d = at_depth(m, 3)   # three layers cost three times one; rows cost the same at any depth
    assert d["depth"] == 3 and d["recompute_s"] == pytest.approx(3 * m["recompute_s"])
    assert (d["write_s"], d["read_s"]) == (m["write_s"], m["read_s"])
    assert at_depth(d, 1)["recompute_s"] == pytest.approx(m["recompute_s"])
    with pytest.raises(ValueError, match="positive"):
        at_depth(m, 0)


# ---- AutoDP: replicas -----------------------------------------------------------------------


def test_replicas_identical_after_transition(tmp_path):
    cfg = build_config("tiny", overrides={"model": {"n_layers": 6, "n_stages": 4, "stage0_layers": 0}}).model
    tcfg = build_config("tiny").train
    old = Partition((0, 2, 2, 2))
    peer = StagedLM(cfg, partition=old, seed=5)
    opt = build_adamw(peer.named_parameters(), tcfg)
    x = torch.randint(0, 256, (4, cfg.seq_len))
    for _ in range(3):
        opt.zero_grad()
        peer(x, x)[1].backward()
        opt.step()
    # transition: layers 0-1 frozen, 2 stages of layers [3, 3], 8 nodes -> 4 replicas per stage
    new = Partition((3, 3))
    sizes = {n: t.numel() * 4 for n, t in peer.state_dict().items()}
    old_pl = [[0, 1], [2, 3], [4, 5], [6, 7]]
    pl = assign_nodes(sizes, old, old_pl, new, 8)
    assert sorted(n for p in pl for n in p) == list(range(8)) and all(len(p) == 4 for p in pl)
    plan = transfer_plan(sizes, Layout(old, old_pl), Layout(new, pl))
    assert all(tr.src != tr.dst for tr in plan)
    # a new replica of stage 1 (layers 3-5), built for the new layout, receives over a socket
    replica = StagedLM(cfg, stages=[1], partition=new, seed=99)
    ropt = build_adamw(replica.named_parameters(), tcfg)
    names = [n for n, _ in replica.named_parameters()]
    names += [f"optim.{k}.{n}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")]
    blob = pack_state(peer, opt, names, {"step": 3, "data": {"cursor": 12}})
    a, b = socket.socketpair()
    got = bytearray()

    def recv():
        while chunk := b.recv(1 << 16):
            got.extend(chunk)

    th = threading.Thread(target=recv)
    th.start()
    a.sendall(blob)
    a.close()
    th.join()
    b.close()
    st = unpack_state(bytes(got), replica, ropt)
    assert st == {"step": 3, "data": {"cursor": 12}}
    pp = dict(peer.named_parameters())
    for n, p in replica.named_parameters():
        assert torch.equal(p, pp[n])
    # the same gradient step on peer and replica keeps them identical (optimizer state moved too)
    grads = {n: torch.randn_like(p) for n, p in replica.named_parameters()}
    opt.zero_grad(set_to_none=True)
    for n, p in replica.named_parameters():
        p.grad = grads[n].clone()
        pp[n].grad = grads[n].clone()
    opt.step()
    ropt.step()
    for n, p in replica.named_parameters():
        assert torch.equal(p, pp[n]), n


def test_sharding_over_a_replica_change_never_repeats_or_skips():
    seen = []
    cursor, B = 0, 12
    for step, world in enumerate([1, 1, 2, 2, 4, 4, 3]):  # replicas change between iterations
        for r in range(world):
            seen.extend(shard_indices(cursor, B, r, world))
        cursor += B
    assert sorted(seen) == list(range(cursor))


def test_assign_nodes_and_transfer_plan_match_a_per_node_reference():
    """The placement keeps the most bytes in place, as a per-node reference computes it, over
    shrinks, growths (an undo), stages without layers and old layouts where a node serves
    several stages; the plan gives each node its stage."""
    import random

    from skiptrain.layout import tensor_stage

    def reference(sizes, old, old_pl, new, n_nodes):
        held = {n: {t for t in sizes if n in old_pl[tensor_stage(t, old)]} for n in range(n_nodes)}
        need = {s: {t for t in sizes if tensor_stage(t, new) == s} for s in range(new.n_stages)}
        pairs = sorted((-sum(sizes[t] for t in need[s] & held[n]), n, s)
                       for n in range(n_nodes) for s in range(new.n_stages))
        pl, used = [[] for _ in range(new.n_stages)], set()
        for _, n, s in pairs:
            if n not in used and len(pl[s]) < n_nodes // new.n_stages:
                pl[s].append(n)
                used.add(n)
        return [sorted(p) for p in pl]

    rng = random.Random(0)
    names = ["tok_emb.weight", "head.weight", "norm.weight"] + [f"layers.{i}.{w}" for i in range(8) for w in "abc"]
    names += [f"optim.exp_avg.{n}" for n in names]
    cases = [((2, 2, 2, 2), (4, 4), 16, None), ((4, 4), (8,), 16, None), ((0, 2, 3, 3), (3, 5), 16, None),
             ((3, 5), (0, 2, 3, 3), 16, None), ((2, 3, 3), (5, 3), 7, None),
             # nodes that serve several stages (node 1 serves stages 1 and 2, beside node 2 on stage 2 alone)
             ((2, 2, 2, 2), (4, 2, 2), 4, [[0], [1], [1, 2], [3]]), ((2, 2, 2, 2), (3, 5), 3, [[0], [1], [1], [2]]),
             ((1, 1, 3, 3), (2, 3, 3), 5, [[0, 1], [0, 1], [2, 3], [4]])]
    cases += [((2, 2, 2, 2), (2, 3, 3), 4, [[0], [1], [1, 2], [3]])] * 20 + \
        [((2, 2, 2, 2), (4, 4), 4, [[0], [1], [1, 2], [3]])] * 20
    for old_c, new_c, n_nodes, given in cases:
        sizes = {n: rng.randrange(1, 10_000) for n in names}
        old, new = Partition(old_c), Partition(new_c)
        per = n_nodes // old.n_stages
        old_pl = given or [list(range(s * per, (s + 1) * per)) for s in range(old.n_stages)]
        pl = assign_nodes(sizes, old, old_pl, new, n_nodes)
        assert pl == reference(sizes, old, old_pl, new, n_nodes)
        got = {n: {t for t in sizes if n in old_pl[tensor_stage(t, old)]} for n in range(n_nodes)}
        for tr in transfer_plan(sizes, Layout(old, old_pl), Layout(new, pl)):
            assert tr.src != tr.dst and not set(tr.names) & got[tr.dst]
            got[tr.dst] |= set(tr.names)
        for s, nodes in enumerate(pl):
            for n in nodes:
                assert {t for t in sizes if tensor_stage(t, new) == s} <= got[n]


def test_costs_model_static_sweep_and_an_elastic_schedule_at_paper_scale():
    """The library's cost model of elastic runs: at PipeTransformer's scale a static sweep finds
    feasible layouts only where memory allows, and freezing half the layers with the prefix
    cached makes the elastic steps cheaper than the static best, with a transition bill."""
    from skiptrain.elastic.costs import N_DEV, elastic_times, paper_scale, sim_memory, sim_topology, sweep

    sc, topo = paper_scale(), sim_topology()
    sw = sweep(sc, topo)
    feasible = [r for r in sw if r["iteration_s"] is not None]
    assert feasible and all(r["stages"] * r["replicas"] == N_DEV for r in sw)
    assert all(r["iteration_s"] is None for r in sw if r["stages"] == 1)      # plain DP does not fit 24 GiB
    assert sim_memory([32], 0, 1, 1, sc.model) > sc.dev_mem
    best = min(feasible, key=lambda r: r["iteration_s"])
    L = sc.model.n_layers
    e = elastic_times(sc, [(0, 0.0, False)] * 2 + [(L // 2, 1.0, True)] * 2, L, best, topo)
    assert e["per_step"][0] == pytest.approx(best["iteration_s"])
    assert e["per_step"][-1] < 0.9 * best["iteration_s"] and e["wire_s"] > 0
    assert e["history"][-1]["frozen"] == L // 2
