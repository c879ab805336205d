"""The node process's entry point: ``python -m skiptrain.runtime.node --job JOB.json`` (a node of
a launch: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` from the environment, as
torchrun sets them) or ``--join HOST:PORT`` (a node joining a running job through its store; the
secret from ``SKIPTRAIN_JOIN_SECRET``).  Argv and environment, the join connection, exit codes.

Exit codes: 0 done; :data:`~skiptrain.runtime.failure.EXIT_FAILED` this node failed;
:data:`~skiptrain.runtime.failure.EXIT_PEER_FAILED` a peer failed;
:data:`~skiptrain.runtime.join.EXIT_REFUSED` refused admission;
:data:`~skiptrain.runtime.failure.EXIT_FENCED` its lease ran out and it stopped its work;
:data:`~skiptrain.runtime.failure.EXIT_NO_COORDINATOR` it stopped at a boundary because the run had no
coordinator for too long; 2 bad arguments or environment,
or a store that cannot be joined.  ``errors/node<r>.json`` names the node at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ...checkpoint.format import CheckpointError
from ..failure import EXIT_FAILED, EXIT_NO_COORDINATOR, NodeFailure, abort_process, set_parent_death_signal, write_error
from ..job import Job
from .loop import Node


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
    """(addr, port, store, job, node id, world) of a running job to join, or an exit code.  A
    supervisor (``skiptrain node``) hands over the node id it took (``SKIPTRAIN_NODE_ID``), this
    host's data set (``SKIPTRAIN_DATA``) and this node's own run directory
    (``SKIPTRAIN_WORK_DIR``: no file system is shared with the coordinator)."""
    from ..join import request_node_id
    from ..store_client import REAL_STDERR, open_run

    try:
        addr, port, store, job = open_run(target)
        job = _on_this_host(Job.from_dict(job), store)
        rank = int(os.environ["SKIPTRAIN_NODE_ID"]) if "SKIPTRAIN_NODE_ID" in os.environ else request_node_id(store)
    except (ValueError, RuntimeError, OSError, CheckpointError) as e:
        from ..join import EXIT_REFUSED, JoinRefused
        print(f"skiptrain node: cannot join {target}: {e}", file=sys.stderr)
        code = EXIT_REFUSED if isinstance(e, JoinRefused) else 2
        if REAL_STDERR:     # a store client given up on is still inside C++: finalizing the
            sys.stdout.flush()   # interpreter around it can abort the process, so end it here
            sys.stderr.flush()
            os._exit(code)
        return code
    return addr, port, store, job, rank, job.world


def _on_this_host(job: Job, store) -> Job:
    """``job`` as a node on another host than its coordinator runs it: its own run directory and
    data set, and a copy of the checkpoint it resumes from (the coordinator published it)."""
    if os.environ.get("SKIPTRAIN_WORK_DIR"):
        job = dataclasses.replace(job, run_dir=os.environ["SKIPTRAIN_WORK_DIR"])
    if os.environ.get("SKIPTRAIN_DATA"):
        job = dataclasses.replace(job, data_path=os.environ["SKIPTRAIN_DATA"])
    if job.resume and os.environ.get("SKIPTRAIN_WORK_DIR"):
        from ..checkpoint_relay import fetch_resume_point
        job = fetch_resume_point(job, store)
    return job


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
        node = node_class(job, rank, world, addr, port, store=store)
        _run(node)
        code = _exit_code(node)
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
    abort_process(code)  # skip interpreter teardown (gloo/threads); everything is written
    return code


def _exit_code(node) -> int:
    """0, or :data:`~skiptrain.runtime.failure.EXIT_NO_COORDINATOR` when the nodes stopped because
    the run had no coordinator for too long (its supervisor then waits for a new one)."""
    from ..failure import NO_COORDINATOR

    stopped_for_want = node.stopped and node.control.link.stopped_for == NO_COORDINATOR
    return EXIT_NO_COORDINATOR if stopped_for_want else 0
