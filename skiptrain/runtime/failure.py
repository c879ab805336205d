"""Failure detection for the node processes: timeouts, heartbeats, clear errors, no orphans.

Default policy: **fail fast and stop everything**.  Any node that cannot continue
raises :class:`NodeFailure` naming the node at fault; the launcher kills the remaining
processes by PID and reports the root cause.  How a failure is noticed:

* **killed peer**: gloo resets the connection, the transport of every node talking to it raises
  within tens of milliseconds (:class:`~skiptrain.runtime.transport.TransportError` with the
  peer); the launcher also sees the exit status (signal) of the dead process directly;
* **hung peer** (stopped, deadlocked, partitioned): its heartbeat key in the rendezvous store
  stops advancing; :class:`Heartbeat` in every node and the launcher's monitor declare it failed
  after ``timeout_s``; waits in the executor and gloo's group timeout are bounded by the same
  ``timeout_s``, so nothing blocks forever;
* **lost store / launcher gone**: a heartbeat write that fails makes the node exit; children
  also get SIGKILL from the kernel when the launcher dies (``PR_SET_PDEATHSIG``).

With ``job.rt.recover`` the reaction is different: the launcher's coordinator
(:mod:`.coordinator`) fences the failed node and publishes a new membership generation, and the
survivors re-form their groups and re-plan (:mod:`.recovery`; docs/failures.md).

Hooks (routing around failures, re-forming groups, rejoining): detection is
separate from reaction.  :class:`Heartbeat` calls ``on_failure(node, reason)``; today the node
installs :func:`abort_process` there.  A tolerant policy would instead mark the node dead in a
:class:`Membership` view, let the executor re-plan the routes of unfinished micro-batches among
live nodes, and rebuild the stage groups on a fresh store prefix (gloo groups can be destroyed and
re-created).  ``Membership.alive`` / ``Membership.generation`` are the state those steps need.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UserError
from .fencing import report_exit
from .lease import LeaseKeeper, LeaseTable, parse_renewal
from .membership import key_from_env, member_key, open_signed, secret_from_env, sign

EXIT_FAILED = 3            # this node hit an error (its own or a peer's)
EXIT_PEER_FAILED = 4       # this node stopped because a peer failed
EXIT_FENCED = 6            # this node's lease ran out: it stopped its own work (self-fencing)
EXIT_NO_COORDINATOR = 7    # stopped at a boundary: the run had no coordinator for too long (resume it)
#: the value of the run's signed stop request when it had no coordinator for too long (skiptrain.runtime.store)
NO_COORDINATOR = "no-coordinator"


class NodeFailure(RuntimeError):
    """A node could not continue; ``node`` is the node at fault (maybe another one)."""

    def __init__(self, msg: str, node: int | None = None):
        super().__init__(msg)
        self.node = node


class RuntimeFailure(UserError, RuntimeError):
    """A multi-process run stopped because a node failed; raised by the launcher."""

    def __init__(self, msg: str, node: int | None = None, detected_after_s: float | None = None):
        super().__init__(msg)
        self.node = node
        self.detected_after_s = detected_after_s


@dataclass
class Membership:
    """Which nodes are alive, and a generation bumped on every change (re-forming groups keys
    the fresh store prefix on it).  Today's policy never revives a node."""
    world: int
    alive: set[int] = field(default_factory=set)
    generation: int = 0
    reasons: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.alive:
            self.alive = set(range(self.world))

    def mark_failed(self, node: int, reason: str) -> bool:
        if node not in self.alive:
            return False
        self.alive.discard(node)
        self.reasons[node] = reason
        self.generation += 1
        return True


class Heartbeat:
    """Renews this node's lease, ``hb/<rank>`` in the store, every ``interval_s``
    (:mod:`~skiptrain.runtime.lease`: a sequence number, never a wall-clock time).

    Once :meth:`arm` is called (after every node has joined the process group, so every key
    exists) it also reads all peers' keys in one ``multi_get`` and reports a peer whose renewals
    have not advanced for ``timeout_s`` on this process's own clock, once, through
    ``on_failure(node, reason)``; peers in state ``done`` are not watched.  A failing store write
    reports node ``-1`` (the store host is gone).  ``describe(node)`` names a node in messages.

    ``on_expired`` (a run whose membership a coordinator decides): a watchdog thread, which
    never touches the store, calls it once when this node's own lease has run out because no
    renewal got through (a cut link, a stopped process resumed): the node must stop its work
    before the coordinator gives its place to another node (self-fencing).  ``lease_floor_s`` and
    ``lease_ceiling_s`` bound the lease (it follows the renewals' round trip in between)."""

    def __init__(self, store, rank: int, world: int, interval_s: float, timeout_s: float,
                 on_failure: Callable[[int, str], None],
                 describe: Callable[[int], str] = lambda n: f"node {n}",
                 lease_floor_s: float | None = None, lease_ceiling_s: float | None = None,
                 on_expired: Callable[[str], None] | None = None):
        self.store, self.rank, self.world = store, rank, world
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.on_failure = on_failure
        self.on_expired = on_expired
        self.describe = describe
        self.membership = Membership(world)
        self.key = key_from_env(rank)        # heartbeats are signed when the run has a secret
        self.secret = secret_from_env()
        floor = lease_floor_s or timeout_s
        self.keeper = LeaseKeeper(floor, max(floor, lease_ceiling_s or floor))
        self.peers = LeaseTable(timeout_s, timeout_s)
        self.gen = 0
        self.state = "run"
        self._armed = False
        self._stop = threading.Event()
        self._beating = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def beat(self) -> None:
        name = f"hb/{self.rank}"
        with self._beating:         # (one at a time: a renewal in flight never lands after the final one)
            renewal, sent = self.keeper.next(self.gen, self.state)
            self.store.set(name, sign(self.key, name, renewal.encode()))
            self.keeper.acknowledged(renewal, sent)

    def start(self) -> "Heartbeat":
        self.beat()
        self._thread.start()
        if self.on_expired is not None:
            threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True).start()
        return self

    def arm(self) -> None:
        for n in range(self.world):
            if n != self.rank:
                self.peers.watch(n)
        self._armed = True

    def lease_holds(self) -> bool:
        """Whether this node's lease still holds (it may go on working)."""
        left = self.keeper.remaining()
        return left is None or left > 0

    def finish(self) -> None:
        """This node is done: peers stop watching it; the thread stops.  Also said in a key of its
        own (``exit/<rank>``, code 0), which a renewal written back over ``hb/<rank>`` cannot hide."""
        self.state = "done"
        self._stop.set()
        try:
            self.beat()
            report_exit(self.store, self.key, self.rank, 0)
        except Exception:  # noqa: BLE001
            pass

    def stop(self) -> None:
        self._stop.set()

    def _watchdog(self) -> None:
        while not self._stop.wait(min(0.05, self.interval_s)):
            if not self.lease_holds():
                sent, lease = self.keeper.held
                self.on_expired(f"node {self.rank}: no lease renewal got through for "
                                f"{self.keeper.clock() - sent:.1f} s (lease {lease:g} s); stopping its work "
                                "before the coordinator gives its place to another node")
                return

    def _loop(self) -> None:
        peers = [n for n in range(self.world) if n != self.rank]
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                vals = self._read_peers(peers) if self._armed else {}
            except Exception as e:  # noqa: BLE001 - store gone: the launcher or rank 0 died
                if not self._stop.is_set():
                    self.on_failure(-1, f"lost the rendezvous store ({str(e).splitlines()[0][:120]}); "
                                        "the launcher or the store host is gone")
                return
            for n in peers:
                if n in self.membership.alive:
                    self._check_peer(n, vals.get(n))

    def _read_peers(self, peers: list[int]) -> dict[int, str]:
        """The live peers' ``hb`` values, in one ``multi_get`` of the keys that exist: ``multi_get``
        waits for a missing key (one that a process without the secret deleted) up to the store's
        timeout, and this node's own renewals wait behind it."""
        keys = {n: f"hb/{n}" for n in peers if n in self.membership.alive and self.store.check([f"hb/{n}"])}
        vals = self.store.multi_get(list(keys.values())) if keys else []
        return {n: v.decode(errors="replace") for n, v in zip(keys, vals)}

    def _check_peer(self, node: int, raw: str | None) -> None:
        renewal = self._peer_renewal(node, f"hb/{node}", raw) if raw is not None else None
        if renewal is not None:
            self.peers.observe(node, renewal)
        else:
            self.peers.dispute(node)         # deleted or overwritten: judged a lease later
        if node not in self.membership.alive or not self.peers.expired(node):
            return
        reason = (f"{self.describe(node)} stopped responding: no heartbeat for {self.peers.age(node):.1f} s "
                  f"(timeout {self.timeout_s:g} s)")
        if self.membership.mark_failed(node, reason):
            self.on_failure(node, reason)

    def _peer_renewal(self, node: int, name: str, raw: str):
        """A peer's renewal, or None when the run has a secret and its tag does not verify."""
        if self.secret:
            raw = open_signed(member_key(self.secret, node), name, raw)
            if raw is None:
                return None
        return parse_renewal(raw)


def write_error(path: str | Path | None, rank: int, exc: BaseException, node_at_fault: int | None) -> None:
    """Leave a JSON error report for the launcher (best effort) and print one line to stderr."""
    msg = str(exc) or type(exc).__name__
    print(f"skiptrain node {rank}: {type(exc).__name__}: {msg}", file=sys.stderr, flush=True)
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"rank": rank, "type": type(exc).__name__, "msg": msg,
                                          "node": node_at_fault, "time": time.time(),
                                          "tb": traceback.format_exc()}))
    except OSError:
        pass


def abort_process(code: int = EXIT_PEER_FAILED) -> None:
    """Exit now without running atexit handlers or joining threads: a peer failure can leave
    gloo calls blocked in C++, and a normal exit would wait for them."""
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def pid_running(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie): joining nodes are not this process's children.
    ``pid <= 1`` is never a node (0 and -1 address process groups / everything; 1 is init)."""
    if pid <= 1:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
