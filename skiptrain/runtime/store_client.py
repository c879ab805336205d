"""A client of a run's store on another host: the address parsed, the connection given up on in
seconds when nothing (or something else) answers there, and the run's job read from it.

Failure semantics: every function raises :class:`ValueError` (a malformed address) or
:class:`RuntimeError` (no store answers there, it is not a run's store, or the run does not take
nodes) with one line naming the fix; a store client given up on leaves file descriptor 2 on
/dev/null for good (:data:`REAL_STDERR` holds the real one), since its C++ retries would print a
stack dump each.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist


#: How long a joiner's store client may take to connect to the run's store and pass its handshake: a
#: store answers within milliseconds; something else listening there (another service) is given up on
#: after this, not after the client's 30 s of retries.
JOIN_CONNECT_S = 3.0


#: a copy of the process's real stderr, once file descriptor 2 has been pointed at /dev/null for good
REAL_STDERR: dict[str, int] = {}


def silence_native_stderr() -> int:
    """Point file descriptor 2 at /dev/null (c10d's C++ log lines, a stack dump per store-client
    retry, cannot be turned off once torch is imported); returns a copy of the real stderr."""
    sys.stderr.flush()
    saved = os.dup(REAL_STDERR.get("fd", 2))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return saved


def python_only_stderr(saved: int | None = None) -> None:
    """From now on, only Python's own output reaches stderr: file descriptor 2 stays on /dev/null
    for good (a store client whose server is gone logs a C++ stack dump per call, and may for a
    while yet) and ``sys.stderr`` writes to the real one.  ``saved``: the copy
    :func:`silence_native_stderr` returned, when it was called already."""
    saved = silence_native_stderr() if saved is None else saved
    REAL_STDERR.setdefault("fd", saved)
    sys.stderr = os.fdopen(os.dup(REAL_STDERR["fd"]), "w", buffering=1, errors="backslashreplace")
    if saved != REAL_STDERR["fd"]:
        os.close(saved)


def connect(host: str, port: int):
    """A store client of ``host:port`` that passed its handshake within ``JOIN_CONNECT_S``, else one
    ``RuntimeError``.  The client retries a server that answers garbage only for its timeout, but waits
    for the reply to its handshake with no deadline, so a server that reads and never answers (an HTTP
    server, a silent service) would hold it for good: it connects in a daemon thread, given up on one
    second past the timeout (that thread then ends when the server closes, or with the process)."""
    out: dict[str, Any] = {}

    def connect() -> None:
        try:
            out["store"] = dist.TCPStore(host, port, 1, is_master=False, wait_for_workers=False,
                                         timeout=timedelta(seconds=JOIN_CONNECT_S))
        except Exception as e:  # noqa: BLE001
            out["error"] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__

    saved = silence_native_stderr()
    t = threading.Thread(target=connect, name="join-store-client", daemon=True)
    t.start()
    t.join(JOIN_CONNECT_S + 1.0)
    abandoned = t.is_alive()
    if abandoned:          # the client may log retries for a while yet
        python_only_stderr(saved)
    else:
        os.dup2(saved, 2)
        os.close(saved)
    if not abandoned and "store" in out:
        return out["store"]
    raise RuntimeError(f"{host}:{port} accepts connections but does not answer as a run's store within "
                       f"{JOIN_CONNECT_S:g} s ({out.get('error', 'no reply to its handshake')}); check HOST:PORT "
                       "against the run's RUN_DIR/join.json")


def parse_address(target: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port), or one ``ValueError``."""
    host, sep, port_s = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:29500), got {target!r}")
    return host, int(port_s)


def open_run(target: str, secret: str | None = None) -> tuple[str, int, Any, dict]:
    """``HOST:PORT`` of a running job's store -> (host, port, store client, job as a dict, read
    and checked with ``secret``, else the run's secret from the environment)."""
    from .join import JOB_KEY, read_job, secret_from_env

    host, port = parse_address(target)
    try:   # (a closed port: at once, not after the store client's 30 s of retries and C++ stack dumps)
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        raise RuntimeError(f"no store answers at {host}:{port} ({e.strerror or e}); is the run's coordinator "
                           "running there, and was it launched with recovery on (--recover)?") from None
    store = connect(host, port)
    store.set_timeout(timedelta(seconds=30))
    if not store.check([JOB_KEY, "nodes/next"]):
        raise RuntimeError(f"the run at {host}:{port} does not accept joining nodes: launch it with --recover")
    return host, port, store, read_job(store, secret or secret_from_env())

