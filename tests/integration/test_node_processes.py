"""The fork server of a launcher process: forked node processes behave like ``python -m MODULE --job JOB``
started per rank (environment, output, stdin, exit codes), and none outlives its launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import processes_of_run, wait_for
from skiptrain.runtime.failure import pid_running
from skiptrain.runtime.node_processes import start_nodes

PROBE = '''
import json, os, sys, time
from pathlib import Path

def main(argv):
    rank = int(os.environ["RANK"])
    out = Path(argv[argv.index("--job") + 1]).parent / f"rank{rank}.json"
    tmp = out.with_suffix(".tmp")       # (written whole, then renamed: a reader never sees it half written)
    tmp.write_text(json.dumps({"rank": rank, "local_rank": os.environ["LOCAL_RANK"], "pid": os.getpid(),
                               "argv": argv, "stdin": sys.stdin.read(), "marker": os.environ["PROBE_MARKER"],
                               "first": os.environ.get("ONLY_IN_THE_FIRST"), "cwd": os.getcwd()}))
    os.replace(tmp, out)
    print(f"probe {rank} says hello", flush=True)
    if rank == 1:
        raise SystemExit(3)
    if rank == 2:
        time.sleep(600)
    if rank == 3:
        raise ValueError("probe failure")
    if rank == 4:
        raise KeyboardInterrupt
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def _setup(tmp_path: Path, name: str) -> tuple[Path, Path, dict]:
    run = tmp_path / name
    (run / "logs").mkdir(parents=True)
    (tmp_path / "probe_node.py").write_text(PROBE)
    job = run / "job.json"
    job.write_text("{}")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PROBE_MARKER="m", PYTHONPATH=path)
    return run, job, env


def _start(job: Path, module: str, world: int, logs: Path, env: dict, detached: bool = False):
    forked = start_nodes(job, module, world, logs, env, detached)
    return forked, forked.wait_started()


def _reference_codes(tmp_path: Path) -> dict[int, int]:
    """The same probe started the plain way, one ``python -m`` process per rank."""
    run, job, env = _setup(tmp_path, "ref")
    procs = [subprocess.Popen([sys.executable, "-m", "probe_node", "--job", str(job)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
             for r in range(5)]
    wait_for(lambda: (run / "rank2.json").exists(), 60)
    os.kill(procs[2].pid, signal.SIGKILL)
    return {r: p.wait(timeout=60) for r, p in enumerate(procs)}


@pytest.mark.parametrize("fresh", ["0", "1"])
def test_forked_nodes_behave_like_one_python_process_per_rank(tmp_path, fresh):
    """Forked (and, with SKIPTRAIN_FRESH_NODES=1, each exec'ing a new interpreter)."""
    run, job, env = _setup(tmp_path, "run")
    env["SKIPTRAIN_FRESH_NODES"] = fresh
    forked, procs = _start(job, "probe_node", 5, run / "logs", env)
    try:
        assert len({p.pid for p in procs}) == 5 and all(p.pid > 1 for p in procs)
        wait_for(lambda: (run / "rank2.json").exists(), 60)
        assert procs[2].poll() is None
        os.kill(procs[2].pid, signal.SIGKILL)
        codes = {r: p.wait(timeout=60) for r, p in enumerate(procs)}
    finally:
        forked.close()
    assert codes == _reference_codes(tmp_path) == {0: 0, 1: 3, 2: -signal.SIGKILL, 3: 1, 4: -signal.SIGINT}
    for r, p in enumerate(procs):
        seen = json.loads((run / f"rank{r}.json").read_text())
        assert seen == {"rank": r, "local_rank": str(r), "pid": p.pid, "argv": ["--job", str(job)], "stdin": "",
                        "marker": "m", "first": None, "cwd": os.getcwd()}
        log = (run / "logs" / f"node{r}.log").read_text().splitlines()
        assert log[0] == f"skiptrain node {r}: pid {p.pid}" and log[1] == f"probe {r} says hello"
    assert "ValueError: probe failure" in (run / "logs" / "node3.log").read_text()
    assert processes_of_run(run) == []


def test_a_node_module_that_cannot_be_imported_fails_every_rank_with_its_traceback(tmp_path):
    run, job, env = _setup(tmp_path, "run")
    forked, procs = _start(job, "no_such_node_module", 3, run / "logs", env)
    try:
        assert [p.wait(timeout=60) for p in procs] == [1, 1, 1]
    finally:
        forked.close()
    log = (run / "logs" / "node1.log").read_text()
    assert "ModuleNotFoundError: No module named 'no_such_node_module'" in log


@pytest.mark.parametrize("victim", ["fork server", "launcher"])
def test_no_node_outlives_its_fork_server_or_its_launcher(tmp_path, victim):
    """SIGKILL of the fork server: its nodes get SIGKILL (PR_SET_PDEATHSIG) and the launcher's
    handles report them gone.  SIGKILL of a launcher process: the fork server and the nodes go."""
    run, job, env = _setup(tmp_path, "run")
    if victim == "fork server":
        forked, procs = _start(job, "probe_node", 3, run / "logs", env)
        wait_for(lambda: (run / "rank2.json").exists(), 60)
        os.kill(forked.server.proc.pid, signal.SIGKILL)
        assert procs[2].wait(timeout=30) == -signal.SIGKILL
        forked.close()
    else:
        code = ("import os, sys, time; from pathlib import Path; "
                "from skiptrain.runtime.node_processes import start_nodes; "
                f"start_nodes(Path({str(job)!r}), 'probe_node', 3, Path({str(run / 'logs')!r}), "
                "dict(os.environ), False).wait_started(); "
                "time.sleep(600)")
        launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        wait_for(lambda: (run / "rank2.json").exists(), 60)
        node2 = json.loads((run / "rank2.json").read_text())["pid"]
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not pid_running(node2), 30)
    deadline = time.time() + 30
    while processes_of_run(run) and time.time() < deadline:
        time.sleep(0.05)
    assert processes_of_run(run) == []


def test_later_launches_reuse_the_fork_server_with_their_own_environment_even_from_a_finished_thread(tmp_path):
    """A launch started in a thread that has ended (the fork server must not die with it: its
    PR_SET_PDEATHSIG is per thread), then another in another working directory with another
    environment, its probe module edited in between: the same fork server forks both, each child
    sees only its own launch's environment, directory and module."""
    import threading

    seen, pids = [], []
    for i, name in enumerate(["first", "second"]):
        run, job, env = _setup(tmp_path, name)
        env["PROBE_MARKER"] = name
        if i == 0:
            env["ONLY_IN_THE_FIRST"] = "1"
            th = threading.Thread(target=lambda: seen.append(_start(job, "probe_node", 2, run / "logs", env)))
            th.start()
            th.join()
            forked, procs = seen[0]
            time.sleep(0.5)                 # (a fork server killed with the thread would be gone by now)
        else:
            (tmp_path / "probe_node.py").write_text(PROBE.replace('"cwd": os.getcwd()', '"cwd": os.getcwd(), "edited": 1'))
            os.chdir(run)
            try:
                forked, procs = _start(job, "probe_node", 2, run / "logs", env)
            finally:
                os.chdir(Path(__file__).parents[2])
        assert [p.wait(timeout=60) for p in procs] == [0, 3]
        forked.close()
        pids.append(forked.server.proc.pid)
        probe = json.loads((run / "rank0.json").read_text())
        assert probe["marker"] == name
    assert pids[0] == pids[1] and forked.server.proc.poll() is None
    second = json.loads((tmp_path / "second" / "rank0.json").read_text())
    assert second["first"] is None and second["cwd"] == str(tmp_path / "second") and second["edited"] == 1
    assert json.loads((tmp_path / "first" / "rank0.json").read_text())["first"] == "1"


def test_kill_goes_through_the_fork_server_and_never_signals_a_node_that_has_exited(tmp_path):
    """``NodeProcess.kill()`` as ``Popen.kill()``: a running node gets SIGKILL; one that has
    exited keeps its own exit status, and its PID is not signalled again (the fork server
    signals only children it has not reaped).  The reference is the same probe's exit codes."""
    run, job, env = _setup(tmp_path, "run")
    forked, procs = _start(job, "probe_node", 3, run / "logs", env)
    try:
        wait_for(lambda: (run / "rank2.json").exists(), 60)
        assert [procs[r].wait(timeout=60) for r in (0, 1)] == [0, 3]
        assert procs[2].poll() is None
        for p in procs:
            p.kill()
        codes = {r: p.wait(timeout=30) for r, p in enumerate(procs)}
        procs[0].kill()                     # long exited and reaped: nothing happens
        assert procs[0].poll() == 0
    finally:
        forked.close()
    assert codes == {0: 0, 1: 3, 2: -signal.SIGKILL}
    assert forked.server.proc.poll() is None
    assert processes_of_run(run) == []


SUPERVISOR = '''
import json, os, sys
from pathlib import Path
from skiptrain.runtime.fork_server import fork_process, forked_here

def main(argv):
    rank = int(os.environ["RANK"])
    run = Path(argv[argv.index("--job") + 1]).parent
    child = fork_process("probe_node", argv, dict(os.environ, SKIPTRAIN_NODE_ID=str(rank)),
                         run / "logs" / f"node{rank}.log")
    (run / f"child{rank}.pid").write_text(str(child.pid))
    code = child.wait()
    (run / f"child{rank}.json").write_text(json.dumps({"code": code, "forked_here": forked_here()}))
    return 0
'''


def test_a_forked_supervisor_forks_its_node_as_the_fork_server_would_and_the_node_dies_with_it(tmp_path):
    """A launch's supervisors (forked by the fork server) fork their nodes in turn: each node
    behaves like one ``python -m`` process per rank, and gets SIGKILL when its supervisor dies."""
    run, job, env = _setup(tmp_path, "run")
    (tmp_path / "supervisor_probe.py").write_text(SUPERVISOR)
    forked = start_nodes(job, "supervisor_probe", 5, run / "logs", env, False, log="supervisor{rank}.log")
    try:
        supervisors = forked.wait_started()
        wait_for(lambda: (run / "rank2.json").exists() and (run / "child2.pid").exists(), 60)
        os.kill(int((run / "child2.pid").read_text()), signal.SIGKILL)
        assert [p.wait(timeout=60) for p in supervisors] == [0] * 5
    finally:
        forked.close()
    children = {r: json.loads((run / f"child{r}.json").read_text()) for r in range(5)}
    assert {r: c["code"] for r, c in children.items()} == _reference_codes(tmp_path)
    assert all(c["forked_here"] for c in children.values())
    for r in range(5):
        pid = int((run / f"child{r}.pid").read_text())
        assert json.loads((run / f"rank{r}.json").read_text())["pid"] == pid
        log = (run / "logs" / f"node{r}.log").read_text().splitlines()
        assert log[0] == f"skiptrain node {r}: pid {pid}" and log[1] == f"probe {r} says hello"
        assert (run / "logs" / f"supervisor{r}.log").read_text().splitlines()[0] == \
            f"skiptrain node {r}: pid {supervisors[r].pid}"

    run2, job2, _ = _setup(tmp_path, "run2")        # the supervisor of the sleeping rank 2 dies
    forked = start_nodes(job2, "supervisor_probe", 3, run2 / "logs", env, False, log="supervisor{rank}.log")
    try:
        supervisors = forked.wait_started()
        wait_for(lambda: (run2 / "rank2.json").exists(), 60)
        child = int((run2 / "child2.pid").read_text())
        supervisors[2].kill()
        assert supervisors[2].wait(timeout=60) == -signal.SIGKILL
        wait_for(lambda: not pid_running(child), 30)
    finally:
        forked.close()
    assert processes_of_run(run) == [] and processes_of_run(run2) == []
