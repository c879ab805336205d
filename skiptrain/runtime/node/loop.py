"""The node's loop: one phase as a fixed order of component calls.

Per phase (:meth:`Node.run_phase`): build this node's stages, groups, strategy, optimizer and
executor and adopt the layout; then per iteration (:meth:`Node._iterate`):

1. heal at the boundary (:meth:`~.healing.Healer.at_boundary`: a pending join) and apply a
   pending freeze transition;
2. start together (:meth:`~.control.ControlPlane.start_together`: the common start time, or a
   stop every node agrees on);
3. run the executor over the schedule; commit (a barrier in recovery mode);
4. step (:func:`~skiptrain.runtime.step.optimizer_step`: the data-parallel sync and the one
   optimizer step);
5. report statistics (:mod:`.stats`, gathered by the control plane; rank 0 writes
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

from ..failure import EXIT_PEER_FAILED, NodeFailure, abort_process, write_error
from ..job import Job, Phase
from ..preflight import device_of_node
from ..evaluate import validate_in_loop
from ..job_checkpoint import node_checkpoint_state, save_node_checkpoint
from ..live import LiveRecord
from ..shipping import recorded_iterations
from .control import ControlPlane
from .admission import admit
from .healing import Healer
from .layout import NodeLayout
from .phase import begin_phase, end_phase
from .replan import Replanner
from .state import Attempt, PhaseState, StopRequested
from .stats import IterationStats, StatsTable, metrics_row


class Node:
    """One node process of a job: the components it is made of, and the loop of a phase over them
    (:meth:`run_phase`; one iteration: :meth:`_iterate`)."""

    def __init__(self, job: Job, rank: int, world: int, addr: str, port: int, store=None):
        from ...data.dataset import TokenDataset
        # ``store`` given: a node that connected to a running job's store (rank = the id it was handed, see main)
        self.job, self.rank, self.world = job, rank, world
        self.stopped = False           # the launcher asked to stop; the phase ended early
        self.row_step = 0              # the step of the last metrics line this node wrote
        self.run_dir = Path(job.run_dir)
        self.err_path = self.run_dir / "errors" / f"node{rank}.json"
        self.stage_of: dict[int, int] = {}
        self.control = ControlPlane(job, rank, world, addr, port, store,
                                    self._peer_failed_soft if job.rt.recover else self._peer_failed, self.describe)
        self.store = self.control.store
        joining = store is not None and rank >= job.world   # (ids below the job's world: its first members)
        self.joining = admit(self.control, joining=joining) if job.rt.recover else None
        self.control.form_groups()
        self.control.hb.arm()
        self.ds = TokenDataset.open(job.data_path)
        self.use_config(None)
        self.device = self.pick_device()
        self.tr = self.make_transport()
        self.layout = NodeLayout(self)
        self.healer = Healer(self)
        self.replanner = Replanner(self)
        self.live = LiveRecord(rank)          # phases/<phase>/live_node<r>.json, for the dashboard
        if job.rt.recover:
            self.control.watch_generations(self._membership_changed)
            if self.joining is None:
                self.control.ack()

    def use_config(self, phase_config: dict | None) -> None:
        """The job's config with the phase's overrides; the data sources that depend on it."""
        from ...config import apply_dict, config_from_dict
        from ...data.loader import SampleSource

        self.cfg = config_from_dict(self.job.config)
        if phase_config:
            apply_dict(self.cfg, phase_config, "phase config")
        if self.cfg.train.init_from:     # a pre-trained model decides the shapes
            from ...checkpoint.hf_import import model_config_for_data
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

    def _peer_failed_soft(self, node: int, reason: str) -> None:
        """Recovery mode: the coordinator decides membership; only a lost store stops the node."""
        if node == -1:
            self._peer_failed(node, reason)

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

    def _peer_failed(self, node: int, reason: str) -> None:
        write_error(self.err_path, self.rank, NodeFailure(f"node {self.rank}: {reason}", node), node)
        abort_process(EXIT_PEER_FAILED)

    def hook(self, phase: str, iteration: int, where: str, state: "PhaseState | None" = None) -> None:
        """A point where a wrapper of the node may act (fault injection in the tests,
        ``skiptrain/runtime/faults.py``): ``where`` is ``start`` (an iteration begins), ``after_pipeline``
        (its pipeline tasks are done, before the commit), ``after_commit`` (committed, before the
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
        if self.control.watch is not None:
            self.healer.at_boundary(st, a)       # a join the coordinator published
        if st.elastic is not None:
            st.elastic.apply_pending()           # a freeze transition decided at the last boundary
        t0 = self._start_together(st)
        self._run_pipeline(st, a, t0)
        self.hook(st.ph.name, st.it, "after_pipeline", st)
        self._commit(st, a, t0)
        self.hook(st.ph.name, st.it, "after_commit", st)
        events = self._step_and_record(st, a, t0)
        # a checkpoint at this boundary: every node's save-plan digest rides on the stats gather
        snap = node_checkpoint_state(self, st) if self.ckpt.due(st.it + 1, st.ph.iterations) else None
        table = self._gather_stats(st, a, events, snap[3] if snap else 0)
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
        """The common start: everyone present (and agreed whether the launcher asked to stop: then
        every node ends the phase here, writes its stage and exits), then rank 0's clock plus a
        margin, which this node waits for (on its own clock: at most the margin).  Returns that start time."""
        stop, t0, stamp = self.control.start_together()
        if stop:
            raise StopRequested(f"node {self.rank}: the launcher asked to stop")
        # rank 0's clock is trusted only within the margin: a host whose clock is off waits at most
        # the margin after the start reached it (on one host this is exactly rank 0's start time)
        now = time.time()
        delay = min(max(now - stamp, 0.0), t0 - stamp)
        t0 = now + (t0 - stamp) - delay
        time.sleep(max(0.0, t0 - time.time()))
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
        """The commit point (recovery mode: every node finished its pipeline tasks); the
        iteration's record and its samples, flushed at once."""
        if self.job.rt.recover:
            self.control.sync(dist.barrier)
        a.committed = True
        a.entry = {"events": [], "n_processed": a.res.n_processed, "t_end": 0.0, "samples": sorted(a.samples),
                   "gen": self.control.gen, "t0": t0}
        st.record["iterations"].append(a.entry)
        self.log_samples(st.out_dir, st.ph.name, st.it, a.samples)

    def _step_and_record(self, st: "PhaseState", a: "Attempt", t0: float) -> list:
        """The step, then every send finished; the iteration's events (pipeline, sync, sends) in
        its record.  Returns the events."""
        events = list(a.res.events) + self._step(st, a, t0)
        a.stepped = True
        self.tr.wait_sent(self.job.rt.timeout_s)
        events += self.tr.take_events()
        a.entry["events"] = [e.to_dict() for e in events]
        a.entry["t_end"] = max((e.end for e in events), default=0.0)
        a.entry["pipe_end"] = max((e.end for e in a.res.events), default=0.0)
        return events

    def _step(self, st: "PhaseState", a: "Attempt", t0: float) -> list:
        """The one optimizer step (:func:`~skiptrain.runtime.step.optimizer_step`) for the stages
        this node serves; a node without a stage still takes part in the global clip's sum.
        Returns the sync events for the timeline (one per served stage that has replicas)."""
        from ...schedule.timeline import Event
        from ...dp.transport import NonFiniteContribution
        from ..recovery import blame_sender, stage_grad_norms
        from ..step import HostedStage, optimizer_step

        ph, model = st.ph, st.model
        if model is None:
            a.outcome = optimizer_step([], None, a.lr, self.cfg.train.grad_clip, self.control.sum_across)
            return []
        processed = a.res.processed
        if ph.dump and st.it == 0:
            torch.save({"n": a.res.n_processed, "stage": st.stage, "processed": processed,
                        "grads": {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                                  for n, p in model.named_parameters()}},
                       st.out_dir / f"grads_node{self.rank}.pt")
        self.healer.last_gnorm = stage_grad_norms(model, st.stages)   # CheckFree's weights
        self.ckpt.wait_snapshot()
        ts = time.time()
        hosted = [HostedStage(s, strat, processed.get(s, 0), len(st.sched.placement[s])) for s, strat in
                  sorted(st.strats.items())]
        for h in hosted:                     # (a strategy with local steps syncs at the phase's end)
            h.sync.end_step = h.sync.step_count + st.ph.iterations - st.it
        try:
            a.outcome = optimizer_step(hosted, st.opt, a.lr, self.cfg.train.grad_clip, self.control.sum_across,
                                       inspect=st.elastic.observe if st.elastic is not None else None)
        except NonFiniteContribution as e:
            raise blame_sender(e, self.control.alive, self.rank) from e
        stats = [a.outcome.stats[h.stage] for h in hosted]
        a.entry["sync"] = {"payload": sum(x.payload_bytes for x in stats),
                           "received": sum(x.received_bytes for x in stats),
                           "comm_s": round(sum(x.comm_s for x in stats), 6), "synced": all(x.synced for x in stats),
                           "dense": sum(x.dense_fp32_bytes for h, x in zip(hosted, stats) if h.replicas > 1),
                           "n_total": sum(x.n_total for x in stats)}
        te = time.time()
        for p in model.parameters():
            p.grad = None
        return [Event(self.rank, "sync", None, h.stage, ts - t0, te - t0, x.payload_bytes)
                for h, x in zip(hosted, stats) if h.replicas > 1]

    def _base_stats(self, st: "PhaseState", a: "Attempt", ckpt_digest: int = 0) -> IterationStats:
        """The columns every metrics line needs: the pipeline's, the sync's, the emulation's (zeros
        for what this attempt did not get to)."""
        res, entry = a.res, a.entry or {}
        sync = entry.get("sync") or {}
        stats = IterationStats()
        for name, value in (("loss_sum", res.loss_sum if res else 0.0), ("n_loss", res.n_loss if res else 0),
                            ("t_end", entry.get("t_end", 0.0)), ("max_in_flight", res.max_in_flight if res else 0),
                            ("payload_bytes", sync.get("payload", 0)), ("received_bytes", sync.get("received", 0)),
                            ("comm_s", sync.get("comm_s", 0.0)), ("pipe_end", entry.get("pipe_end", 0.0)),
                            ("ckpt_digest", float(ckpt_digest)), ("replan", 1.0 if st.replan_pending else 0.0)):
            stats.add(name, value)
        st.emulation.add_stats(stats)
        return stats

    def _gather_stats(self, st: "PhaseState", a: "Attempt", events: list, ckpt_digest: int = 0) -> StatsTable:
        """Every node's statistics of the iteration as named columns (:mod:`.stats`): the
        pipeline's, the sync's, the drift monitor's and the freeze rule's layer norms when they are
        on, the checkpoint's save-plan digest and the re-plan flag; gathered by the control plane,
        rank 0 appends the metrics line.  Every node then sets the next iteration's start margin
        from the slowest receipt of the start time (:meth:`~.control.ControlPlane.observe_start_delay`)."""
        stats = self._base_stats(st, a, ckpt_digest)
        if st.drift is not None:
            stats.add("drift", st.drift.observe(events))
        if st.elastic is not None:
            stats.add("norms", st.elastic.take_norms())
        table = stats.table(self.control.all_gather_small(stats.packed()), self.control.alive)
        margin, delay = self.control.start_margin, table.max("start_delay")
        self.control.observe_start_delay(delay)
        if self.control.is_root():
            self._write_metrics(st, a, table, margin, delay)
        return table

    def _row_after_recovery(self, st: "PhaseState", a: "Attempt") -> None:
        """A committed iteration whose statistics a peer's failure cut short: the survivors
        gather what they have (a node that got no loss counts none) and rank 0 writes its
        metrics line, marked ``recovered`` (without ``loss`` when no survivor had one), unless a
        line of that iteration is in the run's metrics already (rank 0 wrote it, then died; across
        hosts the coordinator's mirror drops such a second line).  A failure during this gather is recovered from like any
        other (the line is then left out)."""
        stats = self._base_stats(st, a)
        try:
            table = stats.table(self.control.all_gather_small(stats.packed()), self.control.alive)
        except Exception as e:  # noqa: BLE001 - classified as in _run_iteration
            if not self.healer.recoverable(e):
                raise
            # (the iteration is committed and its step settled by the first recovery: this one
            # must neither redo the step nor record the iteration again)
            done = Attempt(step_count=a.step_count, lr=a.lr, committed=True, stepped=True, entry=a.entry or {})
            self.healer.recover(st, done, e)
            return
        written = (st.ph.name, st.it + 1) in recorded_iterations(self.run_dir / "metrics.jsonl")  # (by a dead rank 0)
        if self.control.is_root() and self.row_step != st.it + 1 and not written:
            self._write_metrics(st, a, table, self.control.start_margin, table.max("start_delay"), recovered=True)

    def _write_metrics(self, st: "PhaseState", a: "Attempt", table: StatsTable, margin: float, delay: float,
                       recovered: bool = False) -> None:
        """Rank 0: the iteration's line of ``metrics.jsonl`` from the swarm's statistics."""
        row = metrics_row(table, phase=st.ph.name, step=st.it + 1, lr=a.lr,
                          grad_norm=a.outcome.grad_norm if a.outcome is not None else None,
                          tokens=(st.it + 1) * st.gb * self.cfg.model.seq_len, margin=margin, delay=delay)
        if self.job.rt.recover:
            row.update(gen=self.control.gen, nodes=len(self.control.alive))
        if recovered:
            row["recovered"] = True
            if not table.sum("n_loss"):
                del row["loss"]
        self.write_row(row)
        self.row_step = st.it + 1

    def write_row(self, row: dict) -> None:
        """Rank 0: one line of ``metrics.jsonl`` (an iteration's, or a validation point), also sent
        to the coordinator when the run directory is not shared with it."""
        line = json.dumps(row)
        with open(self.run_dir / "metrics.jsonl", "a") as metrics:
            metrics.write(line + "\n")
        self.control.publish_row(line)

    def log_samples(self, out_dir: Path, phase: str, it: int, samples: list[int]) -> None:
        """Append the global sample indices this node trained in committed iteration ``it``
        (``samples_node<r>.jsonl``, flushed at once so it survives a SIGKILL of this node; also sent
        to the coordinator when the run directory is not shared with it)."""
        if samples:
            path = out_dir / f"samples_node{self.rank}.jsonl"
            line = json.dumps({"iteration": it, "gen": self.control.gen, "samples": sorted(samples)})
            with open(path, "a") as f:
                f.write(line + "\n")
            self.control.publish_row(line, path.relative_to(self.run_dir).as_posix())

    def check_payload(self, m) -> None:
        from ..recovery import check_payload

        c = self.cfg
        check_payload(m.kind, m.tensor, m.src, (c.train.micro_batch, c.model.seq_len, c.model.d_model), m.mb,
                      self.rank)

    def finish(self) -> None:
        """The end of the job on this node: the transport closed, every node at a last barrier,
        the heartbeat stopped."""
        self.tr.close()
        self.control.finish()
