"""The node processes of local launches, forked from one process that imports torch once.

Starting a Python process that imports torch and the node code costs about 4 s of CPU (6 s with
what a node imports on its first step); a launch of 16 nodes on a small machine would spend most
of its first minute on imports.  :func:`start_nodes` instead asks this launcher process's *fork
server* (``python -m skiptrain.runtime.fork_server``, started on the first launch and kept
for later ones) to fork one child per rank.  The fork server has imported the node code, torch's
compiler front end and every module of ``skiptrain.runtime`` and the layers below it, none of
which starts a thread or initialises CUDA on import.  Each child is what ``python -m MODULE
ARGV`` started by the launcher would be (a node, ``<node_module> --job RUN_DIR/job.json``, or
a recovery launch's node supervisor: :mod:`.launcher`): the launch's environment (its own
``RANK`` and ``LOCAL_RANK``), working directory and ``sys.path``; it imports its module itself
(already loaded for ``skiptrain.runtime.node``); output in ``RUN_DIR/logs/node<r>.log`` (a
supervisor's: ``supervisor<r>.log``), whose first line gives its PID (:func:`node_pids`);
stdin from ``/dev/null``; the default Ctrl-C handler; its own process group (its own session
when the launch is detached), so the Ctrl-C of the launcher's terminal reaches the launcher
alone, which stops the nodes at an iteration boundary (``runtime.launcher.launch``).  With
``SKIPTRAIN_FRESH_NODES=1``, or if CUDA was initialised in the fork server, each child execs a
new interpreter instead (slower starts, nothing shared).

The launcher gets one :class:`NodeProcess` per rank with the part of ``subprocess.Popen`` it
uses (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``): the fork server reaps its children
and reports each one's start and exit status on its stdout (``started LAUNCH RANK PID``,
``exited LAUNCH RANK CODE``, ``CODE`` as ``Popen.returncode``: negative for a signal); requests
go to its stdin, one JSON line each (a launch, or a kill).  ``kill()`` is carried out by the fork
server, which signals a node only while it has not reaped it: as with ``Popen.kill``, the PID of
a node that has exited is never signalled, whatever process may have it since.

Failure semantics: the fork server ignores Ctrl-C and asks for SIGKILL
when the launcher process dies (``PR_SET_PDEATHSIG``, from a thread that lives as long as the
process); so do the nodes of a launch that is not detached, when the fork server dies.  A
detached launch's nodes outlive both.  A node module that cannot be imported: that launch's
ranks exit 1, each log holding the traceback.  A request the fork server cannot carry out (a
fork refused, say): its ranks not yet forked exit 1, the reason on the fork server's stderr (the
launcher's) and in their logs.  If the fork server is killed, a node it no longer reports is
taken as exited (``-SIGKILL``) once its PID no longer runs, and the next launch starts a new
fork server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import fork_server
from .failure import RuntimeFailure, pid_running
from .fencing import read_exit
from .membership import Verifier

START_TIMEOUT_S = 300.0
SUPERVISOR_MODULE = "skiptrain.runtime.agent"      # a recovery launch's process per node: its supervisor
_PID_LINE_RE = re.compile(fork_server.PID_LINE.format(rank=r"(?P<rank>\d+)", pid=r"(?P<pid>\d+)"))


class _Waitable:
    """``Popen.wait`` over ``poll``, for the launcher's handles below."""

    rank: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.time() > end:
                raise subprocess.TimeoutExpired(f"node {self.rank}", timeout)
            time.sleep(0.01)
        return code


class NodeProcess(_Waitable):
    """One forked node process, seen from the launcher (``Popen``'s ``pid``/``poll``/``wait``)."""

    def __init__(self, nodes: "ForkedNodes", rank: int, pid: int | None):
        self._nodes, self.rank, self.pid = nodes, rank, pid

    @property
    def returncode(self) -> int | None:
        return self._nodes.code(self.rank)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the node unless it has exited (asynchronous: ``wait`` for its exit status)."""
        self._nodes.kill(self.rank)


class SupervisedNode(_Waitable):
    """Node ``node`` of a local launch seen through the supervisor the launcher started for it,
    with the part of ``Popen`` the launcher uses (``poll``, ``returncode``, ``kill``, ``wait``):
    its exit status is what the supervisor reported, signed (:func:`~.fencing.report_exit`), as
    for a node on another host, read once the supervisor has ended (with ``rejoins`` 0 it ends
    right after its report); a supervisor that ended without a report took its node with it
    (its own status, else ``-SIGKILL``).  ``kill`` SIGKILLs the supervisor, and the node dies
    with it (``PR_SET_PDEATHSIG``).  A store that no longer answers leaves the supervisor's
    status."""

    def __init__(self, supervisor, node: int, store, verifier: Verifier):
        self.supervisor, self.rank, self.store, self.verifier = supervisor, node, store, verifier
        self.pid = supervisor.pid
        self.code: int | None = None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        """None while the supervisor runs (it reports its node's exit, then exits at once: no
        store call is made for a running node), then the exit it reported."""
        if self.code is None and (ended := self.supervisor.poll()) is not None:
            try:
                self.code = read_exit(self.store, self.verifier, self.rank)
            except Exception:  # noqa: BLE001 - a store gone: the supervisor's word
                pass
            if self.code is None:
                self.code = ended or -signal.SIGKILL
        return self.code

    def kill(self) -> None:
        self.supervisor.kill()


class ForkedNodes:
    """The node processes of one launch: what the fork server reported of them."""

    def __init__(self, server: "ForkServer", launch: int, world: int):
        self.server, self.launch, self.world = server, launch, world
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}

    def code(self, rank: int) -> int | None:
        with self.server.lock:
            if rank in self.codes:
                return self.codes[rank]
            pid = self.pids.get(rank)
        if self.server.gone and (pid is None or not pid_running(pid)):
            return -signal.SIGKILL           # the fork server is gone and so is the node
        return None

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank`` through the fork server (it signals only a child it has not reaped).
        With the fork server gone, a node still running under the PID it reported (a detached
        one: the others got SIGKILL with the fork server) is signalled directly."""
        if self.code(rank) is not None:
            return
        if not self.server.gone:
            self.server.send({"kill": int(signal.SIGKILL), "launch": self.launch, "rank": rank})
            return
        pid = self.pids.get(rank)
        if pid and pid_running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def handles(self) -> list[NodeProcess]:
        """One handle per rank (``pid`` None for a rank not reported started yet)."""
        with self.server.lock:
            return [NodeProcess(self, r, self.pids.get(r)) for r in range(self.world)]

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> list[NodeProcess]:
        """Block until every rank has a PID or an exit status; the launcher's handles.  Raises
        :class:`RuntimeFailure` if that takes over ``timeout_s`` (the caller stops the ranks
        that did start: ``handles()``)."""
        end = time.time() + timeout_s
        while len(self.pids.keys() | self.codes.keys()) < self.world and not self.server.gone:
            if time.time() > end:
                raise RuntimeFailure(f"the node processes did not start within {timeout_s:g} s "
                                     "(is the machine overloaded?)")
            time.sleep(0.01)
        return self.handles()

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for every started node's exit report, then forget the launch."""
        end = time.time() + timeout_s
        while any(self.code(r) is None for r in list(self.pids)) and time.time() < end:
            time.sleep(0.01)
        with self.server.lock:
            self.server.launches.pop(self.launch, None)


class ForkServer:
    """This process's fork server: requests in, start and exit reports out (a reader thread)."""

    def __init__(self, env: dict):
        self.lock = threading.Lock()
        self.launches: dict[int, ForkedNodes] = {}
        self.next_launch = 0
        self.gone = False
        self.proc = _start_in_lasting_thread([sys.executable, "-m", fork_server.__name__], env)
        threading.Thread(target=self._read, name="fork-server-reports", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) != 4 or not all(p.lstrip("-").isdigit() for p in parts[1:]):
                continue
            launch, rank, value = map(int, parts[1:])
            with self.lock:
                nodes = self.launches.get(launch)
                if nodes is not None and parts[0] == "started":
                    nodes.pids[rank] = value
                elif nodes is not None and parts[0] == "exited":
                    nodes.codes[rank] = value
        self.gone = True

    def submit(self, request: dict) -> ForkedNodes:
        with self.lock:
            launch, self.next_launch = self.next_launch, self.next_launch + 1
            nodes = self.launches[launch] = ForkedNodes(self, launch, request["world"])
            self._write({**request, "launch": launch})
        return nodes

    def send(self, request: dict) -> None:
        with self.lock:
            self._write(request)

    def _write(self, request: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):      # (ValueError: the pipe was closed)
            self.gone = True


def _start_in_lasting_thread(cmd: list[str], env: dict) -> subprocess.Popen:
    """``Popen(cmd)`` from a daemon thread that never ends: the child's ``PR_SET_PDEATHSIG``
    fires when the *thread* that started it exits, and a launch may run in a short-lived one."""
    box: dict = {}
    ready = threading.Event()

    def owner() -> None:
        try:
            box["proc"] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        except BaseException as e:  # noqa: BLE001 - raised in the caller below
            box["error"] = e
        ready.set()
        threading.Event().wait()

    threading.Thread(target=owner, name="fork-server-owner", daemon=True).start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    return box["proc"]


_SERVER: dict[str, ForkServer] = {}
_SERVER_LOCK = threading.Lock()


def _server(env: dict) -> ForkServer:
    with _SERVER_LOCK:
        s = _SERVER.get("server")
        if s is None or s.gone or s.proc.poll() is not None:
            base = {k: v for k, v in os.environ.items() if not k.startswith("SKIPTRAIN_")}
            # (NVML's device count: a torch.cuda.is_available() in the fork server initialises no CUDA)
            s = _SERVER["server"] = ForkServer(dict(base, OMP_NUM_THREADS="1", PYTORCH_NVML_BASED_CUDA_CHECK="1",
                                                    PYTHONPATH=env.get("PYTHONPATH", "")))
        return s


def start_nodes(job_path: Path, module: str, world: int, logs: Path, env: dict, detached: bool,
                argv: list[str] | None = None, log: str = "node{rank}.log") -> ForkedNodes:
    """Ask the fork server for ``world`` processes running ``module``'s ``main(argv)`` (default
    ``["--job", job_path]``: node processes) with ``env`` (plus ``RANK``/``LOCAL_RANK``) in this
    process's working directory, output in ``logs/<log>`` (``{rank}`` filled in; see the module
    doc); ``wait_started()`` on the result gives their handles."""
    request = {"job": str(job_path), "module": module, "world": world, "logs": str(logs), "env": env,
               "cwd": os.getcwd(), "detached": detached, "argv": argv or ["--job", str(job_path)], "log": log}
    return _server(env).submit(request)


def node_pids(run_dir: Path, logs: str = "node*.log") -> dict[int, int]:
    """Rank -> PID of the running node processes of launches into ``run_dir`` (``logs``
    ``"supervisor*.log"``: of their supervisors): the PID on the first line of each such log in
    ``logs/`` (:data:`~.fork_server.PID_LINE`), where that process still runs the fork server's
    program or the supervisor's or, exec'd afresh, names ``run_dir`` in its command line (a PID
    since reused by another process is not one)."""
    pids = {}
    for log in sorted((Path(run_dir) / "logs").glob(logs)):
        try:
            with open(log, "rb") as f:
                m = _PID_LINE_RE.fullmatch(f.readline().decode(errors="replace").strip())
            pid = int(m["pid"]) if m else 0
            if pid > 1 and pid_running(pid):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if any(name in cmdline for name in (fork_server.__name__.encode(), SUPERVISOR_MODULE.encode(),
                                                    str(run_dir).encode())):
                    pids[int(m["rank"])] = pid
        except OSError:
            continue
    return pids
