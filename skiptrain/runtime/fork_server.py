"""The fork server's side (``python -m skiptrain.runtime.fork_server``): it imports torch and
the node code once, then forks the processes a launcher asks for (:mod:`.node_processes`, the
launcher's side, says what each child is and how the launcher sees it); and
:func:`fork_process`, by which a process the fork server forked (a launch's node supervisor)
forks its own node at once.

Failure semantics: the fork server ignores Ctrl-C and asks for SIGKILL when the launcher process
dies (``PR_SET_PDEATHSIG``); so do the children of a launch that is not detached, when the fork
server dies, and a child of :func:`fork_process`, when its parent dies.  A request the fork
server cannot carry out (a fork refused, a module that cannot be imported): its ranks exit 1,
the reason in their logs.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import select
import signal
import sys
import time
import traceback
from pathlib import Path

from .failure import set_parent_death_signal

FRESH_ENV = "SKIPTRAIN_FRESH_NODES"       # "1": every node execs a new interpreter (no shared imports)
FORKED_ENV = "SKIPTRAIN_FORKED"           # "1" in a process the fork server forked (its imports loaded)
# imported once in the fork server, so no node pays for them: the node module, the packages a
# node imports as it goes (runtime and the layers below it), and torch's compiler front end,
# which torch.optim imports on a model's first parameter group (about 2 s of CPU)
PRELOAD_PACKAGES = ("skiptrain.runtime", "skiptrain.elastic", "skiptrain.dp", "skiptrain.checkpoint",
                    "skiptrain.layout", "skiptrain.schedule", "skiptrain.model", "skiptrain.data", "skiptrain.net")
PRELOAD_MODULES = ("skiptrain.runtime.node", "torch._dynamo", "skiptrain.optim")
PID_LINE = "skiptrain node {rank}: pid {pid}"       # the first line of each forked process's log


class ForkedChild:
    """A process forked by :func:`fork_process` (``Popen``'s ``pid``/``poll``/``wait``/``send_signal``)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:        # (only this handle reaps it: one thread waits on it)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:           # (never the PID of a child reaped already)
            os.kill(self.pid, sig)


def forked_here() -> bool:
    """Whether this process was forked by the fork server (its imports are loaded: a child it
    forks in turn starts at once)."""
    return os.environ.get(FORKED_ENV) == "1"


def fork_process(module: str, argv: list[str], env: dict, log: Path) -> ForkedChild:
    """Fork this process (one the fork server forked: :func:`forked_here`) into ``module``'s
    ``main(argv)`` with ``env``, output in ``log`` (its first line gives the PID, as a node's of
    the fork server); it gets SIGKILL when this process dies."""
    req = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "logs": str(log.parent),
           "log": log.name, "detached": False}
    sys.stdout.flush()
    sys.stderr.flush()
    rank = int(env.get("SKIPTRAIN_NODE_ID", "0"))
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(rank, req, parent, fresh=False)
    return ForkedChild(pid)


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


def _child(rank: int, req: dict, server: int, fresh: bool) -> None:
    """In the forked child: become node ``rank`` of the launch ``req`` and run its node module's
    ``main`` (``fresh``: exec ``python -m MODULE`` instead, in a new interpreter); never returns.
    Exits as ``python -m`` would: ``main``'s return value or ``SystemExit``'s code, 1 after an
    uncaught exception (traceback in the log), killed by SIGINT after an uncaught Ctrl-C."""
    code = 1
    try:
        if req["detached"]:
            os.setsid()
        else:
            os.setpgid(0, 0)        # out of the terminal's foreground group: Ctrl-C is the launcher's
            set_parent_death_signal()
            if os.getppid() != server:          # the fork server died before the line above
                os._exit(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"], RANK=str(rank), LOCAL_RANK=str(rank), **{FORKED_ENV: "0" if fresh else "1"})
        # sys.path as `python -m` would start it: the working directory, then PYTHONPATH
        sys.path[:0] = [req["cwd"]] + [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        fd = os.open(Path(req["logs"]) / req["log"].format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        print(PID_LINE.format(rank=rank, pid=os.getpid()), flush=True)
        if fresh:
            os.execv(sys.executable, [sys.executable, "-m", req["module"], *req["argv"]])
        ret = importlib.import_module(req["module"]).main(list(req["argv"]))
        code = ret if isinstance(ret, int) else (0 if ret is None else 1)
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as python -m: the traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code & 0xFF)


def _report(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):       # the launcher is gone (a detached launch goes on)
        pass


def _fork_launch(req: dict, children: dict[int, tuple[int, int]], server: int, cuda: bool) -> None:
    """Fork the nodes of one request; a rank that cannot be forked is reported as exited 1."""
    fresh = cuda or req["env"].get(FRESH_ENV) == "1"
    sys.stdout.flush()
    sys.stderr.flush()
    for r in range(req["world"]):
        try:
            pid = os.fork()
        except OSError as e:
            msg = f"skiptrain node {r}: the fork server could not fork it: {e}"
            print(msg, file=sys.stderr, flush=True)
            try:
                (Path(req["logs"]) / req["log"].format(rank=r)).write_text(msg + "\n")
            except OSError:
                pass
            _report(f"exited {req['launch']} {r} 1")
            continue
        if pid == 0:
            _child(r, req, server, fresh)
        children[pid] = (req["launch"], r)
        _report(f"started {req['launch']} {r} {pid}")


def _kill(req: dict, children: dict[int, tuple[int, int]]) -> None:
    """Signal the node ``(req["launch"], req["rank"])`` if it is a child not reaped yet (so its PID
    is still its own: an exited child stays a zombie until :func:`_reap`, in this same thread)."""
    for pid, key in children.items():
        if key == (req["launch"], req["rank"]):
            try:
                os.kill(pid, int(req["kill"]))
            except ProcessLookupError:
                pass
            return


def _reap(children: dict[int, tuple[int, int]]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        if pid in children:
            launch, rank = children.pop(pid)
            _report(f"exited {launch} {rank} {os.waitstatus_to_exitcode(status)}")


def serve() -> int:
    """The fork server: preload, then carry out each request on stdin (fork a launch's nodes, or
    kill one) and report the nodes' starts and exits, until stdin closes and the last child has
    exited."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    preload()
    cuda = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    server, children, pending, reading = os.getpid(), {}, b"", True
    while reading or children:
        if reading and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    req = json.loads(line)
                except ValueError:
                    print(f"skiptrain fork server: ignored a request that is not JSON: {line[:80]!r}",
                          file=sys.stderr, flush=True)
                    continue
                if "kill" in req:
                    _kill(req, children)
                else:
                    _fork_launch(req, children, server, cuda)
        elif not reading:
            time.sleep(0.02)
        _reap(children)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
