"""The launcher's fail-fast monitor (a run without ``runtime.recover``): any node that fails stops
the run.

:func:`monitor` waits for every node process: a non-zero exit, a node whose lease renewals
(``hb/<r>``) stopped for ``job.rt.timeout_s``, or the run's time limit ends the watch with a
failure description for the launcher's error.  While it waits it keeps ``RUN_DIR/swarm.json``
(:mod:`.swarm_view`) up to date for the dashboard.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..schedule.schedule import Schedule
from .job import Job
from .lease import LeaseTable, parse_renewal
from .swarm_view import SwarmSnapshot


def _status(code: int | None) -> str:
    return "alive" if code is None else "done" if code == 0 else "failed"


def _snapshot(view: SwarmSnapshot, codes: list, leases: LeaseTable, done: bool = False) -> None:
    view.write(0, [view.node(r, _status(c), leases) for r, c in enumerate(codes)], done)


def monitor(job: Job, procs, store, world: int, t_start: float, timeout_s: float,
            run_dir: str | Path | None = None) -> dict | None:
    """Wait for all processes; return None on success or a failure description."""
    leases = LeaseTable(job.rt.timeout_s, job.rt.timeout_s)
    for r in range(world):
        leases.watch(r)
    view = SwarmSnapshot(run_dir, "fail-fast", job.rt.heartbeat_s) if run_dir is not None else None
    if view is not None:
        view.placement = Schedule.from_dict(job.phases[0].schedule).placement

    def stalest(codes, older_than: float) -> dict | None:
        """The running node whose renewals stopped longest ago, if longer than ``older_than`` s."""
        worst = None
        for r in range(world):
            try:
                renewal = parse_renewal(store.get(f"hb/{r}").decode()) if store.check([f"hb/{r}"]) else None
            except Exception:  # noqa: BLE001
                renewal = None
            if renewal is not None:
                leases.observe(r, renewal)
            age = leases.age(r)
            done = renewal is not None and renewal.state == "done"
            if not done and codes[r] is None and age > older_than and (worst is None or age > worst["age"]):
                worst = {"kind": "hung", "node": r, "age": age, "t": time.time()}
        return worst

    next_hb = time.time() + job.rt.heartbeat_s
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad or all(c == 0 for c in codes):
            if view is not None:
                _snapshot(view, codes, leases, done=True)
        if bad:
            # a peer that timed out waiting on a hung node may exit first (gloo's timeout and the
            # heartbeat deadline are the same length): blame a node that has stopped heartbeating
            hung = stalest(codes, 0.5 * job.rt.timeout_s)
            return hung or {"kind": "exit", "node": bad[0][0], "code": bad[0][1], "t": time.time()}
        if all(c == 0 for c in codes):
            return None
        now = time.time()
        if now - t_start > timeout_s:
            return {"kind": "timeout", "t": now}
        if now >= next_hb:
            next_hb = now + job.rt.heartbeat_s
            hung = stalest(codes, job.rt.timeout_s)
            if hung:
                return hung
            if view is not None:
                _snapshot(view, codes, leases)
        time.sleep(0.05)
