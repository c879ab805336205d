"""The coordinator's view of which node processes still run, and fencing without signals.

:class:`Members` answers for the nodes the coordinator's own launcher started (their exit
status: a fail-fast node's own, or what its supervisor reported,
:class:`~skiptrain.runtime.node_processes.SupervisedNode`) and for every other node by what
reaches the store from its host: its lease renewals
(:mod:`~skiptrain.runtime.lease`, timed on the coordinator's clock) and the exit report that the
node's supervisor on its own host (``skiptrain node``) signs when the process ends
(``exit/<node>``, :func:`report_exit`).

Fencing a node means leaving it out of the next generation.  The coordinator signals only
processes it started itself (:meth:`Members.kill`); every other node stops its own work when its
lease runs out (:class:`~skiptrain.runtime.failure.Heartbeat`'s watchdog), which is before the
coordinator's deadline for it, so the two never train side by side.  No PID ever crosses a host.
"""

from __future__ import annotations

import json
import time

from .lease import FENCE_MARGIN_S, LeaseTable, parse_renewal
from .membership import Verifier, sign


def report_exit(store, key: bytes | None, node: int, code: int) -> None:
    """Supervisor side: node ``node``'s process ended with ``code`` (negative: killed by that
    signal), signed with the node's member key."""
    name = f"exit/{node}"
    store.set(name, sign(key, name, json.dumps({"code": int(code)})))


def read_exit(store, verifier: Verifier, node: int) -> int | None:
    """Node ``node``'s exit status as its supervisor reported it (:func:`report_exit`), None when
    there is no report, or none its key signed."""
    name = f"exit/{node}"
    raw = verifier.read(store, node, name) if store.check([name]) else None
    try:
        return int(json.loads(raw)["code"]) if raw is not None else None
    except (ValueError, KeyError, TypeError):
        return None


class RowEvidence:
    """Progress a process without the secret cannot fake or replay: the iteration lines of the
    run's ``metrics.jsonl`` that appear after this was made (rank 0 writes one only once every
    node of its generation took part in that iteration's statistics gather; across hosts the
    coordinator's mirror writes the rows nodes signed, each slot read once).  A new line of
    generation ``g`` vouches for every node alive in ``g`` (:meth:`LeaseTable.vouch`), so a
    renewal key written back over and over cannot get a training node fenced."""

    def __init__(self, path):
        from pathlib import Path

        self.path = Path(path)
        try:
            self.offset = self.path.stat().st_size     # (older lines prove nothing about now)
        except OSError:
            self.offset = 0

    def new_iteration(self, gen: int) -> bool:
        """Whether an iteration line of generation ``gen`` appeared since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return False
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        found = False
        for line in whole.splitlines():
            try:
                row = json.loads(line)
                found = found or (row.get("gen") == gen and "val_loss" not in row and "step" in row)
            except (ValueError, AttributeError):
                continue
        return found


class Members:
    """Exit status and leases of the run's node processes (see the module's docstring)."""

    def __init__(self, procs, store, verifier: Verifier, leases: LeaseTable):
        self.procs, self.store, self.verifier, self.leases = procs, store, verifier, leases

    def is_child(self, r: int) -> bool:
        return r < len(self.procs)

    def code(self, r: int) -> int | None:
        """``r``'s exit status (None: running, as far as the coordinator knows).  A node whose
        last renewal says ``done`` has finished (0), whether or not its exit has been seen yet
        (a local node's is seen when its supervisor ends)."""
        code = self.procs[r].poll() if self.is_child(r) else read_exit(self.store, self.verifier, r)
        if code is not None:
            return code
        last = self.leases.last.get(r)
        return 0 if last is not None and last.state == "done" else None

    def renew(self, nodes) -> dict[int, str]:
        """Read the renewals of ``nodes`` into the lease table; returns the nodes whose value was
        not a newer renewal of the incarnation known (``"stale"``: written back; ``"conflict"``:
        a second process claims the identity)."""
        odd = {}
        for r in sorted(nodes):
            value = self.verifier.read(self.store, r, f"hb/{r}")
            renewal = parse_renewal(value) if value is not None else None
            if renewal is None:        # deleted, or overwritten with something not r's: judged a lease later
                self.leases.dispute(r)
                continue
            seen = self.leases.observe(r, renewal)
            if seen == "stale":
                self.verifier.reject(f"hb/{r}", value, "an older lease renewal written back over a newer one")
            if seen in ("stale", "conflict"):
                odd[r] = seen
        return odd

    def lease_lost(self, r: int, margin_s: float) -> str | None:
        """Why ``r``'s lease is over (its renewals stopped for its lease plus ``margin_s``), else None."""
        if not self.leases.expired(r, FENCE_MARGIN_S + margin_s):
            return None
        return (f"stopped responding: no lease renewal for {self.leases.age(r):.2f} s "
                f"(lease {self.leases.lease_of(r):g} s)")

    def wait(self, nodes: set[int], timeout_s: float) -> None:
        """Wait until every one of ``nodes`` exited, at most ``timeout_s``."""
        end = time.time() + timeout_s
        while time.time() < end and any(self.code(r) is None for r in nodes):
            time.sleep(0.01)

    def kill(self, r: int) -> None:
        """SIGKILL node ``r`` if it is a child this coordinator's launcher started; any other node
        is never signalled (it fences itself)."""
        if not self.is_child(r):
            return
        self.procs[r].kill()
        try:
            self.procs[r].wait(timeout=10)
        except Exception:  # noqa: BLE001
            pass
