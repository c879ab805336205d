"""What a node reports of each iteration: its statistics, rank 0's metrics line, its samples.

:class:`Reporter` builds this node's row of named columns (:mod:`.stats`: the pipeline's, the
sync's, the emulation's, and what the drift monitor and the freeze rule add), has the control
plane gather every node's row, and on rank 0 appends the iteration's line to
``RUN_DIR/metrics.jsonl``.  Each node also appends the global samples it trained in a committed
iteration to its own sample log.  Across hosts, both are also sent to the coordinator
(:meth:`~.coordinator_link.CoordinatorLink.publish_row`), whose run directory is not shared with the nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..shipping import recorded_iterations
from .state import Attempt, PhaseState
from .stats import IterationStats, StatsTable, metrics_row


class Reporter:
    """One node's statistics, metrics lines and sample log (see the module's docstring)."""

    def __init__(self, node):
        self.node = node
        self.control = node.control
        self.row_step = 0              # the step of the last metrics line this node wrote

    def base_stats(self, st: PhaseState, a: Attempt, ckpt_digest: int = 0) -> IterationStats:
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

    def gather(self, stats: IterationStats) -> StatsTable:
        """Every node's row of the iteration (a collective of the control plane)."""
        return stats.table(self.control.all_gather_small(stats.packed()), self.control.alive)

    def iteration(self, st: PhaseState, a: Attempt, events: list, ckpt_digest: int = 0) -> StatsTable:
        """Every node's statistics of the iteration as named columns: the base columns, the drift
        monitor's and the freeze rule's layer norms when they are on, the checkpoint's save-plan
        digest and the re-plan flag; rank 0 appends the metrics line.  Every node then sets the
        next iteration's start margin from the slowest receipt of the start time
        (:meth:`~.start.IterationStart.observe`)."""
        stats = self.base_stats(st, a, ckpt_digest)
        if st.drift is not None:
            stats.add("drift", st.drift.observe(events))
        if st.elastic is not None:
            stats.add("norms", st.elastic.take_norms())
        table = self.gather(stats)
        margin, delay = self.control.start.margin, table.max("start_delay")
        self.control.start.observe(delay)
        if self.control.is_root():
            self.write_metrics(st, a, table, margin, delay)
        return table

    def recovered(self, st: PhaseState, a: Attempt, table: StatsTable) -> None:
        """Rank 0, after a recovery cut a committed iteration's gather short and the survivors
        gathered again (``table``): its metrics line marked ``recovered`` (without ``loss`` when no
        survivor had one), unless a line of that iteration is in the run's metrics already (rank 0
        wrote it, then died; across hosts the coordinator's mirror drops such a second line)."""
        written = (st.ph.name, st.it + 1) in recorded_iterations(self.node.run_dir / "metrics.jsonl")
        if self.control.is_root() and self.row_step != st.it + 1 and not written:
            self.write_metrics(st, a, table, self.control.start.margin, table.max("start_delay"), recovered=True)

    def write_metrics(self, st: PhaseState, a: Attempt, table: StatsTable, margin: float, delay: float,
                      recovered: bool = False) -> None:
        """Rank 0: the iteration's line of ``metrics.jsonl`` from the swarm's statistics."""
        node = self.node
        row = metrics_row(table, phase=st.ph.name, step=st.it + 1, lr=a.lr,
                          grad_norm=a.outcome.grad_norm if a.outcome is not None else None,
                          tokens=(st.it + 1) * st.gb * node.cfg.model.seq_len, margin=margin, delay=delay)
        if node.job.rt.recover:
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
        with open(self.node.run_dir / "metrics.jsonl", "a") as metrics:
            metrics.write(line + "\n")
        self.control.link.publish_row(line)

    def log_samples(self, out_dir: Path, phase: str, it: int, samples: list[int]) -> None:
        """Append the global sample indices this node trained in committed iteration ``it``
        (``samples_node<r>.jsonl``, flushed at once so it survives a SIGKILL of this node; also sent
        to the coordinator when the run directory is not shared with it)."""
        if samples:
            path = out_dir / f"samples_node{self.node.rank}.jsonl"
            line = json.dumps({"iteration": it, "gen": self.control.gen, "samples": sorted(samples)})
            with open(path, "a") as f:
                f.write(line + "\n")
            self.control.link.publish_row(line, path.relative_to(self.node.run_dir).as_posix())
