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
skiptrain.runtime.coordinator --run RUN_DIR`` without losing the run: the nodes keep training
meanwhile (they only need the coordinator when membership changes).

Every ``--recover`` launch starts one; with ``--with-parent`` (a run that is not restartable)
it dies with its launcher (``PR_SET_PDEATHSIG``).

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.store", description=__doc__.split("\n")[0])
    ap.add_argument("--port-file", required=True, help="where to write the address (JSON)")
    ap.add_argument("--poll", type=float, default=0.2, help="seconds between checks of the stop key")
    ap.add_argument("--host", default="127.0.0.1", help="the one address to listen on (default: loopback)")
    ap.add_argument("--idle-exit", type=float, default=IDLE_EXIT_S, metavar="S",
                    help="exit when every node has been done or silent for S seconds (nobody left to serve)")
    ap.add_argument("--with-parent", action="store_true", help="die when the process that started this one dies")
    args = ap.parse_args(argv)
    if args.with_parent:
        from .failure import set_parent_death_signal
        set_parent_death_signal()
    from .lease import LeaseTable
    from .membership import coordinator_key, host_store, open_value, read_raw, secret_from_env

    store, listening = host_store(1, 60.0, args.host)  # noqa: F841 - the socket must stay open
    tmp = Path(args.port_file).with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": args.host, "port": store.port, "pid": os.getpid()}))
    os.replace(tmp, args.port_file)
    ended_since = None
    key = coordinator_key(secret_from_env())

    def stop_requested() -> bool:
        raw = read_raw(store, STOP_KEY)
        return raw is not None and open_value(key, STOP_KEY, raw) is not None

    leases = LeaseTable(args.idle_exit, args.idle_exit)
    while not stop_requested():
        time.sleep(args.poll)
        ended_since = (ended_since or time.time()) if run_ended(store, leases) else None
        if ended_since is not None and time.time() - ended_since >= args.idle_exit:
            print(f"store: every node has been done or silent for {args.idle_exit:g} s and no coordinator "
                  "stopped the store; exiting", flush=True)
            return 0
    time.sleep(0.5)            # let the last clients finish their calls
    return 0


def run_ended(store, leases) -> bool:
    """Whether every node that ever renewed its lease is done, or has not renewed for
    ``leases``' deadline (a :class:`~skiptrain.runtime.lease.LeaseTable`, timed on this
    process's clock)."""
    from .lease import parse_renewal
    from .membership import MAX_NODE_IDS, read_count

    try:
        ids = range(read_count(store, "nodes/next", MAX_NODE_IDS) or 0)
        seen = False
        for r in ids:
            renewal = parse_renewal(store.get(f"hb/{r}").decode(errors="replace")) if store.check([f"hb/{r}"]) else None
            if renewal is not None:
                seen = True
                leases.observe(r, renewal)
        return seen and all(r not in leases.last or leases.last[r].state == "done" or leases.expired(r) for r in ids)
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
          with_parent: bool = False):
    """Start the store process for ``run_dir`` (``secret``: the run's, so it stops only on the
    coordinator's signed request; ``with_parent``: it dies with the calling thread's process);
    returns (Popen, host, port)."""
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
    log = open(Path(run_dir) / "logs" / "store.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.store", "--port-file", str(pf),
                          "--idle-exit", str(idle_exit_s), *(["--with-parent"] if with_parent else [])], env=env,
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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


if __name__ == "__main__":
    sys.exit(main())
