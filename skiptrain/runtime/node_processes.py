"""The node processes of a local launch, forked from one process that imports torch once.

Starting a Python process that imports torch and the node code costs about 4 s of CPU; a
launch of 16 nodes on a small machine would spend most of its first half minute on imports.
:func:`start_nodes` instead starts one *fork server*
(``python -m skiptrain.runtime.node_processes --job RUN_DIR/job.json ...``): it imports
``job.node_module`` (torch with it), then forks one child per rank.  Each child is what
``python -m <node_module> --job RUN_DIR/job.json`` would be: its own ``RANK`` and
``LOCAL_RANK``, output in ``RUN_DIR/logs/node<r>.log`` (whose first line gives its PID), stdin
from ``/dev/null``, the default Ctrl-C handler, and its own session when the launch is detached.
The fork server imports nothing that starts a thread or touches a GPU before it forks (were CUDA
initialised in it, each child would exec a new interpreter instead, as it does when
``SKIPTRAIN_FRESH_NODES=1`` is set: slower starts, nothing shared).

The launcher gets one :class:`NodeProcess` per rank with the part of ``subprocess.Popen`` it
uses (``pid``, ``poll``, ``wait``, ``returncode``): the fork server reaps its children and
reports each exit status on its stdout (``exited RANK CODE``, ``CODE`` as ``Popen.returncode``:
negative for a signal).

Failure semantics: the fork server ignores Ctrl-C (it waits for its children, which get it) and
outlives the launcher only when the launch is detached; otherwise it and the nodes ask for
SIGKILL when their parent dies (``PR_SET_PDEATHSIG``), as before.  If the node module cannot be
imported, every rank "exits" with code 1 and its log holds the traceback.  If the fork server
itself is killed, a node it no longer reports is taken as exited (``-SIGKILL``) once its PID no
longer runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from .failure import RuntimeFailure, pid_running, set_parent_death_signal

START_TIMEOUT_S = 300.0
FRESH_ENV = "SKIPTRAIN_FRESH_NODES"       # "1": every node execs a new interpreter (no shared imports)
# imported once in the fork server besides the node module, so no node pays for them: the
# packages a node imports as it goes (runtime and the layers below it), and torch's compiler
# front end, which torch.optim and torch.distributed import on first use (about 2 s of CPU)
PRELOAD_PACKAGES = ("skiptrain.runtime", "skiptrain.elastic", "skiptrain.dp", "skiptrain.checkpoint",
                    "skiptrain.layout", "skiptrain.schedule", "skiptrain.model", "skiptrain.data", "skiptrain.net")
PRELOAD_MODULES = ("torch._dynamo", "skiptrain.optim")


class NodeProcess:
    """One forked node process, seen from the launcher (``Popen``'s ``pid``/``poll``/``wait``)."""

    def __init__(self, nodes: "ForkedNodes", rank: int, pid: int | None):
        self._nodes, self.rank, self.pid = nodes, rank, pid

    @property
    def returncode(self) -> int | None:
        return self._nodes.code(self.rank)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.time() > end:
                raise subprocess.TimeoutExpired(f"node {self.rank}", timeout)
            time.sleep(0.01)
        return code


class ForkedNodes:
    """The fork server of one launch and what it reported (read by a thread of the launcher)."""

    def __init__(self, server: subprocess.Popen, world: int):
        self.server, self.world = server, world
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.eof = False
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="node-exits", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.server.stdout:
            parts = line.split()
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            with self._lock:
                if parts[0] == "started":
                    self.pids[int(parts[1])] = int(parts[2])
                elif parts[0] == "exited":
                    self.codes[int(parts[1])] = int(parts[2])
        self.eof = True

    def code(self, rank: int) -> int | None:
        with self._lock:
            if rank in self.codes:
                return self.codes[rank]
            pid = self.pids.get(rank)
        if self.eof and (pid is None or not pid_running(pid)):
            return -signal.SIGKILL           # the fork server is gone and so is the node
        return None

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> list[NodeProcess]:
        """Block until every rank has a PID or an exit status; the launcher's handles (``pid``
        None for a rank that never started).  Raises :class:`RuntimeFailure` (the fork server
        killed) if that takes over ``timeout_s``."""
        end = time.time() + timeout_s
        while len(self.pids.keys() | self.codes.keys()) < self.world and not self.eof:
            if time.time() > end:
                self.server.kill()
                raise RuntimeFailure(f"the node processes did not start within {timeout_s:g} s "
                                     "(is the machine overloaded?); nothing was left running")
            time.sleep(0.01)
        return [NodeProcess(self, r, self.pids.get(r)) for r in range(self.world)]

    def close(self, timeout_s: float = 10.0) -> None:
        """Reap the fork server (it exits once its children have); SIGKILL it after ``timeout_s``."""
        try:
            self.server.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self._reader.join(timeout=1.0)
        if self.server.stdout is not None:
            self.server.stdout.close()


def start_nodes(job_path: Path, module: str, world: int, logs: Path, env: dict,
                detached: bool) -> tuple[ForkedNodes, list[NodeProcess]]:
    """Fork ``world`` node processes running ``module``'s ``main(["--job", job_path])`` with
    ``env`` (plus ``RANK``/``LOCAL_RANK``); see the module doc."""
    cmd = [sys.executable, "-m", __name__, "--job", str(job_path), "--module", module,
           "--world", str(world), "--logs", str(logs)] + (["--detached"] if detached else [])
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, text=True, start_new_session=detached)
    nodes = ForkedNodes(server, world)
    return nodes, nodes.wait_started()


def _child(main, rank: int, job_path: str, logs: Path, detached: bool, server: int, fresh: str | None) -> None:
    """In the forked child: become node ``rank`` and run it (``fresh``: exec ``python -m fresh``
    instead, in a new interpreter); never returns."""
    code = 1
    try:
        if detached:
            os.setsid()
        else:
            set_parent_death_signal()
            if os.getppid() != server:          # the fork server died before the line above
                os._exit(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
        fd = os.open(logs / f"node{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        print(f"skiptrain node {rank}: pid {os.getpid()}", flush=True)
        if fresh:
            os.execv(sys.executable, [sys.executable, "-m", fresh, "--job", job_path])
        code = main(["--job", job_path])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the node's own report failed: leave the traceback
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def preload() -> None:
    """Import :data:`PRELOAD_MODULES` and every module of :data:`PRELOAD_PACKAGES`.  Only a
    head start: a module that cannot be imported here (an optional dependency missing, say) is
    left to the node that needs it, which then reports the error itself."""
    names = list(PRELOAD_MODULES)
    for pkg in PRELOAD_PACKAGES:
        names += [i.name for i in pkgutil.walk_packages(importlib.import_module(pkg).__path__, prefix=pkg + ".")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the node that needs it reports it
            continue


def _report(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):       # the launcher is gone (a detached launch goes on)
        pass


def serve(job_path: str, module: str, world: int, logs: Path, detached: bool) -> int:
    """The fork server: import ``module``, fork a node per rank, report their exits, then exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not detached:
        set_parent_death_signal()
    try:
        main = importlib.import_module(module).main
    except BaseException:  # noqa: BLE001 - no node can start: each log says why
        err = traceback.format_exc()
        for r in range(world):
            (logs / f"node{r}.log").write_text(f"skiptrain node {r}: cannot import {module}\n{err}")
            _report(f"exited {r} 1")
        return 1
    fresh = module if os.environ.get(FRESH_ENV) == "1" else None
    if fresh is None:
        preload()
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            fresh = module                 # CUDA cannot be used in a child forked after its start
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    server = os.getpid()
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            _child(main, r, job_path, logs, detached, server, fresh)
        ranks[pid] = r
        _report(f"started {r} {pid}")
    while ranks:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid in ranks:
            _report(f"exited {ranks.pop(pid)} {os.waitstatus_to_exitcode(status)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="the launch's job JSON (RUN_DIR/job.json)")
    ap.add_argument("--module", required=True, help="the node module (job.node_module); its main() runs per rank")
    ap.add_argument("--world", type=int, required=True, help="how many node processes to fork (ranks 0..N-1)")
    ap.add_argument("--logs", required=True, help="folder of the node logs (node<r>.log)")
    ap.add_argument("--detached", action="store_true", help="new sessions; outlive the launcher")
    a = ap.parse_args(argv)
    return serve(a.job, a.module, a.world, Path(a.logs), a.detached)


if __name__ == "__main__":
    sys.exit(main())
