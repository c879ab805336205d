"""The rendezvous store in a process of its own, so a coordinator that is stopped or starved does
not stop it, and one that dies can be replaced.

``python -m skiptrain.runtime.store --port-file PATH`` hosts a ``TCPStore`` listening on
127.0.0.1 only (``--host`` names another single address; port chosen by the OS), writes
``{"host", "port", "pid"}`` to ``PATH`` and serves until the key ``store/stop`` is set (the
coordinator does that when the run ends; when the run has a secret, the process takes it from
``SKIPTRAIN_JOIN_SECRET`` and stops only on a request signed with the coordinator's key, so a
process without the secret cannot end the run by stopping its store).  Everything the
coordinator knows lives in this store (generations and their alive sets, strikes, join nonces
and results, node PIDs), so a coordinator that dies can be replaced by ``python -m
skiptrain.runtime.coordinator_restart --run RUN_DIR`` without losing the run: the nodes keep training
meanwhile (they only need the coordinator when membership changes).

Every ``--recover`` launch starts one; with ``--with-parent`` (a run that is not restartable)
it dies with its launcher (``PR_SET_PDEATHSIG``).  ``skiptrain coordinator`` starts one bound to
its ``--bind`` address (``--host``, ``--port``), so the nodes on other hosts keep training when
the coordinator's process dies and its host lives, and ``skiptrain coordinator --resume`` takes
the live run over from it.

**A coordinator that does not come back.**  The coordinator raises a signed counter,
``coord/alive``, every heartbeat (:class:`CoordinatorWatch`).  When it has not changed for
``--coordinator-wait`` seconds on this process's clock, the store asks the nodes to stop at the
next iteration boundary (``stop``, signed, value
:data:`~skiptrain.runtime.failure.NO_COORDINATOR`: they exit with
:data:`~skiptrain.runtime.failure.EXIT_NO_COORDINATOR` and their supervisors wait for a new
coordinator), marks itself closing (:data:`CLOSING_KEY`: a new coordinator then resumes from the
last committed checkpoint instead of taking this store over) and exits once every node is done or
silent, at most :data:`CLOSE_WAIT_S` later, which frees the address for that coordinator.

Failure semantics: if this process dies, every node loses the store, its heartbeat write fails
and it exits (as with the in-launcher store); nothing is persisted on disk.  It is never left
behind for good: if the launcher died and no coordinator re-attached, it exits once every node
has been done or silent for ``--idle-exit`` seconds (default 600).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

STOP_KEY = "store/stop"
#: A store whose nodes have all been done or silent this long exits by itself (nobody left to serve).
IDLE_EXIT_S = 600.0
#: The coordinator's signed counter, raised every heartbeat (its liveness, read by this process).
ALIVE_KEY = "coord/alive"
#: Signed by the store once it asked the nodes to stop for want of a coordinator.
CLOSING_KEY = "store/closing"
#: After that request, the store exits once every node is done or silent, or this much later.
CLOSE_WAIT_S = 120.0


class CoordinatorWatch:
    """Whether the run's coordinator is gone: its signed counter (:data:`ALIVE_KEY`) has not
    changed for ``wait_s`` seconds on this process's monotonic clock since it was first seen
    (``wait_s`` 0: never gone).  An unsigned or forged value is no sign of life."""

    def __init__(self, key: bytes | None, wait_s: float, clock=time.monotonic):
        self.key, self.wait_s, self.clock = key, wait_s, clock
        self.value: str | None = None
        self.since: float | None = None

    def gone(self, raw: str | None) -> bool:
        from .membership import open_value

        now = self.clock()
        value = open_value(self.key, ALIVE_KEY, raw) if raw is not None else None
        if value is not None and value != self.value:
            self.value, self.since = value, now
        return self.wait_s > 0 and self.since is not None and now - self.since > self.wait_s


def closing(store, key: bytes | None) -> bool:
    """Whether the run's store asked its nodes to stop for want of a coordinator (it exits soon)."""
    from .membership import open_value, read_raw

    raw = read_raw(store, CLOSING_KEY)
    return raw is not None and open_value(key, CLOSING_KEY, raw) is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.store", description=__doc__.split("\n")[0])
    ap.add_argument("--port-file", required=True, help="where to write the address (JSON)")
    ap.add_argument("--poll", type=float, default=0.2, help="seconds between checks of the stop key")
    ap.add_argument("--host", default="127.0.0.1", help="the one address to listen on (default: loopback)")
    ap.add_argument("--port", type=int, default=0, help="the port to listen on (default: one the OS picks)")
    ap.add_argument("--idle-exit", type=float, default=IDLE_EXIT_S, metavar="S",
                    help="exit when every node has been done or silent for S seconds (nobody left to serve)")
    ap.add_argument("--coordinator-wait", type=float, default=0.0, metavar="S",
                    help="stop the nodes when the coordinator has given no sign of life for S seconds (0: never)")
    ap.add_argument("--with-parent", action="store_true", help="die when the process that started this one dies")
    args = ap.parse_args(argv)
    if args.with_parent:
        from .failure import set_parent_death_signal
        set_parent_death_signal()
    from .lease import LeaseTable
    from .membership import coordinator_key, host_store, open_value, read_raw, secret_from_env

    store, listening = host_store(1, 60.0, args.host, args.port)  # noqa: F841 - the socket must stay open
    tmp = Path(args.port_file).with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": args.host, "port": store.port, "pid": os.getpid()}))
    os.replace(tmp, args.port_file)
    key = coordinator_key(secret_from_env())

    def stop_requested() -> bool:
        raw = read_raw(store, STOP_KEY)
        return raw is not None and open_value(key, STOP_KEY, raw) is not None

    leases = LeaseTable(args.idle_exit, args.idle_exit)
    watch = CoordinatorWatch(key, args.coordinator_wait)
    ended_since = closed_at = None
    while not stop_requested():
        time.sleep(args.poll)
        ended = run_ended(store, leases, secret_from_env())
        if closed_at is None and watch.gone(read_raw(store, ALIVE_KEY)) and not ended:
            closed_at = time.monotonic()          # (every node done: a coordinator may yet collect their outputs)
            close_for_want_of_coordinator(store, key, args.coordinator_wait)
        ended_since = (ended_since or time.time()) if ended else None
        if closed_at is not None and (ended_since is not None or time.monotonic() - closed_at > CLOSE_WAIT_S):
            said = "the nodes stopped" if ended_since is not None else f"not every node stopped within {CLOSE_WAIT_S:g} s"
            print(f"store: {said} for want of a coordinator; exiting (a new coordinator resumes the run from its "
                  "last checkpoint)", flush=True)
            return 0
        if ended_since is not None and time.time() - ended_since >= args.idle_exit:
            print(f"store: every node has been done or silent for {args.idle_exit:g} s and no coordinator "
                  "stopped the store; exiting", flush=True)
            return 0
    time.sleep(0.5)            # let the last clients finish their calls
    return 0


def close_for_want_of_coordinator(store, key: bytes | None, wait_s: float) -> None:
    """Ask every node to stop at its next iteration boundary
    (:data:`~skiptrain.runtime.failure.NO_COORDINATOR`), and say that this store is closing (a new
    coordinator must not take it over)."""
    from .failure import NO_COORDINATOR
    from .membership import sign
    from .node.coordinator_link import STOP_KEY as RUN_STOP_KEY

    print(f"store: no sign of the coordinator for {wait_s:g} s; asking every node to stop at its next "
          "iteration boundary", flush=True)
    store.set(CLOSING_KEY, sign(key, CLOSING_KEY, "1"))
    store.set(RUN_STOP_KEY, sign(key, RUN_STOP_KEY, NO_COORDINATOR))


def run_ended(store, leases, secret: str | None = None) -> bool:
    """Whether every node that ever renewed its lease is done (its last renewal says so, or its
    exit was reported: ``exit/<r>``, signed with its member key when the run has ``secret``; a
    renewal in flight may land after the final one), or has not renewed for ``leases``'
    deadline (a :class:`~skiptrain.runtime.lease.LeaseTable`, timed on this process's clock)."""
    from .lease import parse_renewal
    from .membership import MAX_NODE_IDS, member_key, open_value, read_count, read_raw

    def exited(r: int) -> bool:
        raw = read_raw(store, f"exit/{r}")
        return raw is not None and open_value(member_key(secret, r) if secret else None, f"exit/{r}", raw) is not None

    try:
        ids = range(read_count(store, "nodes/next", MAX_NODE_IDS) or 0)
        seen = False
        for r in ids:
            renewal = parse_renewal(store.get(f"hb/{r}").decode(errors="replace")) if store.check([f"hb/{r}"]) else None
            if renewal is not None:
                seen = True
                leases.observe(r, renewal)
        return seen and all(r not in leases.last or leases.last[r].state == "done" or leases.expired(r) or exited(r)
                            for r in ids)
    except (ValueError, RuntimeError):
        return False


class DeathWatch:
    """The launcher's watch on the store process it started (:func:`start`): once that process
    ends unasked (before :meth:`stopping`), :meth:`died` gives its exit status, and only Python's
    own output reaches the launcher's stderr from then on (its store client would print a C++
    stack dump for every call to the dead store)."""

    def __init__(self, proc):
        import threading

        self.proc, self.code = proc, None
        self.asked, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._wait, name="store-watch", daemon=True).start()

    def _wait(self) -> None:
        from .store_client import python_only_stderr

        code = self.proc.wait()
        if not self.asked.is_set():
            self.code = code
            python_only_stderr()
        self.done.set()

    def stopping(self) -> None:
        self.asked.set()

    def died(self, wait_s: float = 0.5) -> int | None:
        """The exit status of a store process that ended unasked (waiting up to ``wait_s`` for the
        watch to see it), else None."""
        self.done.wait(wait_s)
        return self.code


def start(run_dir: Path, timeout_s: float = 60.0, idle_exit_s: float = IDLE_EXIT_S, secret: str | None = None,
          with_parent: bool = False, bind: tuple[str, int] | None = None, coordinator_wait_s: float = 0.0):
    """Start the store process for ``run_dir`` (``secret``: the run's, so it stops only on the
    coordinator's signed request; ``with_parent``: it dies with the calling thread's process;
    ``bind``: the address and port it listens on, else a free loopback port;
    ``coordinator_wait_s``: see the module doc); returns (Popen, host, port)."""
    import subprocess

    pf = Path(run_dir) / "store.json"
    pf.unlink(missing_ok=True)
    repo_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1")
    from .membership import SECRET_ENV
    env.pop(SECRET_ENV, None)
    if secret:
        env[SECRET_ENV] = secret
    host, port = bind or ("127.0.0.1", 0)
    log = open(Path(run_dir) / "logs" / "store.log", "ab")
    p = subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.store", "--port-file", str(pf), "--host", host,
                          "--port", str(port), "--idle-exit", str(idle_exit_s),
                          "--coordinator-wait", str(coordinator_wait_s), *(["--with-parent"] if with_parent else [])],
                         env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    deadline = time.time() + timeout_s
    while not pf.exists():
        if p.poll() is not None or time.time() > deadline:
            if p.poll() is None:
                p.kill()                              # ours, started above: do not leave it behind
                p.wait()
            raise RuntimeError(f"the store process did not start (see {Path(run_dir) / 'logs' / 'store.log'})")
        time.sleep(0.02)
    d = json.loads(pf.read_text())
    return p, d["host"], int(d["port"])


def live_run(host: str, port: int, secret: str, run_id: str, wait_s: float = 150.0) -> bool:
    """Whether the store of run ``run_id`` still serves at ``host:port`` with its nodes training
    (its coordinator's process died, its host lives): a new coordinator takes that run over.
    False when nothing listens there, and also once a store that is closing (it asked its nodes
    to stop for want of a coordinator) has exited, waited for up to ``wait_s``: the run then
    resumes from its last committed checkpoint.  Another run's store there, or one that does
    not verify with ``secret``: one ``RuntimeError`` naming the fix."""
    from .join import JoinRefused
    from .membership import coordinator_key
    from .store_client import open_run

    if not _answers(host, port):
        return False
    try:
        _, _, store, job = open_run(f"{host}:{port}", secret)
    except JoinRefused as e:
        raise RuntimeError(f"a run's store listens at {host}:{port} but {e}") from None
    theirs = str(job.get("meta", {}).get("run_id"))
    if theirs != run_id:
        raise RuntimeError(f"{host}:{port} serves another run (run id {theirs}, not {run_id}): stop that run, or "
                           "give this one another --bind")
    if not closing(store, coordinator_key(secret)):
        return True
    print(f"skiptrain coordinator: the run's store at {host}:{port} stopped its nodes for want of a coordinator; "
          "waiting for it to exit, then resuming from the last checkpoint", file=sys.stderr, flush=True)
    end = time.monotonic() + wait_s
    while _answers(host, port):
        if time.monotonic() > end:
            raise RuntimeError(f"the run's closing store at {host}:{port} did not exit within {wait_s:g} s; "
                               "try again once it has")
        time.sleep(0.5)
    return False


def _answers(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
