"""The unit layer's rule, enforced: a test under tests/unit starts no process.

While a test of this folder runs (its fixtures of every scope set up and torn down included),
every way this code base could start a process raises :class:`ProcessStarted` naming the test
and the call: ``subprocess.Popen`` (so ``subprocess.run``, ``os.popen``, ...), ``os.fork``,
``os.forkpty``, ``os.posix_spawn``/``os.posix_spawnp``, ``os.system``, starting a
``multiprocessing`` process, and asking a launcher's fork server for node processes (a fork
server started earlier forks nodes without any of the calls above).  An attempt the code under
test catches and swallows still fails the test.  Threads are not processes: in-process groups,
the in-process transport and the trainer's threads run as usual.  A test that needs a process
belongs in tests/integration.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess

# (the first import of matplotlib's font manager on a machine may run fc-list to build its font
# cache: done here, outside any test, and not by whichever test plots first)
import matplotlib.font_manager  # noqa: F401
import pytest

from skiptrain.runtime.node_processes import ForkServer

# (owner, attribute, what the message calls it)
STARTERS = [(subprocess.Popen, "__init__", "subprocess.Popen"), (os, "fork", "os.fork"), (os, "forkpty", "os.forkpty"),
            (os, "posix_spawn", "os.posix_spawn"), (os, "posix_spawnp", "os.posix_spawnp"), (os, "system", "os.system"),
            (multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start"),
            (ForkServer, "submit", "the fork server (node processes)")]


class ProcessStarted(Exception):
    """A test of the unit layer tried to start a process."""


class ProcessGuard:
    """One test's guard: while :meth:`on` (re-entrant), every starter in :data:`STARTERS` raises
    :class:`ProcessStarted`; ``started`` lists the attempts not yet reported as a failure."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.started: list[str] = []
        self._depth = 0
        self._patch: pytest.MonkeyPatch | None = None

    @contextlib.contextmanager
    def on(self):
        if self._depth == 0:
            self._patch = pytest.MonkeyPatch()
            for owner, name, label in STARTERS:
                if hasattr(owner, name):
                    self._patch.setattr(owner, name, self._refusing(label))
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._patch.undo()

    def message(self, what: str) -> str:
        return (f"{self.nodeid} started a process ({what}): tests/unit holds only tests that start "
                "none (tests/unit/conftest.py); move the test to tests/integration")

    def _refusing(self, label: str):
        def refuse(*args, **kwargs):
            __tracebackhide__ = True
            if label == "subprocess.Popen":           # (what Popen.__del__ and repr read)
                args[0]._child_created, args[0].returncode, args[0].args = False, None, args[1:2]
            shown = args[1:] if label in ("subprocess.Popen", "the fork server (node processes)") else args
            what = f"{label}({', '.join(map(repr, shown))})" if shown else label
            self.started.append(what)
            raise ProcessStarted(self.message(what))
        return refuse


GUARD = pytest.StashKey[ProcessGuard]()


def guard_of(item: pytest.Item) -> ProcessGuard:
    if GUARD not in item.stash:
        item.stash[GUARD] = ProcessGuard(item.nodeid)
    return item.stash[GUARD]


@pytest.fixture(autouse=True)
def process_guard(request) -> ProcessGuard:
    """Every test here, and its function-scoped fixtures, run with the guard on (the hooks below
    cover the fixtures of wider scope a test sets up or tears down)."""
    with guard_of(request.node).on() as guard:
        yield guard


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with guard_of(item).on():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with guard_of(item).on():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """An attempt fails the phase it happened in, even when the code under test caught the error."""
    report = yield
    guard = item.stash.get(GUARD, None)
    if guard is not None and guard.started:
        if not (call.excinfo is not None and call.excinfo.errisinstance(ProcessStarted)):
            swallowed = "\n".join(guard.message(w) + " (the error was caught on the way)" for w in guard.started)
            report.outcome = "failed"
            report.longrepr = swallowed + (f"\n\n{report.longrepr}" if report.longrepr else "")
        guard.started.clear()
    return report


#: The listening sockets of the stores tests made, open until the session ends: a store's server
#: runs until its object is collected (a test's thread may keep it in a reference cycle), and
#: would accept, on a closed socket's reused descriptor number, the next test's connections.
_LISTENING: list = []


@pytest.fixture
def store():
    """A run's store in this process (one client: the test), on a free loopback port."""
    from skiptrain.runtime.membership import host_store

    st, sock = host_store(1, 10.0)
    _LISTENING.append(sock)
    yield st
