"""A run across emulated hosts, for tests and benchmarks: a coordinator on host 0 of
:class:`~skiptrain.runtime.netns.Hosts` and one ``skiptrain node`` per other host, each with its
own work directory, plus the faults a real network has (a killed node process, a cut link, a
stopped process, a new host, a host whose clock is off) and what the coordinator's run directory
says about them as the run goes (``metrics.jsonl``, ``recoveries.jsonl``).

Everything runs as separate programs with the command lines a user types; this module only
starts them, injects the faults from outside, and reads files.  It signals only the processes it
started and the node processes those started (found through ``/proc``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .event_log import LOG_NAME
from .netns import Hosts, children

PORT = 29500


class HostSwarm:
    """Host 0 coordinates; hosts 1..n run nodes (see the module's docstring).  ``root`` gets the
    run directory (``run``), the secret, each host's work directory (``work/h<i>``) and logs."""

    def __init__(self, hosts: Hosts, root: Path, data: str, coordinator_args: list[str],
                 python: str = sys.executable, skewed: dict[int, str] | None = None):
        self.hosts, self.root, self.data, self.python = hosts, Path(root), data, python
        self.coordinator_args = coordinator_args
        self.skewed = skewed or {}               # host -> its wall clock's offset in seconds
        self.run_dir = self.root / "run"
        self.secret = self.root / "secret"
        self.coordinator = None                  # the coordinator started last
        self.on_host0: list[subprocess.Popen] = []
        self.agents: dict[int, subprocess.Popen] = {}
        self.env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))

    @property
    def address(self) -> str:
        return f"{self.hosts.addr(0)}:{PORT}"

    def start_coordinator(self, *extra: str, host_lives: bool = False) -> None:
        """``skiptrain coordinator`` on host 0 (``extra``: e.g. ``--resume`` to take a run over).
        ``host_lives``: a shell stays on after a coordinator that was killed, so that a ``kill -9``
        of the coordinator's process alone (:meth:`kill_coordinator_process`) leaves its host, and
        the run's store process, running (one that ends by itself ends the shell with its status)."""
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "coordinator.log", "a")
        argv = [self.python, "-m", "skiptrain.cli", "coordinator", "--bind", self.address, "--out", str(self.run_dir),
                "--join-secret-file", str(self.secret), "--data", self.data, *self.coordinator_args, *extra]
        if host_lives:       # (killed by a signal: the shell stays; ended by itself: so does the shell, alike)
            argv = ["sh", "-c", '"$@"; rc=$?; [ "$rc" -lt 128 ] && exit "$rc"; exec sleep 100000', "sh", *argv]
        self.coordinator = self.hosts.popen(0, argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.on_host0.append(self.coordinator)

    def kill_coordinator(self) -> None:
        """``kill -9`` of the coordinator's host: every process started there ends (each one's
        whole process tree: the run's store too)."""
        for p in self.on_host0:
            p.kill()
        for p in self.on_host0:
            p.wait(timeout=30)

    def kill_coordinator_process(self) -> None:
        """``kill -9`` of the coordinator's process alone (started with ``host_lives``): its host
        and the run's store process live on."""
        shell = self.coordinator.program_pid(timeout=5)
        kids = children(shell) if shell is not None else []
        if not kids:
            raise RuntimeError("the coordinator does not run under a shell of its host (start it with host_lives)")
        os.kill(kids[0], signal.SIGKILL)

    def local_last_step(self) -> int:
        """The newest iteration any host's node recorded in its own run directory (what the nodes
        train while no coordinator mirrors their rows)."""
        return max((r["step"] for p in (self.root / "work").glob("h*/*/node*/metrics.jsonl")
                    for r in _jsonl(p) if "loss" in r), default=0)

    def committed_step(self) -> int:
        """The newest checkpoint step committed in the coordinator's run directory (0: none)."""
        latest = self.run_dir / "checkpoints" / "LATEST"
        try:
            return int(latest.read_text().strip().rsplit("-", 1)[1])
        except (OSError, ValueError, IndexError):
            return 0

    def wait_secret(self, timeout_s: float = 60.0) -> None:
        end = time.time() + timeout_s
        while not self.secret.exists():
            if time.time() > end or self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator wrote no secret: {self.log('coordinator')[-2000:]}")
            time.sleep(0.05)

    def start_node(self, i: int, *extra: str) -> subprocess.Popen:
        """``skiptrain node`` on host ``i`` (its wall clock off when ``skewed`` names it)."""
        argv = [self.python, "-m", "skiptrain.cli", "node", "--coordinator", self.address, "--join-secret-file",
                str(self.secret), "--work-dir", str(self.root / "work" / f"h{i}"), "--data", self.data, *extra]
        env = self.env
        if i in self.skewed:
            env = dict(env, PYTHONPATH=os.pathsep.join([str(self._skew_module(self.skewed[i])), env["PYTHONPATH"]]))
        log = open(self.root / f"node_h{i}.log", "a")
        self.agents[i] = self.hosts.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.agents[i]

    def _skew_module(self, offset_s: float) -> Path:
        """A folder whose ``sitecustomize`` shifts this host's wall clock (``time.time``,
        ``time.time_ns``) by ``offset_s`` in every Python process started with it on the path,
        the node processes its supervisor starts included; the monotonic clock is left alone,
        as on a host whose clock is wrong.  (libfaketime cannot do this for Python 3.11: with
        the monotonic clock faked, timed waits stretch by the offset; without, ``time.sleep``
        fails with EINVAL.)"""
        d = self.root / f"clock{offset_s:+g}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "sitecustomize.py").write_text(
            "import time\n"
            f"_OFFSET = {float(offset_s)!r}\n"
            "_time, _time_ns = time.time, time.time_ns\n"
            "time.time = lambda: _time() + _OFFSET\n"
            "time.time_ns = lambda: _time_ns() + int(_OFFSET * 1e9)\n")
        return d

    def log(self, name: str) -> str:
        try:
            return (self.root / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    # ---- what the run directory says

    def rows(self) -> list[dict]:
        return _jsonl(self.run_dir / "metrics.jsonl")

    def events(self) -> list[dict]:
        return _jsonl(self.run_dir / LOG_NAME)

    def wait(self, predicate, timeout_s: float, what: str, poll_s: float = 0.05):
        end = time.time() + timeout_s
        while time.time() < end:
            got = predicate()
            if got:
                return got
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator ended while waiting for {what}: {self.log('coordinator')[-3000:]}")
            time.sleep(poll_s)
        raise TimeoutError(f"no {what} within {timeout_s:g} s")

    def wait_step(self, step: int, timeout_s: float = 120.0) -> dict:
        return self.wait(lambda: next((r for r in self.rows() if r.get("step", 0) >= step and "loss" in r), None),
                         timeout_s, f"training step {step}")

    def last_step(self) -> int:
        return max((r["step"] for r in self.rows() if "loss" in r), default=0)

    def placement(self) -> list[list[int]]:
        """The stages' node ids now: the planned placement, less the nodes the coordinator
        fenced, plus the nodes it placed since (``recoveries.jsonl``)."""
        stages = [list(p) for p in json.loads((self.run_dir / "schedule.json").read_text())["placement"]]
        for e in self.events():
            if e.get("join") and str(e.get("cause", "")).startswith("joined: stage"):
                stages[int(e["cause"].rsplit(" ", 1)[1])].append(e["node"])
            elif not e.get("join") and not e.get("restart"):
                stages = [[n for n in p if n != e.get("node")] for p in stages]
        return stages

    def replicated_host(self, exclude: set[int]) -> int:
        """A host (not in ``exclude``) whose node holds a stage that has other replicas."""
        for stage in self.placement():
            for node in stage if len(stage) > 1 else []:
                host = next((i for i in self.agents if i not in exclude and self.node_ids(i)[-1:] == [node]), None)
                if host is not None:
                    return host
        raise RuntimeError(f"no host outside {sorted(exclude)} holds a replicated stage: {self.placement()}")

    # ---- nodes and faults

    def node_ids(self, i: int) -> list[int]:
        """The node ids host ``i`` has run, oldest first (its work directory's ``<run>/node<id>``)."""
        d = self.root / "work" / f"h{i}"
        return sorted(int(p.name[4:]) for p in d.glob("*/node*")) if d.is_dir() else []

    def node_pid(self, i: int) -> int | None:
        """The PID of the node process host ``i``'s supervisor runs now."""
        agent = self.agents[i].program_pid(timeout=5)
        if agent is None:
            return None
        kids = children(agent)
        return kids[0] if kids else None

    def signal_node(self, i: int, sig: int) -> None:
        pid = self.node_pid(i)
        if pid is None:
            raise RuntimeError(f"host {i} runs no node process")
        os.kill(pid, sig)

    def finish(self, timeout_s: float) -> int:
        """Wait for the coordinator and every supervisor; the coordinator's exit status."""
        rc = self.coordinator.wait(timeout=timeout_s)
        for p in self.agents.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        return rc


def _jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
