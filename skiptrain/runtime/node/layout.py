"""The layout in force on a node, and the one way to change it.

A layout is the schedule (placement and routes) with what a node builds from it: the stage map
every transport reads, the process group of each replicated stage, this node's sync strategy
per served stage, its one optimizer, the executor and its activation codecs.  Every switch (a
freeze transition, a recovery, a join, a drift re-plan, a resume) builds the parts that change
(groups are collectives: every node builds them in the same order) and then calls
:meth:`NodeLayout.adopt`, which makes the schedule the one in force.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from .state import PhaseState

_KEEP = object()


class NodeLayout:
    """Builds a node's stages, groups, strategies, optimizer and executor; :meth:`adopt` switches."""

    def __init__(self, node):
        self.node = node
        self.control = node.control
        # the phase's emulation seam (:mod:`skiptrain.runtime.emulation`), set when a phase begins
        self.emulation = None

    def adopt(self, st, sched, *, cost=_KEEP, publish: bool = True, **parts) -> None:
        """Make ``sched`` the layout in force on this node: ``parts`` (any of ``model``,
        ``stages``, ``stage``, ``opt``, ``strats``, ``strat``, ``groups``: built by the caller,
        collectively where they are groups) and ``cost`` replace those of ``st``; then the stage
        map, the executor and its codecs follow the schedule, and (``publish``) the lowest node
        tells the coordinator.  Nothing here is a collective: callers build the parts that
        change (collectively, in the same order on every node) before they call it."""
        for name in ("model", "stages", "stage", "opt", "strats", "strat", "groups"):
            if name in parts:
                setattr(st, name, parts.pop(name))
        if parts:
            raise TypeError(f"adopt: unknown parts {sorted(parts)}")
        if cost is not _KEEP:
            st.cost = cost
            if st.drift is not None:    # drift re-planning goes on, measured against the new layout
                st.drift.cost = cost
        st.sched = sched
        self.node.stage_of = sched.stage_of()
        st.ex = self.executor(st)
        if publish:
            self.control.link.publish_sched(sched, st.idx, st.cost)

    def build_stage(self, stage: int | list[int], in_flight: int, partition=None):
        """Stage ``stage`` (or the stages listed) of the model (under ``partition``, default the
        configured one) on this node's device, in training mode (the seed's values, or
        ``train.init_from``'s tensors of those stages): the memory estimate with ``in_flight``
        micro-batches printed, refused in one line when it cannot fit."""
        from ...model.device import build_on_device

        cfg = self.node.cfg
        torch.manual_seed(cfg.train.seed)
        stages = [stage] if isinstance(stage, int) else list(stage)
        model, est = build_on_device(cfg.model, stages, cfg.train.seed, self.node.device, cfg.train.micro_batch,
                                     in_flight, cfg.train.precision, partition)
        print(f"skiptrain node {self.node.rank}: {self.node.device}, {cfg.train.precision}: {est.describe()}",
              file=sys.stderr, flush=True)
        if cfg.train.init_from:
            from ...checkpoint.hf_import import load_hf_weights
            load_hf_weights(model, cfg.train.init_from)
        model.train()
        return model

    def build_phase_model(self, stages: list[int], in_flight: int, frozen: dict | None):
        """This node's stages for a new phase: built (:meth:`build_stage`), the job's pre-trained
        tensors by global name when it has them, warmed up, and with ``frozen`` (a freezing job's
        layout in force: ``counts``, ``frozen``) partitioned and frozen as the swarm is."""
        from ...model.partition import Partition
        from ..transition import freeze_parameters

        node = self.node
        model = self.build_stage(stages, in_flight, Partition(tuple(frozen["counts"])) if frozen else None)
        if node.job.meta.get("init_weights"):     # a pre-trained start (tensors by global name)
            init = torch.load(node.job.meta["init_weights"], weights_only=True)
            model.load_state_dict({k: v for k, v in init.items() if k in model.state_dict()})
        for stage in stages:
            warm_up(model, stage, node.cfg, node.device)
        if frozen:
            freeze_parameters(model, int(frozen["frozen"]))
        return model

    def optimizer(self, model, strat):
        """The one optimizer (``skiptrain.optim``) over this node's stage, of the rule its sync
        strategy feeds (None without a stage)."""
        from ...optim import build_optimizer

        return None if model is None else build_optimizer(model.named_parameters(), self.node.cfg.train,
                                                           strat.update_rule)

    def hosted_groups(self, sched, stages: list[int], model, old: dict, step_count: int | None = None):
        """One group per stage with replicas (every rank creates every group, same order; backend
        ``dp.backend``: gloo, or NCCL between CUDA devices), and this node's DP strategy on the
        group of each stage it serves, over that stage's parameters that train (frozen ones have
        no gradient to sync), keeping the state of the strategy ``old[stage]`` where given.
        Returns (groups, {stage: strategy})."""
        from ...dp import make_strategy

        timeout = timedelta(seconds=self.node.job.rt.timeout_s)
        backend = self.node.cfg.dp.backend
        groups = {s: dist.new_group(sorted(self.control.rank_of[n] for n in p), timeout=timeout, backend=backend)
                  for s, p in enumerate(sched.placement) if p}
        strats = {}
        for s in stages if model is not None else ():
            named = model.named_parameters() if len(stages) == 1 else model.stage_named_parameters(s)
            strats[s] = make_strategy(self.node.cfg.dp, [(n, p) for n, p in named if p.requires_grad], groups[s],
                                      self.node.cfg.train, link=self.emulation.sync_link(sched.placement[s]),
                                      wait=self.control.wait_sync if backend == "gloo" else None)
            if old.get(s) is not None:
                sd = old[s].state_dict()
                if step_count is not None:
                    sd["step"] = step_count
                strats[s].load_state_dict(sd)
        return groups, strats

    def stage_groups(self, sched, stage, model, old_strat, step_count: int | None = None):
        """:meth:`hosted_groups` for a node serving one stage (or none): (groups, strategy)."""
        groups, strats = self.hosted_groups(sched, [] if stage is None else [stage], model,
                                             {} if old_strat is None else {stage: old_strat}, step_count)
        return groups, strats.get(stage)

    def executor(self, st: "PhaseState"):
        """The executor of ``st``'s stages, timed and paced by the phase's emulation seam."""
        from ..executor import Executor

        node = self.node
        st.emulation.cost = st.cost        # tasks last what the layout in force costs (a freeze changes it)
        st.emulation.pace(node.tr)
        node.tr.codec_of = self.codec_of(st)
        return Executor(node.rank, node.tr, st.model, st.emulation.finish, node.job.rt.timeout_s,
                        node.describe, check=self.check_payload,
                        embed=st.elastic.embed if st.elastic is not None else None)

    def check_payload(self, m) -> None:
        """A received pipeline message has the shape, dtype and finite values its kind needs
        (:func:`~skiptrain.runtime.recovery.check_payload`), else it names its sender."""
        from ..recovery import check_payload

        c = self.node.cfg
        check_payload(m.kind, m.tensor, m.src, (c.train.micro_batch, c.model.seq_len, c.model.d_model), m.mb,
                      self.node.rank)

    def codec_of(self, st: "PhaseState"):
        """The activation encoding of each of this node's outgoing links (the cost model's choice;
        without one, to a node outside its topology, or between two of its own stages: the
        precision's plain encoding)."""
        from ...schedule.actcodec import plain_codec

        cost, topo, me = st.cost, st.topo, self.node.rank
        plain = plain_codec(self.node.cfg.train.precision)
        if cost is None or topo is None or me >= topo.n:
            return lambda dst: plain
        return lambda dst: cost.hop_codec(topo, me, dst) if dst < topo.n and dst != me else plain

    def drop_groups(self, groups: dict) -> None:
        """Destroy the stage groups ``groups`` this node is a member of (no work pending on them:
        after the phase's last barrier, or a layout switch's commit)."""
        for g in groups.values():
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)


def warm_up(model, stage: int, cfg, device: torch.device) -> None:
    """One throw-away forward and backward of this node's pieces on its device and in its
    precision (first calls of torch kernels and the autograd engine are slow), so the timed
    iterations measure the steady state."""
    from ...model.device import autocast

    shape = (cfg.train.micro_batch, cfg.model.seq_len)
    with autocast(device, cfg.train.precision):
        if stage == 0:
            x = torch.zeros(shape, dtype=torch.long, device=device)
            h = model.embed(x)
            leaf = h.detach().requires_grad_(True)
            model.loss(model.logits(leaf), x).backward()
            h.backward(leaf.grad)
        else:
            h = torch.zeros(*shape, cfg.model.d_model, requires_grad=True, device=device)
            out = model.run_stage(stage, h)
            out.backward(torch.ones_like(out))   # a non-scalar backward, as in the pipeline (first one: slow)
    for p in model.parameters():
        p.grad = None

