"""Elastic freezing in the swarm: the freeze rule, its guard and the transitions, on every node
process at iteration boundaries (``elastic.enabled`` in a job's config).

Every node holds a :class:`SwarmFreezing` next to its phase state and feeds the same inputs to
its own :class:`~skiptrain.elastic.freeze.FreezeRule`, so every node takes the same decisions
without exchanging them:

* **gradient signal**: after each optimizer step, the first replica of each stage reports the
  squared norm of its layers' synced update (a node serving several stages: of each);
  the node's per-iteration stats gather carries the reports, so every node sums every active
  layer's norm without a collective of its own;
* **guard**: at the end of a window the rule may ask for the validation loss; the stage-0 nodes
  (the originators) run it, ``elastic.guard_batches`` fixed validation micro-batches dealt over
  them, each sent forward along the full route of the layout in force (forward only); the loss
  sums are all-reduced, so every node sees the same value;
* **transition**: a changed frozen depth is applied at the start of the next iteration, before
  any of its work: AutoPipe + AutoDP plan the layout on the nodes alive
  (:func:`~skiptrain.elastic.freezer.plan_layout`; never more stages than nodes, so a node that
  served several stages serves one after it), the
  layout-change core plans the moves by name and the
  nodes exchange them point to point (:func:`~.transition.move_state`), each node builds its
  new stage, a barrier commits, and only then does every node switch (groups, sync strategy,
  schedule, executor).  A failure before the commit leaves every survivor in the old layout;
  recovery re-forms the swarm and the next attempt of the iteration plans the transition again
  over the survivors.  The micro-batch ids and the global batch are kept, so no sample is
  repeated or skipped; the routes of the new layout are re-planned by the planner when the
  phase has a topology and cost model and skipping is on.
* the originators start each micro-batch from the frozen prefix's output (no autograd), and
  stage 0's forward runs only its layers after the prefix.

Checkpoints carry the rule state, the layout history, the schedule in force and a transition
still pending (``position["elastic"]``); a resumed job rebuilds the layout in force before it
loads the saved state.  Decisions and transitions go to ``RUN_DIR/elastic.jsonl`` (lowest node).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.reader import CheckpointReader
from ..checkpoint.training import truncate_metrics
from ..elastic.cache import ActivationCache, PrefixRunner
from ..dp import update_rule_of
from ..elastic.freezer import Freezer, append_log, layer_sq_norms, plan_layout, prefix_input, stage0_forward
from ..elastic.repartition import ElasticLayout
from ..layout.transfer import transfer_plan
from ..model.partition import Partition, partition_layers
from ..optim import build_optimizer
from ..schedule.schedule import Schedule
from .drift import broadcast_schedule, replan_routes
from .evaluate import pipelined_evaluate_sum
from .freeze_cache import PrefixCaching
from .job_checkpoint import load_sync
from .transition import (Activations, build_stage, freeze_parameters, gather_state, layout_cost, layout_schedule,
                         move_state, reseat, stage_names, stage_sizes, sync_state)

GUARD_TAG = 13
# the planner's budget when it re-plans the routes of a new layout (simulator calls; no time cap,
# so every run plans the same routes)
ROUTE_EVALS = 200


def log_position(row: dict[str, Any]) -> float:
    """Where a line of ``elastic.jsonl`` falls against a checkpoint's step (iterations done): a
    decision's step counts the iterations done; a transition's is the iteration it starts, so
    one at the checkpoint's step came after the checkpoint (a resumed job applies it again)."""
    return row.get("step", 0) + (0.5 if str(row.get("action", "")).startswith("transition") else 0.0)


class SwarmFreezing(PrefixCaching):
    """One node's side of elastic freezing in the swarm (see the module docstring)."""

    def __init__(self, node, st):
        cfg = node.cfg
        self.node, self.st, self.cfg = node, st, cfg
        L = cfg.model.n_layers
        self.freezer = Freezer(cfg)
        self.frozen = 0
        self.counts = partition_layers(cfg.model).to_list()
        self.start_stages = len(st.sched.placement)
        # the stages each node served at the start (AutoPipe's memory budget: the most a node held)
        self.start_groups = [list(g) for g in sorted({tuple(ss) for ss in st.sched.stages_of().values()})]
        # every layout's memory credits: the phase's (a one-stage layout caps its schedule's
        # credits at the micro-batches per originator; the layouts after it must not inherit that)
        self.memory = Schedule.from_dict(st.ph.schedule).memory
        self.base_cost = st.cost
        pl = st.sched.placement
        self.layouts = [ElasticLayout.of(0, self.counts, min(len(p) for p in pl), len(st.order), pl).to_dict()]
        self.transitions: list[dict[str, Any]] = []
        self.pending: int | None = None
        self.pending_cache = False      # the layout in force is planned again with its prefix cached
        self.sq = torch.zeros(2 * L, dtype=torch.float64)     # per layer: squared norm, reported
        self.runner: PrefixRunner | None = None
        self.cache: ActivationCache | None = None
        self.prefix_cached = False      # the layout in force was planned with every prefix output cached
        self.prefix_due = False         # the prefix runner still needs its depth (and the prefill) set
        self.guard_s = 0.0
        if node.job.resume and node.job.resume["phase"] == st.idx:
            self._resume(node.job.resume["path"])

    @property
    def rule(self):
        """The freeze rule (the freezer's)."""
        return self.freezer.rule

    # ---- the step's inputs -----------------------------------------------------------------

    def embed(self, h: torch.Tensor) -> torch.Tensor:
        """Stage 0's forward: the embedding and its layers, or after a freeze its layers after
        the frozen prefix, on the prefix's output."""
        return stage0_forward(self.st.model, self.frozen, h)

    def batch(self, src, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(stage 0's input, targets) of global samples ``indices``: the tokens, or the frozen
        prefix's output computed without autograd."""
        x, y = src.batch(indices)
        return prefix_input(self.runner, src, x, indices, self.frozen), y

    def observe(self, updates: dict[str, torch.Tensor]) -> None:
        """The optimizer step's synced updates: per layer, their squared norm (first replica)."""
        st, L = self.st, self.cfg.model.n_layers
        if st.stage is None or st.sched.placement[st.stage].index(self.node.rank) != 0:
            return
        for layer, v in layer_sq_norms(updates).items():
            self.sq[layer] += v
            self.sq[L + layer] = 1.0

    # ---- the rule at iteration boundaries -------------------------------------------------

    def take_norms(self) -> torch.Tensor:
        """This node's report of the iteration (``2 * n_layers`` numbers: per layer the squared
        norm of its synced update, then 1 where this node reported that layer), reset for the
        next one.  The node's per-iteration stats gather carries it to every node; each layer
        has one reporter (its stage's first replica), so the column sums are exact."""
        sq, self.sq = self.sq, torch.zeros_like(self.sq)
        return sq

    def after_iteration(self, sq: torch.Tensor) -> None:
        """Every node, after iteration ``st.it``, with ``sq`` the sum over the nodes of their
        :meth:`take_norms`: the layers' norms to the rule; at a window's end, the rule's
        decision (a changed depth becomes the pending transition)."""
        st, L = self.st, self.cfg.model.n_layers
        if self.cache is not None:
            st.record["cache"] = self.cache.stats()
        self.freezer.observe({l: float(sq[l]) for l in range(L) if sq[L + l] > 0}, self.frozen)
        step = st.it + 1
        # (a stage left without a node, skipped by every route: nothing can validate through it)
        d = self.freezer.decide(step, self.guard_loss if all(st.sched.placement) else None)
        if d is None:
            return
        if d.frozen_after != self.frozen:
            self.pending = d.frozen_after
        elif self.cache_in_due(step):
            self.pending_cache = True
        self.log(d.to_dict())

    def guard_loss(self) -> float:
        """The validation loss of the guard's micro-batches (``elastic.guard_batches``) through
        the layout in force, every node taking part (:func:`pipelined_evaluate_sum`)."""
        t0 = time.perf_counter()
        st, node, cfg = self.st, self.node, self.cfg
        p2p = Activations(node.control.rank_of, GUARD_TAG, node.control.check_generation)
        part = pipelined_evaluate_sum(st.model, node.rank, st.sched.placement, node.val_src,
                                      range(cfg.elastic.guard_batches), cfg.train.micro_batch, p2p.send, p2p.recv)
        total = torch.tensor(part, dtype=torch.float64)
        node.control.sync(dist.all_reduce, total)
        self.guard_s += time.perf_counter() - t0
        return float(total[0] / total[1])

    def log(self, rec: dict[str, Any]) -> None:
        if self.node.rank == min(self.node.control.alive):
            append_log(Path(self.node.run_dir) / "elastic.jsonl", rec)

    # ---- transitions ----------------------------------------------------------------------

    def apply_pending(self) -> None:
        """At the start of an iteration, before any work: the pending transition, if any."""
        if self.pending is not None:
            if self.pending != self.frozen:
                self._transition(self.pending)
            self.pending = None
        if self.pending_cache:
            self.pending_cache = False
            self._transition(self.frozen, cache_in=True)
        if self.prefix_due:
            self.prepare_prefix()

    def _transition(self, F: int, cache_in: bool = False) -> None:
        """Every node: plan the layout for ``F`` frozen layers, move the state, commit, switch.
        ``cache_in``: ``F`` is the depth in force, its prefix recomputed so far; the layout is
        planned again with the prefix cached (and prefilled), in place when AutoPipe keeps the
        layout (:meth:`_cache_in_place`)."""
        st, node, cfg = self.st, self.node, self.cfg
        t0 = time.perf_counter()
        pl = st.sched.placement
        if any(not p for p in pl):
            self.log({"step": st.it, "action": "transition_skipped", "frozen": F,
                       "reason": f"placement {pl}: a stage has no node, so its state cannot move"})
            return
        held = list(st.strats.values())      # (a node may serve several stages before)
        sizes: dict[str, int] = {}
        for _, blob in node.control.gather_bytes(json.dumps(stage_sizes(st.model, st.opt, held)).encode()):
            sizes.update(json.loads(blob.decode()))
        keep = {mb.id: mb.originator for mb in st.sched.micro_batches}   # originators keep their windows
        new, evidence, cached, gain = self._plan(F, pl, sizes, keep, cache_in)
        if cache_in and not cached:
            self.log({"step": st.it, "action": "prefill_declined", "frozen": F,
                       "prefill_gain": None if gain is None else round(gain, 3)})
            return
        if cache_in and list(new.counts) == self.counts and [list(p) for p in new.placement] == [list(p) for p in pl]:
            self._cache_in_place(gain, t0)
            return
        old = ElasticLayout.of(self.frozen, self.counts, 1, len(st.order), pl)
        plan = transfer_plan(sizes, old, new)
        node.hook(st.ph.name, st.it, "transition", st)
        blobs = move_state(node.rank, plan, node.control.rank_of, st.model, st.opt, held, node.control.check_generation)
        stage = {n: s for s, p in enumerate(new.placement) for n in p}.get(node.rank)
        tensors, record, scalars = gather_state(st.model, st.opt, held, blobs,
                                                stage_names(sizes, new.partition, stage))
        model = opt = None
        if stage is not None:
            # (the config's rule: a node that served no stage has no strategy to ask)
            model, opt = build_stage(cfg, stage, new.partition, F, tensors, record, update_rule_of(cfg.dp))
        node.control.sync(dist.barrier)                # commit: every node holds its new stage
        moved_s = time.perf_counter() - t0
        cost = layout_cost(self.base_cost, cfg.model, new.counts, F, hit=1.0 if cached else 0.0)
        sched = self._routes(layout_schedule(new.placement, sorted(st.order), cfg.train.skip_ratio,
                                             cfg.train.max_swaps, self.memory, cfg.train.seed + st.it, keep),
                             cost)
        self._switch(sched, stage, model, opt, cost, F, new.counts, tensors, scalars, cached)
        rec = {"step": st.it, "action": "transition", "frozen_before": old.frozen, "frozen_after": F,
               "stages_before": old.n_stages, "stages_after": new.n_stages, "counts": new.counts,
               "placement": new.placement, "memory": sched.memory, "prefix_cached": cached,
               "prefill_gain": None if gain is None else round(gain, 3), "transfer_bytes": sum(t.nbytes for t in plan),
               "transfer_messages": len(plan), "move_s": round(moved_s, 6), "autopipe": evidence,
               "routes": sched.method, "schedule": sched.to_dict(), "seconds": round(time.perf_counter() - t0, 6)}
        self.layouts.append({**new.to_dict(), "step": st.it})
        self._record_transition(rec)
        print(f"skiptrain node {node.rank}: iteration {st.it}: {old.frozen} -> {F} frozen layers; stages "
              f"{old.counts} -> {new.counts}, placement {new.placement}; "
              f"{len(plan)} messages, {rec['transfer_bytes']} bytes, {rec['seconds']:.3f} s", file=sys.stderr,
              flush=True)

    def _record_transition(self, rec: dict[str, Any]) -> None:
        self.transitions.append(rec)
        self.st.record.setdefault("transitions", []).append({k: v for k, v in rec.items() if k != "autopipe"})
        self.log(rec)

    def _cache_in_place(self, gain: float | None, t0: float) -> None:
        """Every node, when the layout planned with the prefix cached is the one in force: only
        the cost model changes (the prefix read from the cache), the routes are planned again for
        it, and the prefill runs before the next iteration; no state moves.  Logged as a
        transition of the same depth."""
        st, node, F = self.st, self.node, self.frozen
        cost = layout_cost(self.base_cost, self.cfg.model, self.counts, F, hit=1.0)
        sched = self._routes(st.sched, cost)      # a collective: a failure leaves everything as it was
        self.prefix_cached = self.prefix_due = True
        node.layout.adopt(st, sched, cost=cost)
        pl = st.sched.placement
        rec = {"step": st.it, "action": "transition", "frozen_before": F, "frozen_after": F,
               "stages_before": len(pl), "stages_after": len(pl), "counts": self.counts, "placement": pl,
               "memory": st.sched.memory, "prefix_cached": True,
               "prefill_gain": None if gain is None else round(gain, 3), "transfer_bytes": 0,
               "transfer_messages": 0, "move_s": 0.0, "routes": st.sched.method, "schedule": st.sched.to_dict(),
               "seconds": round(time.perf_counter() - t0, 6)}
        self._record_transition(rec)

    def _plan(self, F: int, pl: list[list[int]], sizes: dict[str, int], keep: dict[int, int],
              cache_in: bool = False):
        """AutoPipe + AutoDP for ``F`` frozen layers over the nodes alive.  When a prefill is due
        (:meth:`will_prefill`, and at a changed depth only with ``elastic.prefill_hold`` 0;
        ``cache_in``: the depth held that long) the layout is planned both with the prefix cached and recomputed,
        and the cached one is taken when what it saves until the end of the phase is at least
        ``elastic.prefill_min_gain`` times its prefill's time (:meth:`prefill_gain`).  Returns
        (layout, AutoPipe's evidence, cached, the gain or None)."""
        st, node, cfg = self.st, self.node, self.cfg

        def plan(cached: bool):
            return plan_layout(cfg.model, F, self.counts, pl, list(node.control.alive), sizes, self.start_stages, st.gb,
                               len(st.order), st.it, hit=1.0 if cached else 0.0, prefix_cached=cached,
                               start_groups=self.start_groups)

        if not (self.will_prefill(F, st.it) and (cache_in or not cfg.elastic.prefill_hold)):
            return (*plan(False), False, None)
        on, off = plan(True), plan(False)
        gain = self.prefill_gain(F, on, off, keep)
        if gain >= cfg.elastic.prefill_min_gain:
            return (*on, True, gain)
        return (*off, False, gain)

    def _routes(self, sched: Schedule, cost) -> Schedule:
        """The planner's routes for ``sched``'s placement (lowest node plans, every node gets them)
        when skipping is on and the phase has a topology and cost model; else ``sched``."""
        st, node = self.st, self.node
        if sched.skip_ratio <= 0 or st.topo is None or cost is None:
            return sched
        adopted = None
        if node.control.is_root():
            try:
                new, cur, ns = replan_routes(sched, st.topo, cost, self.cfg, max_evals=ROUTE_EVALS)
            except Exception as e:  # noqa: BLE001 - the constructed routes stay in force
                new, cur, ns = None, None, None
                print(f"skiptrain node {node.rank}: route planning for the new layout failed: {e}", file=sys.stderr,
                      flush=True)
            if new is not None:
                adopted = new, {"trigger": "freeze", "simulated_current_s": cur, "simulated_new_s": ns}
        new, _ = broadcast_schedule(node.control, adopted)
        return new if new is not None else sched

    def _switch(self, sched: Schedule, stage, model, opt, cost, F: int, counts: list[int],
                tensors: dict[str, torch.Tensor] | None, scalars: dict[str, Any] | None,
                prefix_cached: bool) -> None:
        """Every node switches to the new layout together (groups are a collective).  The stage-0
        nodes get a prefix runner (through this node's activation cache when it is on); its depth
        and any prefill are set before the next iteration (:meth:`prepare_prefix`)."""
        st, node = self.st, self.node
        groups, strat = node.layout.stage_groups(sched, stage, model, None)
        if strat is not None and scalars:
            load_sync(strat, sync_state(tensors or {}, strat, self.frozen), scalars)
        node.layout.drop_groups(st.groups)
        if st.drift is not None:    # drift re-planning goes on, measured against the new layout
            st.drift_state = {"home": [list(p) for p in sched.placement]}
        st.record["stage"] = stage
        self.frozen, self.counts = F, list(counts)
        self.runner = None
        self.prefix_cached = prefix_cached
        if model is not None and stage == 0 and F > 0:
            cache = self.open_cache() if self.cache_on(F) else None
            # a shared cache is written by the prefill only (each window by one originator)
            self.runner = PrefixRunner(model, cache, store=cache is None or not cache.shared)
        self.prefix_due = F > 0
        node.layout.adopt(st, sched, cost=cost, stage=stage, model=model, opt=opt, strat=strat, groups=groups)

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a job checkpoint carries (``position["elastic"]``): a copy, taken now (an
        asynchronous checkpoint writes it while the next iteration's transition goes on)."""
        return copy.deepcopy({
            "frozen": self.frozen, "counts": self.counts, "pending": self.pending,
            "start_stages": self.start_stages, "start_groups": self.start_groups,
            "rule": self.rule.state_dict(), "layouts": self.layouts, "transitions": self.transitions,
            "schedule": self.st.sched.to_dict(), "guard_s": self.guard_s,
            "prefix_cached": self.prefix_cached, "pending_cache": self.pending_cache})

    def _resume(self, path: str) -> None:
        """Before the node loads its state from checkpoint ``path``: the rule, the layout
        history, and the layout in force then (this node's stage built for it, empty)."""
        saved = CheckpointReader(path).state.get("elastic")
        if not saved:
            return
        st, node = self.st, self.node
        self._load_rule(saved)
        if node.rank == min(node.control.alive):
            truncate_metrics(Path(node.run_dir) / "elastic.jsonl", int(node.job.resume["iteration"]), log_position)
        F, counts = int(saved["frozen"]), list(saved["counts"])
        if F == self.frozen and counts == self.counts and len(self.layouts) == 1:
            return                      # (no transition before it: the job's own layout)
        sched = Schedule.from_dict(saved["schedule"])
        cached = bool(saved.get("prefix_cached"))
        cost = layout_cost(self.base_cost, self.cfg.model, counts, F, hit=1.0 if cached else 0.0)
        if sorted(sched.nodes()) != sorted(st.sched.nodes()):
            # saved by other nodes (some failed or joined since the job started): the same
            # stages on this job's nodes, routes planned again
            c = self.cfg
            placement = reseat(sched.placement, sorted(st.sched.nodes()))
            sched = self._routes(layout_schedule(placement, sorted(st.order), c.train.skip_ratio, c.train.max_swaps,
                                                 self.memory, c.train.seed + int(node.job.resume["iteration"])), cost)
        stage = sched.stage_of().get(node.rank)
        model = opt = None
        if stage is not None:
            model = node.layout.build_stage(stage, sched.memory, Partition(tuple(counts)))
            opt = build_optimizer(model.named_parameters(), self.cfg.train, update_rule_of(self.cfg.dp))
            freeze_parameters(model, F)
        self._switch(sched, stage, model, opt, cost, F, counts, None, None, cached)

    def _load_rule(self, saved: dict[str, Any]) -> None:
        """The rule's state, the layout history, a pending transition and the start's layout
        (AutoPipe's memory budget: a joiner's phase schedule is the layout in force, not the
        start's) from ``state_dict()``."""
        self.rule.load_state_dict(saved["rule"])
        self.start_stages = int(saved.get("start_stages", self.start_stages))
        self.start_groups = [list(g) for g in saved.get("start_groups", self.start_groups)]
        self.layouts, self.transitions = list(saved["layouts"]), list(saved["transitions"])
        self.pending, self.guard_s = saved.get("pending"), float(saved.get("guard_s", 0.0))
        self.pending_cache = bool(saved.get("pending_cache"))

    def take_layout(self, saved: dict[str, Any]) -> None:
        """A node joining the job: the rule's state and the layout in force, ``state_dict()`` of
        a live node (this node's stage was built for that partition and frozen depth; the caller
        builds the executor after this).  A joiner on stage 0 recomputes the frozen prefix (its
        state arrives after this, so it has no prefix to fingerprint yet); from the next layout
        change on it serves the prefix like every originator."""
        st = self.st
        self._load_rule(saved)
        self.frozen, self.counts = int(saved["frozen"]), list(saved["counts"])
        self.prefix_cached = bool(saved.get("prefix_cached"))
        st.cost = layout_cost(self.base_cost, self.cfg.model, self.counts, self.frozen,
                              hit=1.0 if self.prefix_cached else 0.0)
        if st.model is not None and st.stage == 0 and self.frozen > 0:
            self.runner = PrefixRunner(st.model)
            self.runner.set_frozen(self.frozen)
