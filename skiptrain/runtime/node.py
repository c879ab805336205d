"""The node process: ``python -m skiptrain.runtime.node --job JOB.json``.

Joins the run through the standard torch.distributed environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), so the same entry point serves the local launcher
(:mod:`skiptrain.runtime.launcher`, which hosts the rendezvous store itself and sets
``SKIPTRAIN_STORE_HOSTED=1``) and ``torchrun`` on one or several hosts (rank 0, or torchrun's
agent when ``TORCHELASTIC_USE_AGENT_STORE=True``, hosts the store).  Rank ``r`` is node ``r`` of
every schedule.

Device and precision: each node computes on one device (:meth:`Node.pick_device`: its entry of
``runtime.devices``, else ``train.device`` with ``cuda`` meaning ``cuda:LOCAL_RANK`` modulo the
GPUs it sees, so several nodes may share one GPU) and under ``train.precision`` (bf16 autocast
around every forward and backward, fp32 weights, gradients and optimizer state); its messages
cross gloo through pinned host buffers (:mod:`.transport`).

Per phase of the job (:mod:`skiptrain.runtime.job`): build only this node's stage on its device
(:func:`~skiptrain.model.device.build_on_device`: memory estimate printed, refusal of a stage
that cannot fit, meta build, materialisation; ``train.init_from`` loads the stage's tensors
only), a process group per stage for
the data-parallel sync (strategy from ``cfg.dp`` via :func:`skiptrain.dp.strategy.make_strategy`;
gloo, or NCCL with ``dp.backend=nccl``),
then per iteration: a common start time, the executor (:mod:`.executor`), one sync + optimizer
step weighted by the micro-batches this node processed, and the timeline.  Rank 0 appends the
iteration's loss and measured time to ``RUN_DIR/metrics.jsonl``.

Outputs under ``RUN_DIR``: ``phases/<name>/node<r>.json`` (timeline events per iteration,
stats), ``parts/stage<s>.safetensors`` (``save_weights``), ``phases/<name>/dump/node<r>.pt``
(``dump``: parameters and pre-sync summed gradients), ``errors/node<r>.json`` on failure.

Failure semantics: any error, or a peer failure seen by the heartbeat, writes
``errors/node<r>.json`` naming the node at fault and exits the process at once (``os._exit``)
with :data:`~.failure.EXIT_FAILED` / :data:`~.failure.EXIT_PEER_FAILED`; gloo waits are bounded
by ``job.rt.timeout_s``.  The launcher (or torchrun) then stops the other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .failure import (EXIT_FAILED, EXIT_PEER_FAILED, Heartbeat, NodeFailure, abort_process,
                      set_parent_death_signal, write_error)
from .job import Job, Phase
from .membership import coordinator_key, open_value, read_raw, set_member


# columns of the per-iteration stats every node gathers (then the drift monitor's, the freeze
# rule's layer norms, the checkpoint digest and the re-plan flag): loss sum, losses, iteration
# end, overruns, overrun s, max in flight, sync payload bytes, received bytes, sync seconds,
# pipeline end (the last compute task, before the sync and the optimizer step), CPU seconds
# of this process since the common start, start delay (rank 0's clock to this node's receipt)
N_STATS = 12

# every iteration starts at rank 0's clock plus a margin that lets the start time reach every
# node first: twice the slowest receipt of the last START_WINDOW iterations, within these bounds
START_MARGIN_S = (0.01, 0.2)
START_WINDOW = 10


STOP_KEY = "stop"     # set by the launcher (Ctrl-C / SIGTERM): end at the next iteration boundary
EVAL_TAG = 14          # activations of an in-loop validation pass (the guard uses 13, state moves 11, 12)


class StopRequested(Exception):
    """Every node agreed, at an iteration boundary, that the launcher asked to stop."""


@dataclass
class PhaseState:
    """Everything one node holds while it runs a phase (what a layout change replaces).

    ``stages``: the stages this node serves (ascending; empty: none), all in ``model``, each
    with its sync strategy in ``strats`` and one optimizer ``opt`` over them.  ``stage`` and
    ``strat`` name the one stage of a node that serves one (what recovery, joins and freezing
    handle: the config refuses them for a node serving several)."""
    ph: Phase
    idx: int
    sched: Any
    stages: list[int]
    model: Any
    strats: dict[int, Any]
    opt: Any
    groups: dict
    cost: Any
    topo: Any
    speed: float
    padding: Any
    out_dir: Path
    order: dict[int, int]
    record: dict
    replan_pending: bool = False
    ex: Any = None
    gb: int = 0
    it: int = 0
    cursor: int = 0
    drift: Any = None
    drift_state: dict = field(default_factory=dict)
    elastic: Any = None      # runtime.freezing.SwarmFreezing when elastic.enabled

    @property
    def stage(self) -> int | None:
        return self.stages[0] if self.stages else None

    @stage.setter
    def stage(self, stage: int | None) -> None:
        self.stages = [] if stage is None else [stage]

    @property
    def strat(self):
        return self.strats.get(self.stages[0]) if self.stages else None

    @strat.setter
    def strat(self, strat) -> None:
        self.strats = {self.stages[0]: strat} if strat is not None and self.stages else {}

    def slot(self, node: int) -> int:
        """``node``'s replica position in its stages (the same in each: see
        :func:`skiptrain.config.node_stage_placement`)."""
        return self.sched.placement[self.stages[0]].index(node)


@dataclass
class Attempt:
    """One attempt at an iteration: how far it got (for recovery)."""
    step_count: int
    lr: float
    committed: bool = False
    stepped: bool = False
    samples: list[int] = field(default_factory=list)
    entry: dict | None = None
    res: Any = None
    outcome: Any = None
    start_delay: float = 0.0     # seconds from rank 0's start stamp to this node's receipt
    cpu0: float = 0.0            # this process's CPU clock at the common start
    norm_cols: slice | None = None   # the freeze rule's layer norms in the gathered stats


# CPU-second cap on the planner when it re-plans the routes after a recovery generation, a join
# or a drift past the threshold (rank 0 plans; the swarm waits for it once)
RECOVERY_PLAN_TIME_S = 2.0


class Node:
    def __init__(self, job: Job, rank: int, world: int, addr: str, port: int, store=None):
        from ..data.dataset import TokenDataset
        # ``store`` given: a node joining a running job (rank = the id it was handed, see main)
        self.joining: dict | None = None
        self._pre_join: tuple[int, object] | None = None   # (joiner, schedule before its join)
        self.job, self.rank, self.world = job, rank, world
        self.stopped = False           # the launcher asked to stop; the phase ended early
        self.run_dir = Path(job.run_dir)
        self.err_path = self.run_dir / "errors" / f"node{rank}.json"
        self.stage_of: dict[int, int] = {}
        hosted = os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1" or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.store = store or dist.TCPStore(addr, port, world, is_master=(rank == 0 and not hosted),
                                            timeout=timedelta(seconds=max(job.rt.timeout_s, 60.0)),
                                            wait_for_workers=False)
        # membership: node ids never change; ranks are positions in the sorted alive list
        self.gen = 0
        self.coord_key: bytes | None = None     # the coordinator's member key (a run with a secret)
        self._forged_stop = False
        self.alive = list(range(world))
        self._rank = {n: n for n in self.alive}
        # a second client connection for the heartbeat and the membership watch: store calls of
        # one client are serialised, and a blocking get of the main thread (gloo rendezvous while
        # re-forming groups) must not stall the heartbeat
        self.hb_store = dist.TCPStore(addr, port, world, is_master=False,
                                      timeout=timedelta(seconds=max(job.rt.timeout_s, 60.0)),
                                      wait_for_workers=False)
        self.hb = Heartbeat(self.hb_store, rank, world, job.rt.heartbeat_s, job.rt.timeout_s,
                            self._peer_failed_soft if job.rt.recover else self._peer_failed,
                            describe=self.describe).start()
        if job.rt.recover:
            # admission by challenge-response before any process group; then generation 0's
            # alive set (the admitted nodes) decides the ranks
            from .join import JoinRefused, node_join, secret_from_env, wait_for_join, wait_for_placement
            from .recovery import wait_record

            set_member(self.store, rank, f"pid/{rank}", str(os.getpid()))  # signed: a restarted coordinator fences by PID
            secret = secret_from_env()
            self.coord_key = coordinator_key(secret)   # it signs the generations
            node_join(self.store, rank, secret, max(60.0, job.rt.timeout_s))
            if store is not None:
                # joining a running job: wait until the coordinator placed this node (a join
                # generation, switched to by every node at its next iteration boundary)
                self.gen, info = wait_for_placement(self.store, rank, secret, max(600.0, job.rt.timeout_s))
                self.joining = {"gen": self.gen, "schedule": info["schedule"], "phase": int(info["phase"]),
                                "stage": int(info["join"][str(rank)]), "choice": info.get("choice")}
                print(f"skiptrain node {rank}: admitted; joins generation {self.gen} as a replica of stage "
                      f"{self.joining['stage']} ({(info.get('choice') or {}).get('rule')})", file=sys.stderr,
                      flush=True)
            else:
                info = wait_record(self.store, 0, self.coord_key, max(60.0, job.rt.timeout_s))
            self.alive = info["alive"]
            if rank not in self.alive:
                raise JoinRefused(f"node {rank}: not admitted to generation {self.gen}", node=rank)
            if self.joining is not None and wait_for_join(self.store, rank, secret, f"join/go/{self.gen}",
                                                          max(600.0, job.rt.timeout_s)) is None:
                raise JoinRefused(f"node {rank}: placed in generation {self.gen}, but its nodes never took "
                                  "the join up", node=rank)
            self._rank = {n: i for i, n in enumerate(self.alive)}
            self.hb.membership.alive = set(self.alive)
        prefix = f"g{self.gen}/pg" if self.gen else "pg"
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, self.store), rank=self._rank[rank],
                                world_size=len(self.alive), timeout=timedelta(seconds=job.rt.timeout_s))
        # a separate gloo context for pipeline messages, so collectives never share tags with them
        self.p2p_group = dist.new_group(list(range(len(self.alive))), timeout=timedelta(seconds=job.rt.timeout_s))
        self.hb.arm()
        self.ds = TokenDataset.open(job.data_path)
        self._use_config(None)
        self.device = self.pick_device()
        self.tr = self.make_transport()
        self.watch = None
        self._any_committed = False
        self.start_margin = START_MARGIN_S[1]
        self._start_delays: deque[float] = deque(maxlen=START_WINDOW)
        self._last_gnorm: dict[int, float] = {}   # last pre-sync gradient norm per stage (CheckFree weights)
        if job.rt.recover:
            from .recovery import GenerationWatch
            self.watch = GenerationWatch(self.hb_store, job.rt.heartbeat_s, self._membership_changed,
                                         self.coord_key)
            self.watch.gen = self.gen
            self.watch.start()
            if self.joining is None:
                self._ack()

    def _use_config(self, phase_config: dict | None) -> None:
        """The job's config with the phase's overrides; the data sources that depend on it."""
        from ..config import apply_dict, config_from_dict
        from ..data.loader import SampleSource

        self.cfg = config_from_dict(self.job.config)
        if phase_config:
            apply_dict(self.cfg, phase_config, "phase config")
        if self.cfg.train.init_from:     # a pre-trained model decides the shapes
            from ..checkpoint.hf_import import model_config_for_data
            self.cfg.model = model_config_for_data(self.cfg.train.init_from, self.cfg.model, self.ds.vocab_size)
        else:
            self.cfg.model.vocab_size = self.ds.vocab_size
        self.cfg_json = self.cfg.to_dict()    # what every checkpoint of the phase records (set only here)
        self.src = SampleSource(self.ds.tokens("train"), self.cfg.model.seq_len, seed=self.cfg.train.seed,
                                 name=self.ds.split_name("train"))
        self.val_src = SampleSource(self.ds.tokens("val"), self.cfg.model.seq_len, shuffle=False,
                                     name=self.ds.split_name("val"))

    def pick_device(self) -> torch.device:
        """This node's device (:func:`device_of_node`), made current when it is a GPU."""
        dev = device_of_node(self.cfg, self.rank, int(os.environ.get("LOCAL_RANK", self.rank)))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return dev

    def make_transport(self):
        from .transport import P2PTransport

        tr = P2PTransport(self.rank, self.p2p_group, stage_of=lambda n: self.stage_of.get(n, -1),
                          rank_of=self._rank.__getitem__, node_of=self.alive.__getitem__, device=self.device)
        return tr

    def build_stage(self, stage: int | list[int], in_flight: int, partition=None):
        """Stage ``stage`` (or the stages listed) of the model (under ``partition``, default the
        configured one) on this node's device, in training mode (the seed's values, or
        ``train.init_from``'s tensors of those stages): the memory estimate with ``in_flight``
        micro-batches printed, refused in one line when it cannot fit."""
        from ..model.device import build_on_device

        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        stages = [stage] if isinstance(stage, int) else list(stage)
        model, est = build_on_device(cfg.model, stages, cfg.train.seed, self.device, cfg.train.micro_batch,
                                     in_flight, cfg.train.precision, partition)
        print(f"skiptrain node {self.rank}: {self.device}, {cfg.train.precision}: {est.describe()}",
              file=sys.stderr, flush=True)
        if cfg.train.init_from:
            from ..checkpoint.hf_import import load_hf_weights
            load_hf_weights(model, cfg.train.init_from)
        model.train()
        return model

    def _peer_failed_soft(self, node: int, reason: str) -> None:
        """Recovery mode: the coordinator decides membership; only a lost store stops the node."""
        if node == -1:
            self._peer_failed(node, reason)

    def _membership_changed(self, gen: int) -> None:
        """A new generation: make the executor abandon the current iteration at once.  The watch
        thread may report a generation this node already re-formed into (it recovered from its own
        transport error meanwhile): that one is ignored, or it would abort the re-run iteration."""
        from .transport import TransportError

        tr = self.tr                   # read first: _regroup sets self.gen before the new transport
        if gen <= self.gen:
            return
        tr.inbox.put(TransportError(f"node {self.rank}: membership generation {gen} announced; "
                                    "abandoning the iteration", peer=None))

    def _regroup(self, gen: int, alive: list[int]) -> None:
        """Destroy every process group and re-create them over ``alive`` on the store prefix
        ``g<gen>/``.  Threads blocked in the old groups are abandoned (never joined)."""
        timeout = timedelta(seconds=self.job.rt.timeout_s)
        from .recovery import abandon_process_groups

        abandon_process_groups()   # not destroy_process_group(): its shutdown() can block (see there)
        self.gen = gen
        self.alive = sorted(alive)
        self._rank = {n: i for i, n in enumerate(self.alive)}
        self.hb.membership.alive = set(self.alive)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{gen}/pg", self.store),
                                rank=self._rank[self.rank], world_size=len(self.alive), timeout=timeout)
        self.p2p_group = dist.new_group(list(range(len(self.alive))), timeout=timeout)
        self.tr = self.make_transport()
        if self.watch is not None:
            self.watch.gen = gen

    def describe(self, n: int) -> str:
        s = self.stage_of.get(n)
        return f"node {n}" + (f" (stage {s})" if s is not None else "")

    def _peer_failed(self, node: int, reason: str) -> None:
        write_error(self.err_path, self.rank, NodeFailure(f"node {self.rank}: {reason}", node), node)
        abort_process(EXIT_PEER_FAILED)

    def hook(self, phase: str, iteration: int, where: str, state: "PhaseState | None" = None) -> None:
        """A point where a wrapper of the node may act (fault injection in the tests,
        ``skiptrain/runtime/faults.py``): ``where`` is ``start`` (an iteration begins), ``after_pipeline``
        (its pipeline tasks are done, before the commit) or ``recover`` (a recovery attempt).
        The node itself does nothing here."""

    # ---- one phase -------------------------------------------------------------------------

    def run_phase(self, ph: Phase, phase_idx: int = 0) -> None:
        """Run every iteration of one phase: set up the stage, loop (recovering from failures in
        recovery mode), then write the phase's outputs."""
        st = self._begin_phase(ph, phase_idx)
        try:
            while st.it < ph.iterations:
                self._run_iteration(st)
        except StopRequested:
            self.stopped = True
            st.record["stopped_at"] = st.it
            print(f"skiptrain node {self.rank}: stop requested: ending after iteration {st.it} of phase "
                  f"{ph.name}", file=sys.stderr, flush=True)
        finally:
            st.record["stages"] = list(st.stages)      # the stages served at the end
            (st.out_dir / f"node{self.rank}.json").write_text(json.dumps(st.record))
        self._end_phase(st)

    def _begin_phase(self, ph: Phase, phase_idx: int) -> "PhaseState":
        """Build this node's stage, groups, strategy, optimizer and executor for ``ph``; a node
        joining a running job also takes its state and position from a live replica here."""
        from ..net.topology import Topology
        from ..schedule.cost import CostModel
        from ..schedule.schedule import Schedule
        from .wan import ComputePadding

        if ph.config or phase_idx:
            self._use_config(ph.config)
        cfg, rank = self.cfg, self.rank
        joining = self.joining if self.joining is not None and self.joining["phase"] == phase_idx else None
        self.joining = None
        sched = Schedule.from_dict(ph.schedule)
        if joining is not None:
            sched = Schedule.from_dict(joining["schedule"])
        elif sorted(self.alive) != list(range(self.world)):
            from .recovery import replan
            sched = replan(sched, self.alive)
        self.stage_of = sched.stage_of()
        stages = sched.stages_of().get(rank, [])
        cost = CostModel.from_dict(ph.cost) if ph.cost else None
        topo = Topology.from_dict(ph.topology) if ph.topology else None
        # joining a freezing job: the freeze rule's state and the layout in force (partition,
        # frozen depth) from the lowest node, before this node builds its stage
        frozen = self._broadcast_json(None) if joining is not None and cfg.elastic.enabled else None
        model = None
        if stages:
            from ..model.partition import Partition

            model = self.build_stage(stages, sched.memory, Partition(tuple(frozen["counts"])) if frozen else None)
            if self.job.meta.get("init_weights"):     # a pre-trained start (tensors by global name)
                init = torch.load(self.job.meta["init_weights"], weights_only=True)
                model.load_state_dict({k: v for k, v in init.items() if k in model.state_dict()})
            for stage in stages:
                _warm_up(model, stage, cfg, self.device)
            if frozen:
                from .transition import freeze_parameters
                freeze_parameters(model, int(frozen["frozen"]))
        # the stage's data-parallel collectives delayed as on the topology's links (every strategy's
        # real bytes, each replica group a ring: :class:`skiptrain.dp.link.RingLinks`)
        self.sync_topo = (topo, ph.bytes_scale) if ph.emulate_sync and topo is not None else None
        groups, strats = self._hosted_groups(sched, stages, model, {})
        out_dir = self.run_dir / "phases" / ph.name
        out_dir.mkdir(parents=True, exist_ok=True)
        st = PhaseState(ph=ph, idx=phase_idx, sched=sched, stages=stages, model=model, strats=strats,
                        opt=self._optimizer(model, next(iter(strats.values()), None)), groups=groups, cost=cost,
                        topo=topo,
                        speed=topo.speed(rank) if topo is not None and rank < topo.n else 1.0,
                        padding=ComputePadding(ph.emulate_compute and cost is not None), out_dir=out_dir,
                        order={mb.id: i for i, mb in enumerate(sorted(sched.micro_batches, key=lambda m: m.id))},
                        record={"rank": rank, "stage": stages[0] if stages else None, "stages": stages,
                                "iterations": [], "recoveries": []},
                        # after a recovery generation (or a join) the planner re-plans the routes for
                        # the nodes that remain; every node sets this flag on its own and the stats
                        # gather makes them agree (a column of the gathered stats)
                        replan_pending=joining is not None)
        st.gb = len(st.order) * cfg.train.micro_batch
        self._open_checkpoints(ph)
        if self.job.rt.drift_threshold > 0 and cost is not None and topo is not None:
            from .drift import DriftMonitor
            st.drift = DriftMonitor(rank, topo.n, cost, topo, ph.bytes_scale, self.job.rt.drift_alpha)
        if cfg.elastic.enabled:
            from .freezing import SwarmFreezing
            st.elastic = SwarmFreezing(self, st)    # a resumed job: the layout the checkpoint was in
            if frozen is not None:
                st.elastic.adopt(frozen)
        st.ex = self._executor(st)   # (after the freezing state: stage 0 may start from the frozen prefix)
        if joining is not None:
            self._join_phase(st, joining)
        else:
            if self.job.resume and self.job.resume["phase"] == phase_idx:
                self._resume(st)
            if self.job.rt.recover:
                self._publish_sched(st.sched, phase_idx, st.cost)   # (a resumed freezing job: its layout)
        return st

    def _open_checkpoints(self, ph: Phase) -> None:
        """This phase's job checkpoints (:mod:`.job_checkpoint`); the root must be writable here."""
        from .job_checkpoint import JobCheckpointer, check_root_writable, checkpoint_root

        root = checkpoint_root(self.job, ph.name)
        c = self.cfg.checkpoint
        if c.every or c.final or self.job.rt.recover:
            check_root_writable(root, self.rank)
        self.ckpt = JobCheckpointer(root, self.rank, c, self.job.rt.timeout_s, self._gather_bytes)

    def _resume(self, st: "PhaseState") -> None:
        """Continue the job from its checkpoint (``job.resume``): position, and this node's stage
        state under the current layout."""
        from .job_checkpoint import load_node_state, restore_rng

        r = self.job.resume
        st.it, st.cursor = int(r["iteration"]), int(r["cursor"])
        if st.model is not None:
            slot = st.slot(self.rank)
            reader = load_node_state(r["path"], st.model, st.opt, list(st.strats.values()), slot)
            restore_rng(reader, self.rank, slot)
        self.ckpt.saved_step = st.it
        print(f"skiptrain node {self.rank}: resumed at iteration {st.it} (data cursor {st.cursor}) from {r['path']}",
              file=sys.stderr, flush=True)

    def _start_together(self) -> tuple[bool, float, float]:
        """An iteration's common start: every node's stop flag gathered at rank 0, which answers
        with one broadcast of (any stop, start time = its clock + the start margin, its clock)."""
        flags = self._gather_at_root(torch.tensor([1.0 if self._stop_requested() else 0.0], dtype=torch.float64))
        tt = torch.zeros(3, dtype=torch.float64)
        if flags is not None:
            stamp = time.time()
            tt[:] = torch.tensor([float(flags.max()), stamp + self.start_margin, stamp], dtype=torch.float64)
        self._sync(dist.broadcast, tt, 0)
        return bool(tt[0] > 0), float(tt[1]), float(tt[2])

    def _all_gather_small(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every live node's ``t`` (the same shape and dtype everywhere, a few dozen numbers), in
        rank order: gathered at rank 0, then one broadcast of the table.  Two steps where gloo's
        ring all-gather takes one per node: for 16 processes on 2 cores, 8 ms against 43."""
        table = self._gather_at_root(t)
        if table is None:
            table = torch.empty((len(self.alive), *t.shape), dtype=t.dtype)
        self._sync(dist.broadcast, table, 0)
        return list(table.unbind(0))

    def _gather_at_root(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every live node's ``t`` stacked in rank order at rank 0 (None on the others)."""
        root = dist.get_rank() == 0
        table = torch.empty((len(self.alive), *t.shape), dtype=t.dtype) if root else None
        self._sync(dist.gather, t, list(table.unbind(0)) if root else None, 0)
        return table

    def _gather_bytes(self, b: bytes, size: int | None = None) -> list[tuple[int, bytes]]:
        """All-gather one byte string from every live node: [(node, bytes)].  With ``size`` every
        node sends exactly that many bytes (one collective instead of two)."""
        if size is None:
            n = torch.tensor([len(b)], dtype=torch.int64)
            lens = self._all_gather_small(n)
        else:
            lens = [torch.tensor([size])] * len(self.alive)
        m = max(1, max(int(x) for x in lens))
        buf = torch.zeros(m, dtype=torch.uint8)
        if b:
            buf[:len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        outs = [torch.empty(m, dtype=torch.uint8) for _ in self.alive]
        self._sync(dist.all_gather, outs, buf)
        return [(node, bytes(o[:int(k)].numpy())) for node, o, k in zip(self.alive, outs, lens)]

    def _checkpoint_state(self, st: "PhaseState") -> tuple:
        """(tensors, node JSON, placement, digest) this node saves (:mod:`.job_checkpoint`)."""
        from .job_checkpoint import stage_state

        tensors, node_state = {}, {}
        if st.model is not None:
            slot = st.slot(self.rank)
            tensors, node_state = stage_state(st.model, st.opt, list(st.strats.values()), slot)
            node_state.update(node=self.rank, stage=st.stage, stages=st.stages)
        return tensors, node_state, st.sched.placement, self.ckpt.digest(tensors, st.sched.placement)

    def _save_checkpoint(self, st: "PhaseState", done: int, cursor: int, snap: tuple | None = None,
                         digests: list | None = None) -> None:
        """The job's checkpoint after ``done`` iterations of the phase (every node calls this);
        ``digests``: every node's, from the stats gather (else gathered here)."""
        tensors, node_state, placement, _ = snap or self._checkpoint_state(st)
        position = {"phase": st.idx, "phase_name": st.ph.name, "iteration": done, "gen": self.gen,
                    "data": {"cursor": cursor, "global_batch": st.gb, "seed": self.cfg.train.seed},
                    "config": self.cfg_json, "placement": placement}
        if st.elastic is not None:
            position["elastic"] = st.elastic.state_dict()
        self.ckpt.save(done, position, tensors, node_state, placement, self.gen, digests)

    def _join_phase(self, st: "PhaseState", joining: dict) -> None:
        """A node joining a running job: its state from a live replica (or the stage's checkpoint
        / CheckFree when the stage had none), then the next iteration."""
        t_j = time.time()
        resume, rep = self._join_transfer(st.sched, {self.rank: st.stage}, st.model, st.strat, st.opt, st.ph, st.idx,
                                          0, 0)
        st.it, st.cursor = resume["it"], resume["cursor"]
        st.record["joined"] = {"gen": self.gen, "stage": st.stage, "iteration": st.it,
                               "choice": joining.get("choice"), "transfer_s": time.time() - t_j, **(rep or {})}
        print(f"skiptrain node {self.rank}: joined at iteration {st.it} as a replica of stage {st.stage}; "
              f"state: {(rep or {}).get('init')}", file=sys.stderr, flush=True)
        self._ack()

    def _executor(self, st: "PhaseState"):
        from .executor import Executor
        from .wan import LinkFifo

        ph, topo, cost = st.ph, st.topo, st.cost
        self.tr.link = (LinkFifo.from_topology(topo, self.rank, ph.bytes_scale, cost.hop_overhead_s if cost else 0.0)
                        if ph.wan and topo is not None and self.rank < topo.n else None)
        self.tr.codec_of = self._codec_of(st)
        return Executor(self.rank, self.tr, st.model, cost, st.speed, st.padding, self.job.rt.timeout_s,
                        self.describe, check=self._check_payload,
                        embed=st.elastic.embed if st.elastic is not None else None)

    def _codec_of(self, st: "PhaseState"):
        """The activation encoding of each of this node's outgoing links (the cost model's choice;
        without one, to a node outside its topology, or between two of its own stages: the
        precision's plain encoding)."""
        from ..schedule.actcodec import plain_codec

        cost, topo, me = st.cost, st.topo, self.rank
        plain = plain_codec(self.cfg.train.precision)
        if cost is None or topo is None or me >= topo.n:
            return lambda dst: plain
        return lambda dst: cost.hop_codec(topo, me, dst) if dst < topo.n and dst != me else plain

    def _run_iteration(self, st: "PhaseState") -> None:
        """One attempt at iteration ``st.it``; on a recoverable failure, recover and advance past
        it when some node committed it."""
        from ..optim import lr_at

        a = Attempt(step_count=st.strat.step_count if st.strat is not None else 0, lr=lr_at(st.it, self.cfg.train))
        try:
            self._iterate(st, a)
        except Exception as e:  # noqa: BLE001 - classified below
            if not self._recoverable(e):
                raise
            self._recover_iteration(st, a, e)
            if not (a.committed or self._any_committed):
                return
        st.it += 1
        st.cursor += st.gb

    def _iterate(self, st: "PhaseState", a: "Attempt") -> None:
        """Switch to a pending join, start together, execute the schedule, commit, step, gather."""
        from ..model.device import autocast, to_device

        self.hook(st.ph.name, st.it, "start", st)
        if self.watch is not None:
            self._switch_to_joins(st, a)
        if st.elastic is not None:
            st.elastic.apply_pending()      # a freeze transition decided at the last boundary
        # common start: everyone present (and agreed whether the launcher asked to stop: then every
        # node ends the phase here, writes its stage and exits), then rank 0's clock + a margin
        stop, t0, stamp = self._start_together()
        if stop:
            raise StopRequested(f"node {self.rank}: the launcher asked to stop")
        a.start_delay = time.time() - stamp
        time.sleep(max(0.0, t0 - time.time()))
        a.cpu0 = time.process_time()
        mbsz, c = self.cfg.train.micro_batch, st.cursor

        def batch_fn(mb_id: int):
            i = st.order[mb_id]
            a.samples.extend(range(c + i * mbsz, c + (i + 1) * mbsz))
            if st.elastic is not None:
                x, y = st.elastic.batch(self.src, range(c + i * mbsz, c + (i + 1) * mbsz))
            else:
                x, y = self.src.batch(range(c + i * mbsz, c + (i + 1) * mbsz))
            return to_device(x, self.device), to_device(y, self.device)

        with autocast(self.device, self.cfg.train.precision):     # every forward and backward
            a.res = st.ex.run_iteration(st.it, st.sched, t0, batch_fn)
        self.hook(st.ph.name, st.it, "after_pipeline", st)
        if self.job.rt.recover:
            self._sync(dist.barrier)   # commit point: every node finished its pipeline tasks
        a.committed = True
        a.entry = {"events": [], "n_processed": a.res.n_processed, "t_end": 0.0, "samples": sorted(a.samples),
                   "gen": self.gen, "t0": t0}
        st.record["iterations"].append(a.entry)
        self._log_samples(st.out_dir, st.ph.name, st.it, a.samples)
        events = list(a.res.events) + self._step(st, a, t0)
        a.stepped = True
        self.tr.wait_sent(self.job.rt.timeout_s)
        events += self.tr.take_events()
        a.entry["events"] = [e.to_dict() for e in events]
        a.entry["t_end"] = max((e.end for e in events), default=0.0)
        a.entry["pipe_end"] = max((e.end for e in a.res.events), default=0.0)
        # a checkpoint at this boundary: every node's save-plan digest rides on the stats gather
        snap = self._checkpoint_state(st) if self.ckpt.due(st.it + 1, st.ph.iterations) else None
        allst = self._gather_stats(st, a, events, snap[3] if snap else 0)
        placement = [list(p) for p in st.sched.placement]
        self._after_gather(st, allst)
        if st.elastic is not None:          # the freeze rule's evidence and, at a window's end, its decision
            st.elastic.after_iteration(torch.stack(allst)[:, a.norm_cols].sum(0))
        self._maybe_evaluate(st)
        if snap is not None:
            t = time.perf_counter()
            same = st.sched.placement == placement
            self._save_checkpoint(st, st.it + 1, st.cursor + st.gb, snap,
                                  [(n, int(x[-2])) for n, x in zip(self.alive, allst)] if same else None)
            a.entry["ckpt_s"] = time.perf_counter() - t

    def _maybe_evaluate(self, st: "PhaseState") -> None:
        """Validation inside the loop, every ``train.eval_every`` iterations and after the last:
        the fixed ``train.eval_batches`` validation micro-batches through the layout in force
        (:func:`~skiptrain.runtime.evaluate.pipelined_evaluate_sum`: with one stage each node
        validates its share; through a pipeline each micro-batch visits one replica of every
        stage), summed over the swarm; rank 0 writes the ``val_loss`` line with the seconds it
        took.  A layout with a stage left without a node is not validated."""
        t, n_it = self.cfg.train, st.it + 1
        if not (n_it == st.ph.iterations or (t.eval_every and n_it % t.eval_every == 0)):
            return
        if any(not p for p in st.sched.placement):
            return
        from ..model.device import autocast
        from .evaluate import pipelined_evaluate_sum
        from .transition import Activations

        t0 = time.perf_counter()
        p2p = Activations(self._rank, EVAL_TAG, self.check_generation)
        with autocast(self.device, t.precision):
            part = pipelined_evaluate_sum(st.model, self.rank, st.sched.placement, self.val_src,
                                          range(t.eval_batches), t.micro_batch, p2p.send, p2p.recv)
        tot = torch.tensor(part, dtype=torch.float64)
        self._sync(dist.all_reduce, tot)
        if dist.get_rank() == 0:
            row = {"phase": st.ph.name, "step": n_it, "tokens": n_it * st.gb * self.cfg.model.seq_len,
                   "val_loss": round(float(tot[0] / max(tot[1], 1)), 5),
                   "seconds": round(time.perf_counter() - t0, 4)}
            with open(self.run_dir / "metrics.jsonl", "a") as metrics:
                metrics.write(json.dumps(row) + "\n")

    def check_generation(self) -> None:
        """Raise :class:`NodeFailure` when the coordinator has announced a new membership
        generation (recovery mode): a wait among the old members (a validation pass, a guard
        check, a freeze transition's state moves) would never end."""
        if self.watch is not None and self.watch.newer():
            raise NodeFailure(f"node {self.rank}: membership changed during a collective exchange; "
                              "abandoning the iteration", node=None)

    def _switch_to_joins(self, st: "PhaseState", a: "Attempt") -> None:
        """Iteration boundary: every node learns the newest join generation any of them has seen
        (this all-reduce is also the start barrier) and they all switch to it together, before any
        work of the iteration (a joined node enters here: the all-reduce is repeated after a join)."""
        while True:
            flag = torch.tensor([self.watch.join_seen], dtype=torch.int64)
            self._sync(dist.all_reduce, flag, dist.ReduceOp.MAX)
            if int(flag.item()) <= self.gen:
                return
            st.sched, st.groups, st.strats = self._apply_join(int(flag.item()), st.sched, st.model, st.stages,
                                                              st.strats, st.opt, st.ph, st.idx, st.it, st.cursor,
                                                              a.step_count, st.elastic)
            st.record.setdefault("joins", []).append({"gen": self.gen, "iteration": st.it,
                                                      "placement": st.sched.placement})
            st.replan_pending = True
            st.ex = self._executor(st)

    def _step(self, st: "PhaseState", a: "Attempt", t0: float) -> list:
        """The one optimizer step (:func:`~skiptrain.runtime.step.optimizer_step`) for the stages
        this node serves; a node without a stage still takes part in the global clip's sum.
        Returns the sync events for the timeline (one per served stage that has replicas)."""
        from ..schedule.timeline import Event
        from .recovery import stage_grad_norms
        from .step import HostedStage, optimizer_step

        ph, model = st.ph, st.model
        if model is None:
            a.outcome = optimizer_step([], None, a.lr, self.cfg.train.grad_clip, self._sum_across)
            return []
        processed = a.res.processed
        if ph.dump and st.it == 0:
            torch.save({"n": a.res.n_processed, "stage": st.stage, "processed": processed,
                        "grads": {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                                  for n, p in model.named_parameters()}},
                       st.out_dir / f"grads_node{self.rank}.pt")
        self._last_gnorm = stage_grad_norms(model, st.stages)   # CheckFree's weights
        self.ckpt.wait_snapshot()
        ts = time.time()
        hosted = [HostedStage(s, strat, processed.get(s, 0), len(st.sched.placement[s])) for s, strat in
                  sorted(st.strats.items())]
        a.outcome = optimizer_step(hosted, st.opt, a.lr, self.cfg.train.grad_clip, self._sum_across,
                                   inspect=st.elastic.observe if st.elastic is not None else None)
        stats = [a.outcome.stats[h.stage] for h in hosted]
        a.entry["sync"] = {"payload": sum(x.payload_bytes for x in stats),
                           "received": sum(x.received_bytes for x in stats),
                           "comm_s": round(sum(x.comm_s for x in stats), 6), "synced": all(x.synced for x in stats),
                           "n_total": sum(x.n_total for x in stats)}
        te = time.time()
        for p in model.parameters():
            p.grad = None
        return [Event(self.rank, "sync", None, h.stage, ts - t0, te - t0, x.payload_bytes)
                for h, x in zip(hosted, stats) if h.replicas > 1]

    def _gather_stats(self, st: "PhaseState", a: "Attempt", events: list, ckpt_digest: int = 0) -> list:
        """All-gather every node's iteration statistics (then the drift monitor's columns and
        the freeze rule's layer norms, if any; the last two columns: the checkpoint digest, the
        re-plan flag); rank 0 appends the metrics line.  Every node then sets the
        next iteration's start margin from the slowest receipt of the start time (the last of
        the ``N_STATS`` columns) over
        the last ``START_WINDOW`` iterations: twice that, within ``START_MARGIN_S``."""
        res = a.res
        sync = a.entry.get("sync") or {}
        stats = torch.tensor([res.loss_sum, res.n_loss, a.entry["t_end"], st.padding.overruns, st.padding.overrun_s,
                              res.max_in_flight, sync.get("payload", 0), sync.get("received", 0),
                              sync.get("comm_s", 0.0), a.entry.get("pipe_end", 0.0),
                              time.process_time() - a.cpu0, a.start_delay],
                             dtype=torch.float64)
        if st.drift is not None:
            stats = torch.cat([stats, st.drift.observe(events)])
        if st.elastic is not None:
            norms = st.elastic.take_norms()
            a.norm_cols = slice(len(stats), len(stats) + len(norms))
            stats = torch.cat([stats, norms])
        stats = torch.cat([stats, torch.tensor([float(ckpt_digest), 1.0 if st.replan_pending else 0.0],
                                               dtype=torch.float64)])
        allst = self._all_gather_small(stats)
        margin, delay = self.start_margin, max(float(x[N_STATS - 1]) for x in allst)
        self._start_delays.append(delay)
        self.start_margin = min(START_MARGIN_S[1], max(START_MARGIN_S[0], 2 * max(self._start_delays)))
        if dist.get_rank() == 0:
            g = torch.stack(allst)
            n = float(g[:, 1].sum())
            row = {"phase": st.ph.name, "step": st.it + 1, "loss": round(float(g[:, 0].sum()) / max(n, 1), 5),
                   "iteration_s": round(float(g[:, 2].max()), 4), "lr": a.lr,
                   "grad_norm": round(a.outcome.grad_norm, 5),
                   "tokens": (st.it + 1) * st.gb * self.cfg.model.seq_len,
                   "overruns": int(g[:, 3].sum()), "overrun_s": round(float(g[:, 4].sum()), 4),
                   "max_in_flight": int(g[:, 5].max()), "payload_bytes": int(g[:, 6].max()),
                   "received_bytes": int(g[:, 7].max()), "comm_s": round(float(g[:, 8].max()), 6),
                   "pipeline_s": round(float(g[:, 9].max()), 4), "cpu_s": round(float(g[:, 10].sum()), 4),
                   "start_margin_s": round(margin, 6), "start_delay_s": round(delay, 6)}
            if self.job.rt.recover:
                row.update(gen=self.gen, nodes=len(self.alive))
            with open(self.run_dir / "metrics.jsonl", "a") as metrics:
                metrics.write(json.dumps(row) + "\n")
        return allst

    def _after_gather(self, st: "PhaseState", allst: list) -> None:
        """Re-plan the routes after a recovery or join, or on drift; switch at the next iteration."""
        want = max(float(x[-1]) for x in allst) > 0 and st.topo is not None and st.cost is not None
        st.replan_pending = False
        new_sched = None
        if want:
            new_sched, last = self._recovery_replan(allst, st.sched, st.it, st.topo, st.cost, st.drift is not None,
                                                    st.drift_state)
            if last is not None:
                st.record.setdefault("replans", []).append({"iteration": st.it + 1, **last})
        elif st.drift is not None:
            new_sched, st.drift_state = self._drift_step(allst, st.sched, st.ph, st.it, st.topo, st.cost,
                                                         st.drift_state)
            if new_sched is not None:
                st.record.setdefault("replans", []).append({"iteration": st.it + 1, **st.drift_state["last"]})
        if new_sched is not None:
            st.sched = new_sched
            self.stage_of = st.sched.stage_of()
            st.ex = self._executor(st)
            self._publish_sched(st.sched, st.idx, st.cost)

    def _recover_iteration(self, st: "PhaseState", a: "Attempt", e: BaseException) -> None:
        """Recover from ``e`` (a peer failed or misbehaved): report, re-form over the survivors,
        re-plan, settle the iteration's sync.  A further failure while recovering (a peer dying
        during the re-forming) starts the recovery again from the pre-failure schedule and the
        newer generation; a failure after a takeover switched this node's stage is not handled
        (the stage stays switched)."""
        t_fail = time.time()
        attempts = 0
        while True:
            try:
                attempts += 1
                self.hook(st.ph.name, st.it, "recover", st)
                redone = self._recover_once(st, a, e)
                break
            except Exception as e2:  # noqa: BLE001
                if not self._recoverable(e2):
                    raise
                e = e2
        if self._any_committed and a.entry is None and a.res is not None:
            st.record["iterations"].append({"events": [], "n_processed": a.res.n_processed, "t_end": 0.0,
                                            "samples": sorted(a.samples), "gen": self.gen})
            self._log_samples(st.out_dir, st.ph.name, st.it, a.samples)
        st.record["recoveries"].append({
            "gen": self.gen, "iteration": st.it, "cause": str(e)[:300], "committed": a.committed,
            "attempts": attempts, "redo_sync": redone, "alive": list(self.alive), "t_fail": t_fail,
            "t_resumed": time.time(), "recover_s": time.time() - t_fail})

    def _recover_once(self, st: "PhaseState", a: "Attempt", e: BaseException) -> bool:
        """One recovery attempt; returns whether the iteration's sync was re-done."""
        new_sched, _ = self._recover(e, st.sched, st.it, a.committed, st.ph.name)
        self.stage_of = new_sched.stage_of()
        took = new_sched.meta.get("takeover") or {}
        was_moved = self.rank in took
        rep = None
        if took:                # every survivor takes part; only the taker's stage changes
            model, stage, rep = self._takeover(new_sched, took, st.model, st.stage, st.ph.name, st.it)
            if was_moved:
                st.model, st.stage = model, stage
                st.record.setdefault("takeovers", []).append(rep)
                st.record["stage"] = st.stage
        if was_moved:           # a node that took over a stage serves that one alone
            st.groups, st.strat = self._stage_groups(new_sched, st.stage, st.model, None, a.step_count)
            st.opt = self._optimizer(st.model, st.strat)
            self._stage_from_checkpoint(rep, new_sched, st.stage, st.model, st.opt, st.strat)
        else:                   # every stage this node serves, each keeping its strategy's state
            st.groups, st.strats = self._hosted_groups(new_sched, st.stages, st.model, st.strats, a.step_count)
        st.ex = self._executor(st)
        redone = self._settle(a.committed, a.stepped or was_moved, st.it, st.model, st.strats, st.opt, a.lr,
                              None if was_moved else a.res)
        st.sched = new_sched
        self._publish_sched(st.sched, st.idx, st.cost)   # before the ack: the coordinator reads it after all acks
        self._ack()
        st.replan_pending = True
        return redone

    def _end_phase(self, st: "PhaseState") -> None:
        """The final checkpoint (also when stopped early), dumps (tests), the stage's weights
        (first replica), and the phase's groups torn down."""
        model = st.model
        if self.stopped or self.cfg.checkpoint.final:
            self._save_checkpoint(st, st.it, st.cursor)
        self.ckpt.close()
        if st.strats:
            st.record["sync_summary"] = sync_summary(list(st.strats.values()), model.num_parameters())
            (st.out_dir / f"node{self.rank}.json").write_text(json.dumps(st.record))
        if model is not None:
            if st.ph.dump:
                torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                           st.out_dir / f"params_node{self.rank}.pt")
            for stage in st.stages if st.ph.save_weights else ():
                if self.rank == st.sched.placement[stage][0]:
                    from safetensors.torch import save_file

                    parts = self.run_dir / "parts"
                    parts.mkdir(parents=True, exist_ok=True)
                    names = {n for n, _ in model.stage_named_parameters(stage)}
                    save_file({n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()
                               if n in names}, str(parts / f"stage{stage}.safetensors"))
        dist.barrier()
        self._drop_groups(st.groups)

    def _drop_groups(self, groups: dict) -> None:
        """Destroy the stage groups ``groups`` this node is a member of (no work pending on them:
        after the phase's last barrier, or a layout switch's commit)."""
        for g in groups.values():
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)

    # ---- recovery (semantics in runtime/recovery.py) ---------------------------------

    def _optimizer(self, model, strat):
        """The one optimizer (``skiptrain.optim``) over this node's stage, of the rule its sync
        strategy feeds (None without a stage)."""
        from ..optim import build_optimizer

        return None if model is None else build_optimizer(model.named_parameters(), self.cfg.train,
                                                           strat.update_rule)

    def _sum_across(self, x: float) -> float:
        """Sum one float over every node of the generation (the global clip's squared norm)."""
        t = torch.tensor([x], dtype=torch.float64)
        self._sync(dist.all_reduce, t)
        return float(t[0])

    def _stage_groups(self, sched, stage, model, old_strat, step_count: int | None = None):
        """:meth:`_hosted_groups` for a node serving one stage (or none): (groups, strategy)."""
        groups, strats = self._hosted_groups(sched, [] if stage is None else [stage], model,
                                             {} if old_strat is None else {stage: old_strat}, step_count)
        return groups, strats.get(stage)

    def _hosted_groups(self, sched, stages: list[int], model, old: dict, step_count: int | None = None):
        """One group per stage with replicas (every rank creates every group, same order; backend
        ``dp.backend``: gloo, or NCCL between CUDA devices), and this node's DP strategy on the
        group of each stage it serves, over that stage's parameters that train (frozen ones have
        no gradient to sync), keeping the state of the strategy ``old[stage]`` where given.
        Returns (groups, {stage: strategy})."""
        from ..dp import make_strategy

        timeout = timedelta(seconds=self.job.rt.timeout_s)
        groups = {s: dist.new_group(sorted(self._rank[n] for n in p), timeout=timeout, backend=self.cfg.dp.backend)
                  for s, p in enumerate(sched.placement) if p}
        strats = {}
        for s in stages if model is not None else ():
            named = model.named_parameters() if len(stages) == 1 else model.stage_named_parameters(s)
            strats[s] = make_strategy(self.cfg.dp, [(n, p) for n, p in named if p.requires_grad], groups[s],
                                      self.cfg.train, link=self._sync_link(sched.placement[s]))
            if old.get(s) is not None:
                sd = old[s].state_dict()
                if step_count is not None:
                    sd["step"] = step_count
                strats[s].load_state_dict(sd)
        return groups, strats

    def _sync_link(self, replicas: list[int]):
        """The emulated links of a replica group's collectives (``Phase.emulate_sync``): the ring
        over ``replicas`` on the phase's topology; None (the ``dp`` config's links) otherwise."""
        topo_scale = getattr(self, "sync_topo", None)
        if topo_scale is None or len(replicas) < 2:
            return None
        from ..dp.link import RingLinks
        from ..schedule.cost import ring_order

        topo, scale = topo_scale
        if max(replicas) >= topo.n:
            return None
        ring = ring_order(topo, sorted(replicas))
        pairs = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
        return RingLinks(tuple(float(topo.latency_s[a][b]) for a, b in pairs),
                         tuple(1.0 / float(topo.bandwidth_Bps[a][b]) for a, b in pairs), float(scale))

    def _sync(self, fn, *args) -> None:
        """Run the collective ``fn(*args)``.  In recovery mode it runs asynchronously and the wait
        gives up as soon as the coordinator announces a new generation: a collective among live
        nodes can otherwise sit until the group timeout when a peer that already left it was the
        one it waited on (the abandoned work is never waited on again)."""
        if self.watch is None:
            fn(*args)
            return
        work = fn(*args, async_op=True)
        while not work.is_completed():
            if self.watch.newer():
                raise NodeFailure(f"node {self.rank}: membership changed during {fn.__name__}; "
                                  "abandoning the iteration", node=None)
            time.sleep(0.002)
        work.wait()

    def _takeover(self, sched, took: dict, model, stage, phase: str = "", it: int = 0):
        """Every survivor takes part in initialising each taken-over stage (:meth:`_init_stage`:
        the stage's checkpoint when young enough, else CheckFree from the neighbours); the
        taking-over node builds the stage.  Returns (model, stage, report or None)."""
        cfg = self.cfg
        report = None
        targets = {v[1] for v in took.values()}
        for n_t, (old, s) in sorted(took.items()):
            new = None
            if self.rank == n_t:
                new = self.build_stage(s, sched.memory)
            rep = self._init_stage(sched, s, n_t, model, new, phase, it, exclude=targets)
            if self.rank != n_t:
                continue
            _warm_up(new, s, cfg, self.device)
            report = {"gen": self.gen, "stage": s, "from_stage": old, **rep}
            print(f"skiptrain node {self.rank}: takes over stage {s} (was stage {old}); init {rep['init']}, "
                  f"neighbours {rep['neighbours']} weights {[round(c, 3) for c in rep['coef']]}", file=sys.stderr,
                  flush=True)
            model, stage = new, s
        return model, stage, report

    def _init_stage(self, sched, s: int, taker: int, model, new, phase: str, it: int,
                    exclude: set[int] = frozenset()) -> dict:
        """Collective over every node: initialise stage ``s`` (no live replica) on ``taker`` into
        ``new``.  The taker looks at the job's latest checkpoint (:mod:`.job_checkpoint`); if it is
        at most ``job.rt.ckpt_max_age`` iterations old, the stage's weights are loaded from it (the
        caller loads its optimizer and sync state once they exist: :meth:`_stage_from_checkpoint`),
        else CheckFree: the first replica of each adjacent body stage broadcasts its stage weights
        and last gradient norm, and the taker sets layer ``j`` to their gradient-norm-weighted
        average (a copy with one neighbour, the seed's init with none).  The decision goes to
        every node by a broadcast from the taker.  Returns the report (taker; ``{}`` elsewhere)."""
        from .recovery import checkfree_combine, stage_tensors

        S = len(sched.placement)
        dec = torch.zeros(2, dtype=torch.float64)            # [use checkpoint, its age]
        ck = None
        if self.rank == taker:
            ck = self.ckpt.latest()
            if ck is not None:
                dec[1] = it - ck[0]
                dec[0] = 1.0 if it - ck[0] <= self.job.rt.ckpt_max_age else 0.0
            else:
                dec[1] = -1
        dist.broadcast(dec, self._rank[taker])
        age = None if dec[1] < 0 else int(dec[1])
        if dec[0] > 0:
            if self.rank != taker:
                return {}
            from .job_checkpoint import load_node_state
            load_node_state(ck[1], new)
            return {"init": "checkpoint", "checkpoint": str(ck[1]), "checkpoint_age": age,
                    "max_age": self.job.rt.ckpt_max_age, "neighbours": [], "grad_norms": [], "coef": []}
        got = []
        for x in (s - 1, s + 1):
            if not (1 <= x < S and sched.placement[x]) or x in exclude:
                continue
            src = sched.placement[x][0]
            hdr = torch.zeros(2, dtype=torch.float64)
            flat = None
            if self.rank == src:
                flat = torch.cat([p.detach().reshape(-1) for _, _, p in stage_tensors(model, x)]).cpu()   # gloo: host
                hdr = torch.tensor([flat.numel(), self._last_gnorm.get(x, 0.0)], dtype=torch.float64)
            dist.broadcast(hdr, self._rank[src])
            buf = flat if self.rank == src else torch.empty(int(hdr[0]))
            dist.broadcast(buf, self._rank[src])
            if self.rank == taker:
                got.append((x, buf, float(hdr[1])))
        if self.rank != taker:
            return {}
        mine = stage_tensors(new, s)
        size = sum(p.numel() for _, _, p in mine)
        got = [g for g in got if g[1].numel() == size]        # same layer count only
        coef: list[float] = []
        if got:
            flat, coef = checkfree_combine([g[1] for g in got], [g[2] for g in got])
            off = 0
            with torch.no_grad():
                for _, _, p in mine:
                    p.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()
            init = "checkfree" if len(got) > 1 else "copy of the only neighbour"
        else:
            init = "fresh (seed init: no neighbour stage with the same layer count)"
        if ck is None:
            why = ("none: checkpoints are off (checkpoint.every = 0)" if not self.cfg.checkpoint.every
                   else "none committed yet")
        else:
            why = f"{ck[1]} is {age} iteration(s) old, more than ckpt_max_age = {self.job.rt.ckpt_max_age}"
        return {"init": init, "neighbours": [g[0] for g in got], "grad_norms": [g[2] for g in got], "coef": coef,
                "checkpoint": why, "checkpoint_age": age}

    def _stage_from_checkpoint(self, rep: dict | None, sched, stage: int, model, opt, strat) -> None:
        """A stage initialised from the job's checkpoint (:meth:`_init_stage`) also takes its
        optimizer and sync state from it, once they exist on this node."""
        if not rep or rep.get("init") != "checkpoint":
            return
        from .job_checkpoint import load_node_state

        load_node_state(rep["checkpoint"], model, opt, strat, sched.placement[stage].index(self.rank))
        rep["restored"] = ["weights"] + (["optimizer"] if opt is not None else []) + (["sync"] if strat is not None else [])

    # ---- drift re-planning (runtime/drift.py) --------------------------------------------------

    def _drift_step(self, allst, sched, ph, it: int, topo, cost, state: dict):
        """After an iteration's stats gather: rank 0 folds the measured iteration time into its
        moving average and, past the threshold, re-plans the routes on the measured topology;
        the decision (and the schedule) is broadcast to every node.  Returns (new schedule or
        None, state)."""
        from ..schedule.schedule import Schedule
        from ..schedule.simulator import simulate
        from .drift import replan_routes

        adopted = None
        if dist.get_rank() == 0:
            a = torch.stack(allst).numpy()
            it_s = float(a[:, 2].max())
            alpha = self.job.rt.drift_alpha
            state["ema"] = it_s if "ema" not in state else (1 - alpha) * state["ema"] + alpha * it_s
            if "ref" not in state:
                state["ref"] = simulate(sched, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
            state["n"] = state.get("n", 0) + 1
            # the placement drift re-plans for: the phase's, or the last freeze transition's
            full = sched.placement == (state.get("home") or Schedule.from_dict(ph.schedule).placement)
            ratio = state["ema"] / state["ref"] if state["ref"] > 0 else 1.0
            if full and state["n"] >= 2 and ratio > 1 + self.job.rt.drift_threshold:
                mt, compute = self._measured_net(a, topo)
                t = time.time()
                new, cur_s, new_s = replan_routes(sched, mt, cost, self.cfg, time_limit_s=RECOVERY_PLAN_TIME_S)
                state["last"] = {"measured_ema_s": round(state["ema"], 4), "reference_s": round(state["ref"], 4),
                                 "ratio": round(ratio, 3), "simulated_current_on_measured_s": cur_s,
                                 "simulated_new_on_measured_s": new_s, "plan_s": round(time.time() - t, 3),
                                 "compute_factors": {str(k): round(v, 3) for k, v in compute.items()},
                                 "adopted": new is not None}
                print(f"skiptrain node {self.rank}: iteration {it + 1}: measured {state['ema']:.3f} s vs "
                      f"{state['ref']:.3f} s planned ({ratio:.2f}x): re-planned routes on the measured topology: "
                      f"{cur_s} -> {new_s} s simulated; {'adopted' if new is not None else 'kept'}",
                      file=sys.stderr, flush=True)
                # the reference becomes what the (new or kept) schedule should take on the measured network
                state["ref"] = (new_s if new is not None else cur_s) or state["ref"]
                state["ema"] = state["ref"] if new is not None else state["ema"]
                state["n"] = 0
                if new is not None:
                    adopted = new, state["last"]
        new, last = self._broadcast_schedule(adopted)
        if new is not None:
            state["last"] = last
        return new, state

    def _recovery_replan(self, allst, sched, it: int, topo, cost, measured: bool, drift_state: dict):
        """At the end of the first committed iteration after a recovery generation (or a join):
        rank 0 re-plans the routes of the repaired schedule with its placement fixed
        (:func:`~skiptrain.runtime.drift.replan_routes`, on the static topology, or the measured one
        when drift re-planning is on), with a small planner budget (``RECOVERY_PLAN_TIME_S`` CPU
        seconds); the new routes are adopted when they simulate at least 5% faster and broadcast,
        and every node switches at the next iteration.  Returns (new schedule or None, the record
        entry: rank 0 always, the others when adopted)."""
        from .drift import replan_routes

        adopted = last = None
        if dist.get_rank() == 0:
            a = torch.stack(allst).numpy()
            t_net = self._measured_net(a, topo)[0] if measured else topo
            t = time.time()
            try:
                new, cur_s, new_s = replan_routes(sched, t_net, cost, self.cfg, time_limit_s=RECOVERY_PLAN_TIME_S)
            except Exception as e:  # noqa: BLE001 - the repair stays in force
                new, cur_s, new_s = None, None, None
                print(f"skiptrain node {self.rank}: post-recovery re-plan failed: {e}", file=sys.stderr, flush=True)
            last = {"trigger": "recovery", "gen": self.gen, "topology": "measured" if measured else "static",
                    "simulated_current_s": cur_s, "simulated_new_s": new_s, "plan_s": round(time.time() - t, 3),
                    "adopted": new is not None}
            print(f"skiptrain node {self.rank}: generation {self.gen}, iteration {it + 1}: re-planned routes for "
                  f"the surviving placement: {cur_s} -> {new_s} s simulated; "
                  f"{'adopted' if new is not None else 'kept the repair'}", file=sys.stderr, flush=True)
            if measured and (new_s if new is not None else cur_s):
                drift_state["ref"] = new_s if new is not None else cur_s
                drift_state["ema"] = drift_state["ref"]
                drift_state["n"] = 0
            if new is not None:
                adopted = new, last
        new, got = self._broadcast_schedule(adopted)
        return new, (got if new is not None else last)

    def _measured_net(self, a, topo):
        """The topology with measured compute and link factors (columns 6 and 7.. of the gathered
        stats ``a``, one row per alive node) in place of the static ones; also the compute factors."""
        import numpy as np

        from .drift import measured_topology

        compute = {n: float(a[i, N_STATS]) for i, n in enumerate(self.alive)}
        links = np.ones((topo.n, topo.n))
        for i, n in enumerate(self.alive):
            if n < topo.n:
                links[n, :] = a[i, N_STATS + 1:N_STATS + 1 + topo.n]
        return measured_topology(topo, compute, links), compute

    def _broadcast_schedule(self, adopted):
        """Rank 0's ``adopted = (schedule, record)`` (or None) to every node of the group; returns
        (schedule or None, record or None) everywhere."""
        from ..schedule.schedule import Schedule

        d = self._broadcast_json({"schedule": adopted[0].to_dict(), "last": adopted[1]} if adopted else None)
        return (Schedule.from_dict(d["schedule"]), d["last"]) if d else (None, None)

    def _broadcast_json(self, obj):
        """Rank 0's JSON-able ``obj`` (or None) to every node of the group; returns it everywhere
        (what the other ranks pass is ignored)."""
        hdr = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if dist.get_rank() == 0 and obj is not None:
            payload = json.dumps(obj).encode()
            hdr[0], hdr[1] = 1, len(payload)
        self._sync(dist.broadcast, hdr, 0)
        if not hdr[0]:
            return None
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(int(hdr[1]), dtype=torch.uint8)
        self._sync(dist.broadcast, buf, 0)
        return json.loads(bytes(buf.tolist()).decode())

    # ---- joining ----------------------------------------------------------------------

    def _ack(self) -> None:
        """Tell the coordinator this node runs in its current generation (joins wait for it)."""
        if self.job.rt.recover:
            self.store.set(f"ack/{self.gen}/{self.rank}", repr(time.time()))

    def _stop_requested(self) -> bool:
        """Whether the launcher asked to stop: ``stop`` in the store, signed by the coordinator in a
        run with a secret (a request anyone else wrote is printed once and ignored)."""
        raw = read_raw(self.hb_store, STOP_KEY)
        if raw is None:
            return False
        if open_value(self.coord_key, STOP_KEY, raw) is not None:
            return True
        if not self._forged_stop:
            self._forged_stop = True
            print(f"skiptrain node {self.rank}: ignored a stop request not signed by the run's coordinator "
                  "(written by a process without the run's secret)", file=sys.stderr, flush=True)
        return False

    def _publish_sched(self, sched, phase_idx: int, cost=None) -> None:
        """The lowest node of the generation tells the coordinator the schedule in force and,
        when given, the cost model of its layout (it places joining nodes on them)."""
        if self.job.rt.recover and self.rank == min(self.alive):
            cur = {"gen": self.gen, "phase": phase_idx, "schedule": sched.to_dict()}
            if cost is not None:
                cur["cost"] = cost.to_dict()
            set_member(self.store, self.rank, "sched/cur", json.dumps(cur))   # signed: the coordinator checks

    def _apply_join(self, target: int, sched, model, stages: list[int], strats: dict, opt, ph, phase_idx: int,
                    it: int, cursor: int, step_count: int, elastic=None):
        """At an iteration boundary, every node switches to join generation ``target``: re-forms
        the groups with the joining node(s), (in a freezing job: the lowest node sends the freeze
        rule's state and the layout in force, ``elastic.state_dict()``), takes the coordinator's
        schedule, rebuilds the groups of its stages keeping their strategies' and its optimizer
        state, and takes part in the joiner's state transfer.
        Returns (schedule, groups, {stage: strategy}); on failure the caller keeps the old ones."""
        from ..schedule.schedule import Schedule
        from .recovery import read_generation

        self._pre_join = None
        recs = [read_generation(self.store, g, self.coord_key) for g in range(self.gen + 1, target + 1)]
        if any(r.get("kind") != "join" for r in recs):
            raise NodeFailure(f"node {self.rank}: membership changed at the iteration boundary", node=None)
        joins = {int(k): int(v) for r in recs for k, v in r["join"].items()}
        new = Schedule.from_dict(recs[-1]["schedule"])
        t = time.time()
        if self.rank == min(self.alive):
            self.store.set(f"join/go/{target}", repr(t))    # the joiners enter the new groups now
        self._regroup(target, recs[-1]["alive"])
        if elastic is not None:
            self._broadcast_json(elastic.state_dict())
        self.stage_of = new.stage_of()
        groups, strats2 = self._hosted_groups(new, stages, model, strats, step_count)
        self._join_transfer(new, joins, model, list(strats2.values()) or None, opt, ph, phase_idx, it, cursor)
        self._pre_join = (max(joins), sched)
        self._publish_sched(new, phase_idx, elastic.st.cost if elastic is not None else None)
        self._ack()
        print(f"skiptrain node {self.rank}: generation {target}: node(s) {sorted(joins)} joined "
              f"(stages {sorted(set(joins.values()))}); placement {new.placement}; {time.time() - t:.3f} s",
              file=sys.stderr, flush=True)
        return new, groups, strats2

    def _join_transfer(self, sched, joins: dict[int, int], model, strat, opt, ph, phase_idx: int, it: int,
                       cursor: int):
        """Collective over the new generation: rank 0 (the lowest existing node) broadcasts where
        the run is (phase, iteration, data cursor); every node shares the byte sizes of its
        stage's state by name; then the layout-change core plans the moves
        (:func:`~skiptrain.runtime.recovery.join_transfers`: each tensor from the least-loaded live
        replica) and they travel point to point in the one wire format (weights, optimizer and
        sync state by name, :func:`~skiptrain.runtime.transition.move_state`).  A joiner on a
        stage with no live replica initialises it by :meth:`_init_stage` (checkpoint or CheckFree).
        Returns (resume info, report on a joiner)."""
        from ..model.partition import partition_layers
        from .job_checkpoint import load_stage_state, replicas_drift
        from .recovery import join_transfers
        from .transition import gather_state, move_state, stage_sizes

        pos = torch.tensor([phase_idx, it, cursor], dtype=torch.int64)
        dist.broadcast(pos, 0)
        resume = {"phase": int(pos[0]), "it": int(pos[1]), "cursor": int(pos[2])}
        report = None
        sizes: dict[str, int] = {}
        mine = stage_sizes(model, opt, strat) if self.rank not in joins else {}
        for _, blob in self._gather_bytes(json.dumps(mine).encode()):
            sizes.update(json.loads(blob.decode()))
        for j, s in sorted(joins.items()):
            if any(n not in joins for n in sched.placement[s]):
                continue
            rep = self._init_stage(sched, s, j, model, model if self.rank == j else None, ph.name, resume["it"],
                                   exclude=set(joins.values()))
            if self.rank == j:
                report = rep
                self._stage_from_checkpoint(rep, sched, s, model, opt, strat)
        # (a node with no stage is in no message of the plan, whatever partition it assumes)
        part = model.partition if model is not None else partition_layers(self.cfg.model)
        plan = join_transfers(sizes, part, sched.placement, joins, drift=replicas_drift(strat))
        t = time.time()
        blobs = move_state(self.rank, plan, self._rank, model, opt, strat, lambda: None)
        if self.rank in joins and blobs:
            tensors, record, scalars = gather_state(None, None, None, blobs, set(sizes))
            load_stage_state(model, opt, strat, tensors, record, scalars)
            mine = [tr for tr in plan if tr.dst == self.rank]
            report = {"init": "state of the live replica(s): weights, optimizer and sync state",
                      "from_nodes": sorted(tr.src for tr in mine), "bytes": sum(tr.nbytes for tr in mine),
                      "recv_s": time.time() - t, "optimizer_step": strat.step_count if strat is not None else None}
        return resume, report

    def _log_samples(self, out_dir: Path, phase: str, it: int, samples: list[int]) -> None:
        """Append the global sample indices this node trained in committed iteration ``it``
        (``samples_node<r>.jsonl``, flushed at once so it survives a SIGKILL of this node)."""
        if samples:
            with open(out_dir / f"samples_node{self.rank}.jsonl", "a") as f:
                f.write(json.dumps({"iteration": it, "gen": self.gen, "samples": sorted(samples)}) + "\n")

    def _recoverable(self, e: BaseException) -> bool:
        from .recovery import RecoveryError

        if not self.job.rt.recover or isinstance(e, RecoveryError):
            return False
        return isinstance(e, RuntimeError) and getattr(e, "node", None) != self.rank

    def _check_payload(self, m) -> None:
        from .recovery import check_payload

        c = self.cfg
        check_payload(m.kind, m.tensor, m.src, (c.train.micro_batch, c.model.seq_len, c.model.d_model), m.mb,
                      self.rank)

    def _recover(self, e: BaseException, sched, it: int, committed: bool, phase: str):
        """Report, wait for the coordinator's next generation, re-form the groups over the
        survivors and re-plan.  Returns the new schedule."""
        from .recovery import BadPayload, RecoveryError, replan, report_failure, wait_generation

        suspect = getattr(e, "node", None)
        if suspect is None:
            suspect = getattr(e, "peer", None)
        print(f"skiptrain node {self.rank}: generation {self.gen}, iteration {it} of {phase}: "
              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}; abandoning the iteration", file=sys.stderr,
              flush=True)
        report_failure(self.store, self.gen, self.rank, suspect, str(e), bad_peer=isinstance(e, BadPayload))
        gen, info = wait_generation(self.store, self.gen, 2 * self.job.rt.timeout_s + (self.job.rt.heartbeat_deadline_s or 0),
                                    self.coord_key)
        if self.rank not in info["alive"]:
            raise RecoveryError(f"node {self.rank}: fenced out of generation {gen} by the coordinator",
                                node=self.rank)
        if self._pre_join is not None and self._pre_join[0] in info.get("cancelled", []):
            sched = self._pre_join[1]               # the join was cancelled: back to the schedule before it
        self._pre_join = None
        self._regroup(gen, info["alive"])
        # agree whether the iteration was committed anywhere (then it is not re-run)
        flag = torch.tensor([1 if committed else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._any_committed = bool(flag.item())
        new = replan(sched, self.alive, takeover=self.job.rt.takeover)
        print(f"skiptrain node {self.rank}: generation {gen}: alive {self.alive}, dead "
              f"{ {k: v[:80] for k, v in info['dead'].items()} }; placement {new.placement}", file=sys.stderr,
              flush=True)
        return new, True

    def _settle(self, committed: bool, stepped: bool, it: int, model, strats: dict, opt, lr: float,
                res) -> bool:
        """After re-forming: a committed iteration whose stage sync did not finish is synced over
        the surviving replicas with the gradients held; otherwise gradients are dropped.  (That
        re-done step clips by the norm of this node's stages: the other stages stepped already.)
        ``strats``: the strategy of each stage this node serves."""
        from .step import HostedStage, optimizer_step

        from .recovery import RecoveryError

        redone = False
        self.ckpt.wait_snapshot()
        if model is not None:
            need = torch.tensor([0 if stepped else 1, 1 if stepped else 0], dtype=torch.int64)
            if self._any_committed:
                seen = {}
                for s, strat in sorted(strats.items()):      # every stage group first (ascending: no
                    seen[s] = need.clone().to(strat.tr.device)   # deadlock), on its backend's device
                    dist.all_reduce(seen[s], op=dist.ReduceOp.MAX, group=strat.tr.group)
                for s, got in seen.items():
                    got = got.cpu()
                    if got[0] and got[1]:
                        raise RecoveryError(f"node {self.rank}: replicas of stage {s} disagree whether "
                                            f"iteration {it} was applied", node=None)
                    need = torch.maximum(need, got)
                if need[0] and res is not None:
                    optimizer_step([HostedStage(s, strat, res.processed.get(s, 0), strat.world)
                                    for s, strat in sorted(strats.items())], opt, lr, self.cfg.train.grad_clip)
                    redone = True
            for p in model.parameters():
                p.grad = None
        return redone

    def finish(self) -> None:
        self.tr.close()
        dist.barrier()
        self.hb.finish()


def sync_summary(strats: list, n_params: int) -> dict:
    """What a node's sync strategies did over the phase (one per stage it serves): bytes per
    step summed over them, counts of the first, the parameter hashes of all (replica checks)."""
    from ..dp.consistency import param_hashes

    parts = [x.summary() for x in strats]
    out = dict(parts[0])
    for k in ("params", "payload_bytes_per_step", "payload_bytes_per_sync", "received_bytes_per_step",
              "control_bytes_per_step", "dense_fp32_payload_bytes", "dense_fp32_received_bytes"):
        out[k] = sum(p[k] for p in parts)
    for k, num, den in (("ratio_payload_vs_fp32", "dense_fp32_payload_bytes", "payload_bytes_per_step"),
                        ("ratio_received_vs_fp32", "dense_fp32_received_bytes", "received_bytes_per_step")):
        out[k] = out[num] / out[den] if out[den] else float("inf")
    out.update(emulated_link_s=sum(x.tr.emulated_s for x in strats), n_params=n_params,
               param_hashes=param_hashes([kv for x in strats for kv in x.named]).tolist())
    return out


def device_of_node(cfg, node: int, local_rank: int) -> torch.device:
    """The device swarm node ``node`` computes on (``runtime.devices``, else ``train.device``
    with ``cuda`` = ``cuda:local_rank`` modulo the visible GPUs; ``auto`` is the CPU in an elastic
    swarm, whose transitions run there); refused in one line: a device this process does not
    have, ``dp.backend=nccl`` off CUDA, elastic freezing on a device asked for off the CPU."""
    from ..config import node_devices
    from ..errors import UserError
    from ..model.device import node_device

    devices = node_devices(cfg.runtime.devices)
    asked = devices[node] if node < len(devices) else cfg.train.device
    if cfg.elastic.enabled and asked == "auto":
        devices, train_device = [], "cpu"
    else:
        train_device = cfg.train.device
    dev = node_device(train_device, devices, node, local_rank)
    if cfg.dp.backend == "nccl" and dev.type != "cuda":
        raise UserError(f"dp.backend=nccl needs every replica on a CUDA device, but node {node} computes "
                        f"on {dev}; set dp.backend=gloo, or give the node a GPU (train.device, runtime.devices)")
    if cfg.elastic.enabled and dev.type != "cpu":
        raise UserError(f"elastic.enabled: a swarm's freeze transitions move stages through host memory and run "
                        f"on the CPU only, but node {node} would compute on {dev}; set train.device=cpu "
                        "(and runtime.devices empty) or elastic.enabled=false")
    return dev


def check_swarm_memory(cfg, stages_of: dict[int, list[int]] | None = None) -> None:
    """Refuse in one line, before any node process starts, a local swarm with a node whose stages
    cannot fit its device: the check each node makes when it builds them
    (:func:`~skiptrain.model.device.check_stages_fit`, ``runtime.memory`` micro-batches in flight,
    on the device :func:`device_of_node` gives node ``r`` with ``LOCAL_RANK=r``).  ``stages_of``
    is the planned layout (node -> stages); without it (before planning), ``runtime.node_stages``
    when given, else every stage on the swarm's largest device (a stage that does not fit there
    fits no node)."""
    from ..config import node_stage_lists
    from ..model.device import check_stages_fit
    from ..model.memory import device_memory_bytes

    rt, t = cfg.runtime, cfg.train
    devices = {n: device_of_node(cfg, n, n) for n in range(rt.nodes)}
    if stages_of is not None:
        layout = [(n, stages, "") for n, stages in sorted(stages_of.items())]
    elif rt.node_stages.strip():
        layout = [(n, stages, "") for n, stages in enumerate(node_stage_lists(rt.node_stages))]
    else:
        largest = max(devices, key=lambda n: device_memory_bytes(devices[n]))
        layout = [(largest, [s], ", the swarm's largest device") for s in range(cfg.model.n_stages)]
    model = cfg.model
    if t.init_from:                      # the nodes build the pre-trained model's shapes
        from ..checkpoint.hf_import import model_config_for_data
        model = model_config_for_data(t.init_from, cfg.model, cfg.model.vocab_size)
    seen = set()
    for node, stages, note in layout:
        dev = devices[node]
        if (dev, tuple(stages)) not in seen:
            seen.add((dev, tuple(stages)))
            check_stages_fit(model, list(stages), dev, t.micro_batch, rt.memory, t.precision,
                             where=f"node {node}'s {dev}{note}")


def _warm_up(model, stage: int, cfg, device: torch.device) -> None:
    """One throw-away forward and backward of this node's pieces on its device and in its
    precision (first calls of torch kernels and the autograd engine are slow), so the timed
    iterations measure the steady state."""
    from ..model.device import autocast

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


#: How long a joiner's store client may take to connect to the run's store and pass its handshake: a
#: store answers within milliseconds; something else listening there (another service) is given up on
#: after this, not after the client's 30 s of retries.
JOIN_CONNECT_S = 3.0


#: a copy of the process's real stderr, once file descriptor 2 has been pointed at /dev/null for good
_REAL_STDERR: dict[str, int] = {}


def _silence_native_stderr() -> int:
    """Point file descriptor 2 at /dev/null (c10d's C++ log lines, a stack dump per store-client
    retry, cannot be turned off once torch is imported); returns a copy of the real stderr."""
    sys.stderr.flush()
    saved = os.dup(_REAL_STDERR.get("fd", 2))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return saved


def _store_client(host: str, port: int):
    """A store client of ``host:port`` that passed its handshake within ``JOIN_CONNECT_S``, else one
    ``RuntimeError``.  The client retries a server that answers garbage only for its timeout, but waits
    for the reply to its handshake with no deadline, so a server that reads and never answers (an HTTP
    server, a silent service) would hold it for good: it connects in a daemon thread, given up on one
    second past the timeout (that thread then ends when the server closes, or with the process)."""
    out: dict[str, Any] = {}

    def connect() -> None:
        try:
            out["store"] = dist.TCPStore(host, port, 1, is_master=False, wait_for_workers=False,
                                         timeout=timedelta(seconds=JOIN_CONNECT_S))
        except Exception as e:  # noqa: BLE001
            out["error"] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__

    saved = _silence_native_stderr()
    t = threading.Thread(target=connect, name="join-store-client", daemon=True)
    t.start()
    t.join(JOIN_CONNECT_S + 1.0)
    abandoned = t.is_alive()
    if abandoned:          # the client may log retries for a while yet: file descriptor 2 stays on
        _REAL_STDERR.setdefault("fd", saved)      # /dev/null, Python's output goes to the real stderr
        sys.stderr = os.fdopen(os.dup(_REAL_STDERR["fd"]), "w", buffering=1, errors="backslashreplace")
        if saved != _REAL_STDERR["fd"]:
            os.close(saved)
    else:
        os.dup2(saved, 2)
        os.close(saved)
    if not abandoned and "store" in out:
        return out["store"]
    raise RuntimeError(f"{host}:{port} accepts connections but does not answer as a run's store within "
                       f"{JOIN_CONNECT_S:g} s ({out.get('error', 'no reply to its handshake')}); check HOST:PORT "
                       "against the run's RUN_DIR/join.json")


def _connect_for_join(target: str):
    """``HOST:PORT`` of a running job's store -> (addr, port, store, job, node id)."""
    from .join import JOB_KEY, read_job, request_node_id, secret_from_env

    host, sep, port_s = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # ([::1]:PORT)
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:29500; RUN_DIR/join.json of "
                         f"the run has it), got {target!r}")
    port = int(port_s)
    try:   # (a closed port: at once, not after the store client's 30 s of retries and C++ stack dumps)
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        raise RuntimeError(f"no store answers at {host}:{port} ({e.strerror or e}); is the run still going, and was "
                           "it launched with recovery on (--recover)?") from None
    store = _store_client(host, port)
    store.set_timeout(timedelta(seconds=30))
    if not store.check([JOB_KEY, "nodes/next"]):
        raise RuntimeError(f"the run at {host}:{port} does not accept joining nodes: launch it with --recover")
    job = Job.from_dict(read_job(store, secret_from_env()))
    return host, port, store, job, request_node_id(store)


def main(argv: list[str] | None = None, node_class: type[Node] = Node) -> int:
    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.node", description=__doc__.split("\n")[0])
    ap.add_argument("--job", help="job JSON written by `skiptrain launch` / the launcher")
    ap.add_argument("--join", metavar="HOST:PORT", default=None,
                    help="join a running job (recovery mode) through its coordinator's store; the join secret "
                         "comes from SKIPTRAIN_JOIN_SECRET")
    args = ap.parse_args(argv)
    if not args.job and not args.join:
        ap.error("give --job JOB.json (a node of a launch) or --join HOST:PORT (a node joining a running job)")
    if os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1" and os.environ.get("SKIPTRAIN_DETACHED") != "1":
        set_parent_death_signal()     # (detached: the store lives on its own and the coordinator may restart)
    torch.set_num_threads(1)
    import faulthandler
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: stacks to the log
    except (ValueError, OSError, AttributeError):                  # stderr without a file descriptor
        pass
    store = None
    if args.join:
        try:
            addr, port, store, job, rank = _connect_for_join(args.join)
        except (ValueError, RuntimeError, OSError) as e:
            from .join import EXIT_REFUSED, JoinRefused
            print(f"skiptrain node: cannot join {args.join}: {e}", file=sys.stderr)
            code = EXIT_REFUSED if isinstance(e, JoinRefused) else 2
            if _REAL_STDERR:    # a store client given up on is still inside C++: finalizing the
                sys.stdout.flush()   # interpreter around it can abort the process, so end it here
                sys.stderr.flush()
                os._exit(code)
            return code
        world = job.world
    else:
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError) as e:
            print(f"skiptrain node: set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE ({e})", file=sys.stderr)
            return 2
        job = Job.load(args.job)
    err_path = Path(job.run_dir) / "errors" / f"node{rank}.json"
    node = None
    try:
        node = node_class(job, rank, world, addr, port, store=store)
        for i, ph in enumerate(job.phases):
            if node.joining is not None and i < node.joining["phase"]:
                continue
            if job.resume and i < job.resume["phase"]:
                continue
            node.run_phase(ph, i)
            if node.stopped:
                break
        node.finish()
    except NodeFailure as e:
        from .join import EXIT_REFUSED, JoinRefused

        write_error(err_path, rank, e, e.node)
        abort_process(EXIT_REFUSED if isinstance(e, JoinRefused) else EXIT_FAILED)
    except BaseException as e:  # noqa: BLE001 - report anything, then leave at once
        # a gloo error in a collective means some peer failed (which one: the launcher knows)
        # (gloo's timeouts and resets arrive as plain RuntimeErrors naming gloo's sources)
        peer_side = isinstance(e, dist.DistError) or "/gloo/" in str(e)
        write_error(err_path, rank, e, None if peer_side else rank)
        abort_process(EXIT_FAILED)
    abort_process(0)  # skip interpreter teardown (gloo/threads); everything is written
    return 0


if __name__ == "__main__":
    sys.exit(main())
