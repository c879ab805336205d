"""The node process's entry point: ``python -m skiptrain.runtime.node --job JOB.json`` (a node of
a launch: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` from the environment, as
torchrun sets them) or ``--join HOST:PORT`` (a node joining a running job through its store; the
secret from ``SKIPTRAIN_JOIN_SECRET``).  Argv and environment, the join connection, exit codes.

Exit codes: 0 done; :data:`~skiptrain.runtime.failure.EXIT_FAILED` this node failed;
:data:`~skiptrain.runtime.failure.EXIT_PEER_FAILED` a peer failed;
:data:`~skiptrain.runtime.join.EXIT_REFUSED` refused admission; 2 bad arguments or environment,
or a store that cannot be joined.  ``errors/node<r>.json`` names the node at fault.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..failure import EXIT_FAILED, NodeFailure, abort_process, set_parent_death_signal, write_error
from ..job import Job
from .loop import Node


#: How long a joiner's store client may take to connect to the run's store and pass its handshake: a
#: store answers within milliseconds; something else listening there (another service) is given up on
#: after this, not after the client's 30 s of retries.
JOIN_CONNECT_S = 3.0


#: a copy of the process's real stderr, once file descriptor 2 has been pointed at /dev/null for good
_REAL_STDERR: dict[str, int] = {}


def _silence_native_stderr() -> int:
    """Point file descriptor 2 at /dev/null (c10d's C++ log lines, a stack dump per store-client
    retry, cannot be turned off once torch is imported); returns a copy of the real stderr."""
    sys.stderr.flush()
    saved = os.dup(_REAL_STDERR.get("fd", 2))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return saved


def _store_client(host: str, port: int):
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

    saved = _silence_native_stderr()
    t = threading.Thread(target=connect, name="join-store-client", daemon=True)
    t.start()
    t.join(JOIN_CONNECT_S + 1.0)
    abandoned = t.is_alive()
    if abandoned:          # the client may log retries for a while yet: file descriptor 2 stays on
        _REAL_STDERR.setdefault("fd", saved)      # /dev/null, Python's output goes to the real stderr
        sys.stderr = os.fdopen(os.dup(_REAL_STDERR["fd"]), "w", buffering=1, errors="backslashreplace")
        if saved != _REAL_STDERR["fd"]:
            os.close(saved)
    else:
        os.dup2(saved, 2)
        os.close(saved)
    if not abandoned and "store" in out:
        return out["store"]
    raise RuntimeError(f"{host}:{port} accepts connections but does not answer as a run's store within "
                       f"{JOIN_CONNECT_S:g} s ({out.get('error', 'no reply to its handshake')}); check HOST:PORT "
                       "against the run's RUN_DIR/join.json")


def _connect_for_join(target: str):
    """``HOST:PORT`` of a running job's store -> (addr, port, store, job, node id)."""
    from ..join import JOB_KEY, read_job, request_node_id, secret_from_env

    host, sep, port_s = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # ([::1]:PORT)
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:29500; RUN_DIR/join.json of "
                         f"the run has it), got {target!r}")
    port = int(port_s)
    try:   # (a closed port: at once, not after the store client's 30 s of retries and C++ stack dumps)
        socket.create_connection((host, port), timeout=10).close()
    except OSError as e:
        raise RuntimeError(f"no store answers at {host}:{port} ({e.strerror or e}); is the run still going, and was "
                           "it launched with recovery on (--recover)?") from None
    store = _store_client(host, port)
    store.set_timeout(timedelta(seconds=30))
    if not store.check([JOB_KEY, "nodes/next"]):
        raise RuntimeError(f"the run at {host}:{port} does not accept joining nodes: launch it with --recover")
    job = Job.from_dict(read_job(store, secret_from_env()))
    return host, port, store, job, request_node_id(store)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.node", description="A node process of a skiptrain job.")
    ap.add_argument("--job", help="job JSON written by `skiptrain launch` / the launcher")
    ap.add_argument("--join", metavar="HOST:PORT", default=None,
                    help="join a running job (recovery mode) through its coordinator's store; the join secret "
                         "comes from SKIPTRAIN_JOIN_SECRET")
    args = ap.parse_args(argv)
    if not args.job and not args.join:
        ap.error("give --job JOB.json (a node of a launch) or --join HOST:PORT (a node joining a running job)")
    return args


def _prepare_process() -> None:
    """Die with the launcher that hosts the store (unless detached), one CPU thread, and stacks of
    every thread to the log on ``kill -USR1 PID``."""
    if os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1" and os.environ.get("SKIPTRAIN_DETACHED") != "1":
        set_parent_death_signal()     # (detached: the store lives on its own and the coordinator may restart)
    torch.set_num_threads(1)
    import faulthandler
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError, AttributeError):                  # stderr without a file descriptor
        pass


def _join_target(target: str):
    """(addr, port, store, job, rank, world) of a running job to join, or an exit code."""
    try:
        addr, port, store, job, rank = _connect_for_join(target)
    except (ValueError, RuntimeError, OSError) as e:
        from ..join import EXIT_REFUSED, JoinRefused
        print(f"skiptrain node: cannot join {target}: {e}", file=sys.stderr)
        code = EXIT_REFUSED if isinstance(e, JoinRefused) else 2
        if _REAL_STDERR:    # a store client given up on is still inside C++: finalizing the
            sys.stdout.flush()   # interpreter around it can abort the process, so end it here
            sys.stderr.flush()
            os._exit(code)
        return code
    return addr, port, store, job, rank, job.world


def _launch_target(job_path: str):
    """(addr, port, None, job, rank, world) of a node of a launch (torch.distributed's
    environment), or an exit code."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        print(f"skiptrain node: set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE ({e})", file=sys.stderr)
        return 2
    return addr, port, None, Job.load(job_path), rank, world


def _run(node) -> None:
    """Every phase of the job this node takes part in, then the common finish."""
    job = node.job
    for i, ph in enumerate(job.phases):
        if node.joining is not None and i < node.joining["phase"]:
            continue
        if job.resume and i < job.resume["phase"]:
            continue
        node.run_phase(ph, i)
        if node.stopped:
            break
    node.finish()


def main(argv: list[str] | None = None, node_class: type[Node] = Node) -> int:
    """The node process: run every phase of the job (or join a running one); exit codes in the
    module's docstring.  Any failure writes ``errors/node<r>.json`` and leaves at once."""
    args = _parse(argv)
    _prepare_process()
    target = _join_target(args.join) if args.join else _launch_target(args.job)
    if isinstance(target, int):
        return target
    addr, port, store, job, rank, world = target
    err_path = Path(job.run_dir) / "errors" / f"node{rank}.json"
    try:
        _run(node_class(job, rank, world, addr, port, store=store))
    except NodeFailure as e:
        from ..join import EXIT_REFUSED, JoinRefused

        write_error(err_path, rank, e, e.node)
        abort_process(EXIT_REFUSED if isinstance(e, JoinRefused) else EXIT_FAILED)
    except BaseException as e:  # noqa: BLE001 - report anything, then leave at once
        # a gloo error in a collective means some peer failed (which one: the launcher knows)
        # (gloo's timeouts and resets arrive as plain RuntimeErrors naming gloo's sources)
        peer_side = isinstance(e, dist.DistError) or "/gloo/" in str(e)
        write_error(err_path, rank, e, None if peer_side else rank)
        abort_process(EXIT_FAILED)
    abort_process(0)  # skip interpreter teardown (gloo/threads); everything is written
    return 0
