"""What this machine can do at best for a swarm it runs alone: the host-CPU floor of an iteration.

When every node process shares this machine's cores, an iteration cannot take less than the CPU
seconds its node processes used (``cpu_s`` of a metrics line, summed over the nodes, measured by
the emulation seam) over the cores they share.  Where that floor is above the simulated time, the
measured times follow the machine, not the cost model: the benches report the floor beside the
measured and simulated times so a reader can tell the two apart."""

from __future__ import annotations

import os
import statistics


def host_floor_s(row: dict) -> float:
    """The fewest seconds this machine can run the iteration of metrics line ``row`` in."""
    return row.get("cpu_s", 0.0) / len(os.sched_getaffinity(0))


def median_host_floor_s(rows: list[dict]) -> float:
    return round(statistics.median(map(host_floor_s, rows)), 4) if rows else 0.0
