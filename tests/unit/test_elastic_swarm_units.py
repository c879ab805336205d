"""Elastic freezing in a swarm of node processes: the rule decides for the whole swarm, the
pipeline shrinks across processes, state moves between them by name, checkpoints resume into
the transitioned layout, and a node killed mid-transition is recovered like any failure.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_elastic_swarm.py."""

from __future__ import annotations

import json

import pytest

from skiptrain.config import build_config
from skiptrain.elastic.costs import sim_topology
from skiptrain.elastic.repartition import ElasticLayout
from skiptrain.layout.transfer import transfer_plan
from skiptrain.runtime.job import build_cost
from skiptrain.elastic.freezer import plan_layout
from skiptrain.runtime.transition import deal_originators, layout_cost, layout_schedule
from skiptrain.schedule.simulator import simulate


ITERS = 10
GB = 4 * 8          # 2 originators x 2 micro-batches x micro_batch 8

# windows of 2 steps; every layer "stable" (tol 100), alpha 1/2 of the 2 freezable layers: the
# rule freezes layer 0 after step 4 and layer 1 after step 6; the guard measures every window
# (reference points from step 2) and never undoes (guard_tol 1.0)
ELASTIC = {"enabled": True, "check_every": 2, "tol": 100.0, "stable_windows": 1, "start_window": 2,
           "alpha": 0.5, "min_active": 2, "guard": True, "guard_tol": 1.0, "guard_batches": 2, "cache": "off"}


def _cfg(runtime: dict | None = None, **train):
    return build_config("tiny", overrides={
        "model": {"n_stages": 4},
        "runtime": {"nodes": 6, "stage_sizes": "2,2,1,1", "mb_per_originator": 2, "timeout_s": 20, **(runtime or {})},
        "train": {"steps": ITERS, "warmup_steps": 1, "grad_clip": 1.0, **train},
        "checkpoint": {"every": 2, "keep": 10}, "elastic": ELASTIC})


def one_process_freezing(cfg, data, iterations: int):
    """A simple reference of freezing on one process: the plain trainer (every stage in one
    model), the freeze rule fed the synced updates' per-layer norms and asked at each window's
    end (its guard: :func:`evaluate` over the guard's micro-batches), and at a changed depth the
    frozen layers stop requiring gradients.  Without skipping, which layout the layers run in
    does not change what is computed, so no repartition is needed.  Returns the transitions
    ``(frozen before, after, steps done)`` and the final parameters by name."""
    from skiptrain.data.dataset import TokenDataset
    from skiptrain.elastic.freezer import Freezer, layer_sq_norms
    from skiptrain.layout import Layout
    from skiptrain.runtime.evaluate import evaluate
    from skiptrain.train.trainer import Trainer

    assert cfg.train.skip_ratio == 0
    tr = Trainer(cfg, None, dataset=TokenDataset.open(data))
    freezer, frozen, transitions = Freezer(tr.cfg), [0], []
    tr.observe = lambda updates: freezer.observe(layer_sq_norms(updates), frozen[0])
    guard = lambda: evaluate(tr.model, tr.val_src, cfg.elastic.guard_batches, cfg.train.micro_batch)  # noqa: E731
    for _ in range(iterations):
        tr.train_step()
        d = freezer.decide(tr.step, guard)
        if d is not None and d.frozen_after != frozen[0]:
            transitions.append((frozen[0], d.frozen_after, tr.step))
            frozen[0] = d.frozen_after
            tr.reconfigure(Layout(tr.model.partition, tr.layout.placement, frozen[0]))
    return transitions, {n: p.detach() for n, p in tr.model.named_parameters()}


# ---- units ------------------------------------------------------------------------------------

def test_a_shrinking_layout_keeps_every_node_busy_and_moves_only_what_is_missing():
    cfg = _cfg()
    pl = [[0, 1], [2, 3], [4], [5]]
    sizes = {f"layers.{i}.w": 100 for i in range(4)} | {f"optim.exp_avg.layers.{i}.w": 100 for i in range(4)} | \
        {"tok_emb.weight": 1000, "head.weight": 1000, "sync.m.layers.3.w": 10}
    new, ev = plan_layout(cfg.model, 2, [1, 1, 1, 1], pl, list(range(6)), sizes, 4, GB, 4, 6)
    assert new.frozen == 2 and sum(new.counts) == 4 and new.counts[0] >= 2 and ev["tried"]
    assert sorted(n for p in new.placement for n in p) == list(range(6 // new.n_stages * new.n_stages))
    old = ElasticLayout.of(0, [1, 1, 1, 1], 1, 4, pl)
    held = old.node_tensors(sizes)
    plan = transfer_plan(sizes, old, new)
    assert plan and all(not set(t.names) & held[t.dst] for t in plan)   # only what the receiver lacks
    # survivors only: a dead node gets no stage
    new2, _ = plan_layout(cfg.model, 2, [1, 1, 1, 1], [[0], [2, 3], [4], [5]], [0, 2, 3, 4, 5], sizes, 4, GB, 4, 6)
    assert 1 not in {n for p in new2.placement for n in p}


def test_the_new_schedule_keeps_the_micro_batches_and_routes_through_the_new_stages():
    s = layout_schedule([[0, 1, 2], [3, 4, 5]], [3, 0, 2, 1], 0.5, 2, 3, seed=1)
    assert sorted(m.id for m in s.micro_batches) == [0, 1, 2, 3]
    assert [m.originator for m in s.micro_batches] == [0, 1, 2, 0]
    assert all(m.stages == [1] for m in s.micro_batches) and s.skip_ratio == 0.0
    s.validate(claims=("placement", "originators", "stage0_ends", "no_repeat"))
    s4 = layout_schedule([[0, 1], [2], [3], [4, 5]], list(range(8)), 0.34, 2, 3, seed=1)
    s4.validate(claims=("placement", "originators", "stage0_ends", "no_repeat", "balanced", "skip_count"))
    # after a layout change the originators keep their micro-batches (so their cached windows)
    # as far as an even deal allows
    kept = layout_schedule([[0, 2, 4], [1, 3, 5]], list(range(4)), 0.0, 2, 3, seed=1, keep={0: 2, 1: 4, 2: 2, 3: 4})
    assert [m.originator for m in kept.micro_batches] == [2, 4, 0, 4]
    assert deal_originators([0, 1], list(range(6)), {i: 7 for i in range(6)}) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    one = layout_schedule([list(range(6))], list(range(4)), 0.0, 2, 3, seed=1)
    assert [m.route for m in one.micro_batches] == [[]] * 4 and one.memory == 1


def test_each_replica_gets_one_micro_batch_of_each_injection_round():
    """An originator injects its micro-batches in id order, so its k-th arrives about k forwards
    late: a replica served only late ones would idle until then.  After a layout change that
    keeps originators (2 x 8 from 4 x 4: originators 0-3 keep 0/4, 1/5, 2/6, 3/7, the rest go
    to 4-7), every stage-1 replica gets one micro-batch of each round, and the iteration
    simulates as fast as with round-robin originators."""
    placement = [list(range(8)), list(range(8, 16))]
    keep = {i: i % 4 for i in range(16)}
    s = layout_schedule(placement, list(range(16)), 0.0, 0, 2, seed=1, keep=keep)
    order = {}
    for mb in s.micro_batches:
        order.setdefault(mb.originator, []).append(mb.id)
    rounds = {n: sorted(order[mb.originator].index(mb.id) for mb in s.micro_batches if mb.route[0][1] == n)
              for n in placement[1]}
    assert all(r == [0, 1] for r in rounds.values()), rounds
    topo = sim_topology()
    cfg = _cfg()
    cfg.model.vocab_size = 256
    half = cfg.model.n_layers // 2
    cost = layout_cost(build_cost(cfg, s_per_sample_layer=0.05), cfg.model, [half, cfg.model.n_layers - half], 0)
    rr = layout_schedule(placement, list(range(16)), 0.0, 0, 2, seed=1)
    t_keep = simulate(s, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
    t_rr = simulate(rr, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
    assert t_keep <= t_rr * 1.001, (t_keep, t_rr)


def test_the_layout_cost_charges_frozen_layers_their_forward_only():
    cfg = _cfg()
    cfg.model.vocab_size = 256
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    c = layout_cost(cost, cfg.model, [3, 1], 2)
    assert c.layers_per_stage == pytest.approx([1 + 2 / 2.5, 1]) and len(c.params_per_stage) == 2
    assert layout_cost(cost, cfg.model, [3, 1], 2, hit=1.0).layers_per_stage == [1, 1]


def test_a_layout_saved_by_other_nodes_is_reseated_on_the_nodes_of_the_resumed_job():
    from skiptrain.runtime.transition import reseat

    # node 3 failed and node 6 joined before the save; the resumed job has nodes 0..5
    assert reseat([[0, 1, 6], [2, 4], [5]], list(range(6))) == [[0, 1, 3], [2, 4], [5]]
    # fewer nodes than places: the layout shrinks where a node is gone
    assert reseat([[0, 7], [1], [2]], [0, 1, 2]) == [[0], [1], [2]]
    # nodes left over join the stage with the fewest replicas
    assert reseat([[0, 1], [2]], [0, 1, 2, 3, 4]) == [[0, 1, 4], [2, 3]]
    with pytest.raises(ValueError, match="none of the nodes"):
        reseat([[0], [9]], [0])


def test_a_resumed_freezing_job_keeps_the_decisions_before_its_checkpoint_and_drops_the_transitions_at_it(tmp_path):
    from skiptrain.checkpoint.training import truncate_metrics
    from skiptrain.runtime.freezing import log_position

    log = tmp_path / "elastic.jsonl"
    rows = [{"step": 6, "action": "freeze"}, {"step": 6, "action": "transition"}, {"step": 8, "action": "freeze"},
            {"step": 8, "action": "transition"}, {"step": 8, "action": "transition_skipped"}, {"step": 10}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    truncate_metrics(log, 8, log_position)
    assert [json.loads(x) for x in log.read_text().splitlines()] == rows[:3]


@pytest.mark.parametrize("strategy,step_rule", [("allreduce", "sign"), ("demo", "sign"), ("demo", "adam"),
                                                ("sparseloco", "sign"), ("diloco", "sign"), ("powersgd", "sign")])
def test_a_node_without_a_stage_builds_the_one_it_is_handed_with_the_configs_optimizer_rule(strategy, step_rule):
    """A transition (or a resume) may hand a stage to a node that served none, so it has no sync
    strategy to ask for the optimizer rule: the config's rule (``update_rule_of``) must be the one
    the strategy feeds, or the state moved from a replica does not load (a DeMo swarm refused it:
    "checkpoint holds DirectionDescent state; this run uses AdamW")."""
    import torch

    from skiptrain.dp import make_strategy, update_rule_of
    from skiptrain.model.partition import partition_layers
    from skiptrain.model.transformer import StagedLM
    from skiptrain.optim import build_optimizer
    from skiptrain.runtime.job_checkpoint import stage_state
    from skiptrain.runtime.transition import build_stage, gather_state

    cfg = _cfg()
    cfg.dp.strategy, cfg.dp.step_rule = strategy, step_rule
    part = partition_layers(cfg.model)
    holder = StagedLM(cfg.model, stages=[1], partition=part, seed=cfg.train.seed)
    strat = make_strategy(cfg.dp, holder.named_parameters(), None, cfg.train)
    assert update_rule_of(cfg.dp) == strat.update_rule
    opt = build_optimizer(holder.named_parameters(), cfg.train, strat.update_rule)
    for p in holder.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    own, _ = stage_state(holder, opt, strat, 0)
    tensors, record, _ = gather_state(holder, opt, strat, [], set(own))
    model, _ = build_stage(cfg, 1, part, 0, tensors, record, update_rule_of(cfg.dp))
    assert all(torch.equal(p, dict(holder.named_parameters())[n]) for n, p in model.named_parameters())


def test_the_one_process_reference_freezes_and_trains_as_the_elastic_trainer(byte_data):
    """The reference above takes the elastic bench harness's decisions and ends with its weights
    (the harness plans its layouts for emulated nodes, which changes nothing computed here)."""
    from skiptrain.data.dataset import TokenDataset
    from bench._elastic_trainer import ElasticTrainer

    cfg = _cfg(n_micro=4)
    cfg.checkpoint.every, cfg.checkpoint.final = 0, False
    transitions, ref = one_process_freezing(cfg, byte_data, ITERS)
    assert transitions == [(0, 1, 4), (1, 2, 6)]
    t = ElasticTrainer(_cfg(n_micro=4), None, dataset=TokenDataset.open(byte_data))
    for _ in range(ITERS):
        t.train_step()
    assert [(x["frozen_before"], x["frozen_after"], x["step"]) for x in t.transitions] == transitions
    worst = max((p.detach() - ref[n]).abs().max().item() for n, p in t.model.named_parameters())
    assert worst < 1e-5, worst


def test_a_node_serving_two_stages_moves_the_sync_state_of_both():
    """A node serving stages 1 and 2 under DeMo holds a strategy per stage, each with state: the
    sizes it announces and the state a transition gathers from it name both stages' sync state."""
    from skiptrain.dp import make_strategy
    from skiptrain.model import StagedLM
    from skiptrain.optim import build_optimizer
    from skiptrain.runtime.transition import gather_state, stage_sizes

    cfg = build_config("tiny", overrides={"model": {"n_stages": 4}, "dp": {"strategy": "demo"}})
    model = StagedLM(cfg.model, stages=[1, 2], seed=0)
    strats = [make_strategy(cfg.dp, list(model.stage_named_parameters(s)), None, cfg.train) for s in (1, 2)]
    opt = build_optimizer(model.named_parameters(), cfg.train, strats[0].update_rule)
    assert all(s.state_dict()["tensors"] for s in strats)     # (DeMo's momentum, from the start)
    sizes = stage_sizes(model, opt, strats)
    sync_names = {n for n in sizes if n.startswith("sync.")}
    for s in (1, 2):
        own = {n for n, _ in model.stage_named_parameters(s)}
        assert any(n.split(".", 2)[2] in own for n in sync_names), f"stage {s}'s sync state is missing"
    tensors, _, _ = gather_state(model, opt, strats, [], set(sizes))
    assert {n for n in tensors if n.startswith("sync.")} == sync_names


def test_the_freezing_state_a_checkpoint_carries_is_a_copy_taken_when_asked():
    # an asynchronous checkpoint serialises the state after the next iteration's transition has
    # appended to the live layout history; what it was handed must not move with it
    from types import SimpleNamespace

    from skiptrain.runtime.freezing import SwarmFreezing

    fz = object.__new__(SwarmFreezing)
    rule = {"windows": [1, 2]}
    fz.__dict__.update(frozen=1, counts=[4, 2], pending=None, start_stages=4, start_groups=[[0], [1], [2], [3]],
                       freezer=SimpleNamespace(rule=SimpleNamespace(state_dict=lambda: rule)), layouts=[{"at": 4, "counts": [4, 2]}],
                       transitions=[{"step": 4}], st=SimpleNamespace(sched=SimpleNamespace(to_dict=lambda: {"m": 2})),
                       guard_s=0.5, prefix_cached=0, pending_cache=None)
    saved = fz.state_dict()
    fz.layouts.append({"at": 6, "counts": [4, 1]})
    fz.transitions.append({"step": 6})
    fz.counts[1] = 1
    rule["windows"].append(3)
    assert saved["layouts"] == [{"at": 4, "counts": [4, 2]}] and saved["transitions"] == [{"step": 4}]
    assert saved["counts"] == [4, 2] and saved["rule"] == {"windows": [1, 2]}
