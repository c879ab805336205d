"""The node's loop: one phase as a fixed order of component calls.

Per phase (:meth:`Node.run_phase`): build this node's stages, groups, strategy, optimizer and
executor and adopt the layout; then per iteration (:meth:`Node._iterate`):

1. heal at the boundary (:meth:`~.healing.Healer.at_boundary`: a pending join) and apply a
   pending freeze transition;
2. start together (:meth:`~.start.IterationStart.agree`: the common start time, or a
   stop every node agrees on);
3. run the executor over the schedule; the data-parallel sync of this node's stages
   (:func:`~.update.exchange_early`: before the commit, overlapping the swarm's remaining
   backward passes, unless the strategy clips first); commit (a barrier in recovery mode);
4. step (:mod:`.update`: the sync if it did not run yet, and the one optimizer step of this
   node's stages);
5. report statistics (:mod:`.report`: named columns gathered by the control plane; rank 0 writes
   ``metrics.jsonl``);
6. re-plan (:mod:`.replan`), feed the freeze rule, validate, checkpoint.

A recoverable failure anywhere in 1-6 goes to :meth:`~.healing.Healer.recover`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..job import Job, Phase
from ..preflight import device_of_node
from ..evaluate import validate_in_loop
from ..job_checkpoint import node_checkpoint_state, save_node_checkpoint
from ..live import LiveRecord
from .control import ControlPlane
from .admission import admit
from .healing import Healer
from .layout import NodeLayout
from .phase import begin_phase, end_phase, use_config
from .replan import Replanner
from .report import Reporter
from .state import Attempt, PhaseState, StopRequested
from .update import exchange_early, step_and_record


class Node:
    """One node process of a job: the components it is made of, and the loop of a phase over them
    (:meth:`run_phase`; one iteration: :meth:`_iterate`)."""

    def __init__(self, job: Job, rank: int, world: int, addr: str, port: int, store=None):
        from ...data.dataset import TokenDataset
        # ``store`` given: a node that connected to a running job's store (rank = the id it was handed, see main)
        self.job, self.rank, self.world = job, rank, world
        self.stopped = False           # the launcher asked to stop; the phase ended early
        self.run_dir = Path(job.run_dir)
        self.stage_of: dict[int, int] = {}
        self.control = ControlPlane(job, rank, world, addr, port, store, self.describe)
        self.store = self.control.store
        joining = store is not None and rank >= job.world   # (ids below the job's world: its first members)
        self.joining = admit(self.control, joining=joining) if job.rt.recover else None
        self.control.form_groups()
        self.control.link.hb.arm()
        self.ds = TokenDataset.open(job.data_path)
        use_config(self, None)
        self.device = self.pick_device()
        self.tr = self.make_transport()
        self.layout = NodeLayout(self)
        self.healer = Healer(self)
        self.replanner = Replanner(self)
        self.report = Reporter(self)
        self.live = LiveRecord(rank)          # phases/<phase>/live_node<r>.json, for the dashboard
        if job.rt.recover:
            self.control.link.watch_generations(self._membership_changed)
            if self.joining is None:
                self.control.link.ack()

    def pick_device(self) -> torch.device:
        """This node's device (:func:`device_of_node`), made current when it is a GPU."""
        dev = device_of_node(self.cfg, self.rank, int(os.environ.get("LOCAL_RANK", self.rank)))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return dev

    def make_transport(self):
        """The pipeline transport over this generation's p2p group (a fault-injecting wrapper of the
        node may wrap it)."""
        from ..transport import P2PTransport

        control = self.control
        return P2PTransport(self.rank, control.p2p_group, stage_of=lambda n: self.stage_of.get(n, -1),
                            rank_of=control.rank_of.__getitem__, node_of=control.alive.__getitem__, device=self.device,
                            gen=control.gen)

    def regroup(self, gen: int, alive: list[int]) -> None:
        """Re-form every process group over ``alive`` for generation ``gen``
        (:meth:`~.control.ControlPlane.regroup`) and make the transport anew on them."""
        self.control.regroup(gen, alive)
        self.tr = self.make_transport()

    def _membership_changed(self, gen: int) -> None:
        """A new generation: make the executor abandon the current iteration at once.  The watch
        thread may report a generation this node already re-formed into (it recovered from its own
        transport error meanwhile): that one is ignored, or it would abort the re-run iteration."""
        from ..transport import TransportError

        tr = self.tr                   # read first: regroup sets the generation before the new transport
        if gen <= self.control.gen:
            return
        tr.inbox.put(TransportError(f"node {self.rank}: membership generation {gen} announced; "
                                    "abandoning the iteration", peer=None))

    def describe(self, n: int) -> str:
        s = self.stage_of.get(n)
        return f"node {n}" + (f" (stage {s})" if s is not None else "")

    def hook(self, phase: str, iteration: int, where: str, state: "PhaseState | None" = None) -> None:
        """A point where a wrapper of the node may act (fault injection in the tests,
        ``skiptrain/runtime/faults.py``): ``where`` is ``start`` (an iteration begins), ``after_pipeline``
        (its pipeline tasks are done, before the sync and the commit), ``after_sync`` (the sync
        that runs before the commit done), ``after_commit`` (committed, before the
        step and the statistics) or ``recover`` (a recovery attempt).
        The node itself does nothing here."""

    def run_phase(self, ph: Phase, phase_idx: int = 0) -> None:
        """Run every iteration of one phase: set up the stage, loop (recovering from failures in
        recovery mode), then write the phase's outputs."""
        st = begin_phase(self, ph, phase_idx)
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
            self.live.flush()
            (st.out_dir / f"node{self.rank}.json").write_text(json.dumps(st.record))
        end_phase(self, st)

    def _run_iteration(self, st: "PhaseState") -> None:
        """One attempt at iteration ``st.it``; on a recoverable failure, recover and advance past
        it when some node committed it."""
        from ...optim import lr_at

        a = Attempt(step_count=st.strat.step_count if st.strat is not None else 0, lr=lr_at(st.it, self.cfg.train))
        try:
            self._iterate(st, a)
        except Exception as e:  # noqa: BLE001 - classified below
            if not self.healer.recoverable(e):
                raise
            self.healer.recover(st, a, e)
            if not (a.committed or self.healer.any_committed):
                return
            self._row_after_recovery(st, a)
        st.it += 1
        st.cursor += st.gb

    def _iterate(self, st: "PhaseState", a: "Attempt") -> None:
        """One iteration as a fixed order of component calls."""
        self.hook(st.ph.name, st.it, "start", st)
        if self.control.link.watch is not None:
            self.healer.at_boundary(st, a)       # a join the coordinator published
        if st.elastic is not None:
            st.elastic.apply_pending()           # a freeze transition decided at the last boundary
        t0 = self._start_together(st)
        self._run_pipeline(st, a, t0)
        self.hook(st.ph.name, st.it, "after_pipeline", st)
        exchange_early(self, st, a, t0)
        self.hook(st.ph.name, st.it, "after_sync", st)
        self._commit(st, a, t0)
        self.hook(st.ph.name, st.it, "after_commit", st)
        events = step_and_record(self, st, a, t0)
        # a checkpoint at this boundary: every node's save-plan digest rides on the stats gather
        snap = node_checkpoint_state(self, st) if self.ckpt.due(st.it + 1, st.ph.iterations) else None
        table = self.report.iteration(st, a, events, snap[3] if snap else 0)
        placement = [list(p) for p in st.sched.placement]
        self.replanner.after_gather(st, table)
        if st.elastic is not None:          # the freeze rule's evidence and, at a window's end, its decision
            st.elastic.after_iteration(table["norms"].sum(0))
        validate_in_loop(self, st)
        if snap is not None:
            t = time.perf_counter()
            same = st.sched.placement == placement
            save_node_checkpoint(self, st, st.it + 1, st.cursor + st.gb, snap,
                                 [(n, int(d)) for n, d in table.of_node("ckpt_digest").items()] if same else None)
            a.entry["ckpt_s"] = time.perf_counter() - t
        cache = st.elastic.cache if st.elastic is not None else None
        self.live.after_iteration(st.out_dir, st.stages, st.it + 1, a.entry, cache.hits if cache is not None else None)

    def _start_together(self, st: "PhaseState") -> float:
        """The common start (:meth:`~.start.IterationStart.agree`), or the stop every node
        agreed on: then every node ends the phase here, writes its stage and exits."""
        stop, t0, delay = self.control.start.agree()
        if stop:
            raise StopRequested(f"node {self.rank}: the launcher asked to stop")
        st.emulation.iteration_started(delay)
        return t0

    def _run_pipeline(self, st: "PhaseState", a: "Attempt", t0: float) -> None:
        """This node's tasks of the schedule (every forward and backward under the precision's
        autocast); each micro-batch's global samples recorded as it starts."""
        from ...model.device import autocast, to_device

        mbsz, c = self.cfg.train.micro_batch, st.cursor

        def batch_fn(mb_id: int):
            i = st.order[mb_id]
            samples = range(c + i * mbsz, c + (i + 1) * mbsz)
            a.samples.extend(samples)
            x, y = st.elastic.batch(self.src, samples) if st.elastic is not None else self.src.batch(samples)
            return to_device(x, self.device), to_device(y, self.device)

        with autocast(self.device, self.cfg.train.precision):
            a.res = st.ex.run_iteration(st.it, st.sched, t0, batch_fn)

    def _commit(self, st: "PhaseState", a: "Attempt", t0: float) -> None:
        """The commit point (recovery mode: every node finished its pipeline tasks, and the sync
        that runs before the commit); the
        iteration's record and its samples, flushed at once."""
        if self.job.rt.recover:
            self.control.sync(dist.barrier)
        a.committed = True
        a.entry = {"events": [], "n_processed": a.res.n_processed, "t_end": 0.0, "samples": sorted(a.samples),
                   "gen": self.control.gen, "t0": t0}
        st.record["iterations"].append(a.entry)
        self.report.log_samples(st.out_dir, st.ph.name, st.it, a.samples)

    def _row_after_recovery(self, st: "PhaseState", a: "Attempt") -> None:
        """A committed iteration whose statistics a peer's failure cut short: the survivors
        gather what they have (a node that got no loss counts none) and rank 0 writes its
        metrics line (:meth:`~.report.Reporter.recovered`).  A failure during this gather is
        recovered from like any other (the line is then left out)."""
        try:
            table = self.report.gather(self.report.base_stats(st, a))
        except Exception as e:  # noqa: BLE001 - classified as in _run_iteration
            if not self.healer.recoverable(e):
                raise
            # (the iteration is committed and its step settled by the first recovery: this one
            # must neither redo the step nor record the iteration again)
            done = Attempt(step_count=a.step_count, lr=a.lr, committed=True, stepped=True, entry=a.entry or {})
            self.healer.recover(st, done, e)
            return
        self.report.recovered(st, a, table)

    def finish(self) -> None:
        """The end of the job on this node: the transport closed, every node at a last barrier,
        the heartbeat stopped."""
        self.tr.close()
        self.control.finish()
