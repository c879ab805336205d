"""The simulator's timeline of a run's planned schedule (``job.json``: the schedule, topology and
cost model of each phase), computed once per run directory and phase and kept while ``job.json``
is unchanged: the dashboard draws it next to the measured iteration."""

from __future__ import annotations

import json
from pathlib import Path

_CACHE: dict[tuple[str, str], tuple[float, dict]] = {}


def simulated_timeline(run_dir: Path, phase: str) -> dict | None:
    """``{"iteration_s", "events": [[node, kind, stage, start, end], ...]}`` of ``phase`` as
    planned, or None when ``job.json`` is not there (yet) or does not describe the phase."""
    from ..net.topology import Topology
    from ..schedule.cost import CostModel
    from ..schedule.schedule import Schedule
    from ..schedule.simulator import simulate

    path = Path(run_dir) / "job.json"
    try:
        mtime = path.stat().st_mtime
        key = (str(path.resolve()), phase)
        if key in _CACHE and _CACHE[key][0] == mtime:
            return _CACHE[key][1]
        ph = next(p for p in json.loads(path.read_text())["phases"] if p["name"] == phase)
        if not ph.get("topology") or not ph.get("cost"):
            return None
        sim = simulate(Schedule.from_dict(ph["schedule"]), Topology.from_dict(ph["topology"]),
                       CostModel.from_dict(ph["cost"]), contention=True, dp_sync=False)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    out = {"iteration_s": round(sim.iteration_s, 5),
           "events": [[e.node, e.kind, e.stage, round(e.start, 5), round(e.end, 5)] for e in sim.timeline]}
    _CACHE[key] = (mtime, out)
    return out
