"""``RUN_DIR/swarm.json``: the watcher's view of the swarm, for the dashboard and ``skiptrain status``.

Who watches the nodes (the coordinator in recovery mode, else the launcher's fail-fast monitor)
rewrites this file at most every :data:`SNAPSHOT_EVERY_S` seconds, atomically (a temporary file
renamed over it), from what it holds anyway: the generation in force, each node's status as the
watcher sees it (``alive``, ``joining``, ``fenced``, ``done``, ``failed``), the age of its lease
on the watcher's clock and the lease's length, its host and its stages.  Nothing here reads a
node; the cost is one small file write per interval.

``nodes`` of the file, one dict a node: ``node``, ``host``, ``stages``, ``status``,
``lease_age_s`` and ``lease_s`` (None when no renewal was read), ``gen`` (the generation its last
renewal named).  The file also says ``t`` (unix seconds of the write), ``gen``, ``mode``
(``recover`` or ``fail-fast``), ``heartbeat_s`` and ``done`` (true once the watcher stopped).

Failure semantics: a failed write (a full disk, a removed directory) is skipped, never raised.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

#: The file's name in the run directory.
SWARM_NAME = "swarm.json"
#: Seconds between two writes of the file.
SNAPSHOT_EVERY_S = 0.5


def host_of_hello(raw: str | None) -> str | None:
    """The host a node named in its join hello (``join/hello/<r>``, tag stripped), else None."""
    try:
        host = json.loads(raw).get("host") if raw else None
    except (ValueError, AttributeError):
        return None
    return str(host)[:100] if host else None


class SwarmSnapshot:
    """Writes ``swarm.json``: :meth:`due` says when, :meth:`write` writes (both cheap)."""

    def __init__(self, run_dir: str | Path, mode: str, heartbeat_s: float, every_s: float = SNAPSHOT_EVERY_S,
                 clock=time.monotonic):
        self.path = Path(run_dir) / SWARM_NAME
        self.mode, self.heartbeat_s, self.every_s, self.clock = mode, heartbeat_s, every_s, clock
        self.next_t = 0.0
        self.hosts: dict[int, str] = {}
        self.placement: list[list[int]] = []
        self.stages: dict[int, list[int]] = {}

    def due(self) -> bool:
        return self.clock() >= self.next_t

    def node(self, r: int, status: str, leases=None) -> dict:
        """Node ``r``'s entry: its status, its lease as ``leases`` (a LeaseTable) has it, its host
        (:attr:`hosts`, else this machine's name) and its stages in :attr:`placement`."""
        last = leases.last.get(r) if leases is not None else None
        age = leases.age(r) if leases is not None else None
        stages = [s for s, nodes in enumerate(self.placement) if r in nodes] or self.stages.get(r, [])
        self.stages[r] = stages            # (a fenced node keeps the stages it served last)
        return {"node": r, "host": self.hosts.get(r) or socket.gethostname(), "stages": stages, "status": status,
                "lease_age_s": None if age is None else round(age, 3),
                "lease_s": None if last is None else round(leases.lease_of(r), 3),
                "gen": None if last is None else last.gen}

    def write(self, gen: int, nodes: list[dict], done: bool = False) -> None:
        """Write the file now (and time the next write from now)."""
        self.next_t = self.clock() + self.every_s
        snap = {"t": round(time.time(), 3), "gen": gen, "mode": self.mode, "heartbeat_s": self.heartbeat_s,
                "done": done, "nodes": sorted(nodes, key=lambda n: n["node"])}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(snap))
            os.replace(tmp, self.path)
        except OSError:
            pass
