"""Per-iteration statistics as named columns.

Each component of a node adds its numbers to one :class:`IterationStats` under a name (a scalar,
or a vector of fixed width such as the drift monitor's link factors or the freeze rule's layer
norms); every node adds the same names in the same order.  The control plane gathers the packed
rows (:meth:`~.control.ControlPlane.all_gather_small`, one small tensor per node) and
:meth:`IterationStats.table` reads them back as a :class:`StatsTable`, a column per name, one row
per node in rank order.  No reader knows another component's position in the row.
"""

from __future__ import annotations

import time

import torch


class IterationStats:
    """This node's row for one iteration: named columns in the order they were added."""

    def __init__(self) -> None:
        self.columns: dict[str, slice] = {}
        self.parts: list[torch.Tensor] = []
        self.width = 0

    def add(self, name: str, value) -> None:
        """Add column ``name``: a number, or a 1-D tensor (a vector column of its width)."""
        if name in self.columns:
            raise KeyError(f"stats column {name!r} added twice")
        vector = isinstance(value, (list, tuple)) or isinstance(value, torch.Tensor) and value.dim() > 0
        t = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
        self.columns[name] = slice(self.width, self.width + t.numel()) if vector else self.width
        self.parts.append(t)
        self.width += t.numel()

    def packed(self) -> torch.Tensor:
        """The row to gather (float64)."""
        return torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.float64)

    def table(self, rows: list[torch.Tensor], nodes: list[int]) -> "StatsTable":
        """Every node's gathered row (rank order; ``nodes``: their ids) read by this row's names."""
        return StatsTable(torch.stack(rows), dict(self.columns), list(nodes))


class StatsTable:
    """The swarm's statistics of one iteration: ``table[name]`` is a column per node (shape
    ``[nodes]``), or for a vector column ``[nodes, width]``."""

    def __init__(self, values: torch.Tensor, columns: dict, nodes: list[int]) -> None:
        self.values, self.columns, self.nodes = values, columns, nodes

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[:, self.columns[name]]

    def sum(self, name: str) -> float:
        return float(self[name].sum())

    def max(self, name: str) -> float:
        return float(self[name].max())

    def of_node(self, name: str) -> dict[int, float]:
        """A scalar column by node id."""
        return {n: float(v) for n, v in zip(self.nodes, self[name])}


def metrics_row(table: StatsTable, *, phase: str, step: int, lr: float, grad_norm: float | None, tokens: int,
                margin: float, delay: float) -> dict:
    """One iteration's line of ``metrics.jsonl`` from the swarm's statistics: the loss over every
    node's losses, the slowest node's times, the summed overruns and CPU seconds, the largest
    byte counts (one node's sync), the start margin used and the slowest start receipt; ``time``:
    rank 0's wall clock when it wrote the line (unix seconds; a stall shows as a gap)."""
    n = table.sum("n_loss")
    return {"phase": phase, "step": step, "time": round(time.time(), 3), "loss": round(table.sum("loss_sum") / max(n, 1), 5),
            "iteration_s": round(table.max("t_end"), 4), "lr": lr, "grad_norm": None if grad_norm is None else round(grad_norm, 5),
            "tokens": tokens, "overruns": int(table.sum("overruns")), "overrun_s": round(table.sum("overrun_s"), 4),
            "max_in_flight": int(table.max("max_in_flight")), "payload_bytes": int(table.max("payload_bytes")),
            "received_bytes": int(table.max("received_bytes")), "comm_s": round(table.max("comm_s"), 6),
            "pipeline_s": round(table.max("pipe_end"), 4), "cpu_s": round(table.sum("cpu_s"), 4),
            "start_margin_s": round(margin, 6), "start_delay_s": round(delay, 6)}
