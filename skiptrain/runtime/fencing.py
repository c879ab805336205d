"""The coordinator's hold on a run's node processes: whether each still runs, and fencing one.

:class:`Members` answers for the children the coordinator launched (their exit status) and for
nodes that joined from outside (a PID that came signed with the node's member key, else the
node's signed heartbeat); it SIGKILLs only such processes.  :func:`verified_pid` reads the PID a
node wrote, signed, to ``pid/<node>``; one that is absent, forged or implausible is never
signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .failure import pid_running
from .membership import Verifier


class Members:
    """Exit status of the launched children and of joined (external) node processes."""

    def __init__(self, procs, store, verifier: Verifier):
        self.procs, self.store, self.verifier = procs, store, verifier
        self.ext: dict[int, int] = {}            # joined node -> pid (0: unverified, never signalled)

    def code(self, r: int) -> int | None:
        if r < len(self.procs):
            return self.procs[r].poll()
        pid = self.ext.get(r)
        if pid and pid_running(pid):
            return None
        hb = self.verifier.read(self.store, r, f"hb/{r}")
        if hb is not None and hb.endswith(":done"):
            return 0
        # no verified PID: running until its signed heartbeat says done (or goes stale: hung)
        return None if not pid else -signal.SIGKILL

    def wait(self, nodes: set[int], timeout_s: float) -> None:
        """Wait until every one of ``nodes`` exited, at most ``timeout_s``."""
        end = time.time() + timeout_s
        while time.time() < end and any(self.code(r) is None for r in nodes):
            time.sleep(0.01)

    def kill(self, r: int) -> None:
        """SIGKILL node ``r``: only a child this coordinator started, or a process whose PID came
        signed with the node's member key (a joiner's hello, a node's ``pid/<r>``)."""
        pid = self.procs[r].pid if r < len(self.procs) else self.ext.get(r)
        if pid is None or pid <= 1 or pid == os.getpid():
            return
        if r < len(self.procs):
            self.procs[r].kill()
            try:
                self.procs[r].wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        end = time.time() + 5
        while pid_running(pid) and time.time() < end:
            time.sleep(0.01)


def verified_pid(verifier: Verifier, store, node: int) -> int:
    """The PID node ``node`` wrote (signed) to ``pid/<node>``; 0 (never signalled) when absent,
    forged or implausible."""
    raw = verifier.read(store, node, f"pid/{node}")
    try:
        pid = int(raw) if raw is not None else 0
    except ValueError:
        pid = 0
    if pid <= 1 or pid == os.getpid() or pid > 2 ** 22:
        print(f"[coordinator] node {node}: no verified PID; it will not be signalled", file=sys.stderr, flush=True)
        return 0
    return pid
