"""The unit layer's guard (tests/unit/conftest.py) refuses every way of starting a process, and
lets threads run."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest

from skiptrain.runtime.node_processes import ForkServer
from unit.conftest import ProcessStarted


def _fork():
    pid = os.fork()
    if pid == 0:            # (only if the guard let it through: the child leaves at once)
        os._exit(0)
    os.waitpid(pid, 0)


def _spawn(spawn, path):
    os.waitpid(spawn(path, [path], dict(os.environ)), 0)


def _mp_process():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


STARTS = {
    "subprocess.run": lambda: subprocess.run(["true"]),
    "subprocess.Popen": lambda: subprocess.Popen([sys.executable, "-c", "pass"]).wait(),
    "os.system": lambda: os.system("true"),
    "os.fork": _fork,
    "os.posix_spawn": lambda: _spawn(os.posix_spawn, "/bin/true"),
    "os.posix_spawnp": lambda: _spawn(os.posix_spawnp, "true"),
    "multiprocessing": _mp_process,
    "fork server": lambda: ForkServer.__new__(ForkServer).submit({"world": 1}),
}


@pytest.mark.parametrize("how", sorted(STARTS))
def test_starting_a_process_raises_and_names_the_test(process_guard, how):
    with pytest.raises(ProcessStarted, match=r"test_starting_a_process_raises_and_names_the_test.* started a "
                                             r"process .*move the test to tests/integration"):
        STARTS[how]()
    assert len(process_guard.started) == 1
    process_guard.started.clear()          # (seen: else the guard fails this test for the attempt)


def test_threads_run_under_the_guard():
    out = []
    t = threading.Thread(target=lambda: out.append(sum(range(10))))
    t.start()
    t.join()
    assert out == [45]
