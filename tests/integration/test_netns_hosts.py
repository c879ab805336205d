"""Emulated hosts as network namespaces (:mod:`skiptrain.runtime.netns`): reachability, separate
loopbacks, hostnames and PID namespaces, cuts that blackhole without closing connections,
bandwidth shaping, and cleanup.  Needs root and iproute2; skipped (with the reason) elsewhere.

Every check runs in the hosts through an *agent*: a small Python process per host that executes
the snippets the test sends on its stdin and answers each with one JSON line (``result`` or the
exception), so the test drives sockets inside the namespaces it cannot reach itself."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from skiptrain.runtime.netns import LOOPBACK, Hosts

OK, WHY = Hosts.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"cannot emulate hosts as network namespaces here: {WHY}"),
              pytest.mark.slow]

AGENT = r"""
import json, os, socket, sys, threading, time
g = {"socket": socket, "os": os, "time": time, "threading": threading}
for line in sys.stdin:
    g["result"] = None
    try:
        exec(json.loads(line), g)
        out = {"result": g["result"]}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
"""

# a sink in a thread: accepts connections and reads each to its end, then closes it
SINK = """
def _sink(srv):
    while True:
        c, _ = srv.accept()
        while c.recv(1 << 16):
            pass
        c.close()
sink = socket.create_server((ADDR, 0))
threading.Thread(target=_sink, args=(sink,), daemon=True).start()
result = sink.getsockname()[1]
"""

# send N bytes to (ADDR, PORT) and wait for the sink's close: the seconds it took
SEND = """
t0 = time.monotonic()
s = socket.create_connection((ADDR, PORT), timeout=30)
s.sendall(b"x" * N)
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
result = time.monotonic() - t0
"""

# read N bytes from ``kept`` (fewer if it closes first): how many came
READ_ALL = """
data = b""
while len(data) < N:
    chunk = kept.recv(N - len(data))
    if not chunk:
        break
    data += chunk
result = len(data)
"""


class Agent:
    """The agent process in one host: :meth:`do` runs a snippet there and returns its ``result``
    (or raises ``AssertionError`` with the exception it raised, if ``fails`` is not set)."""

    def __init__(self, hosts: Hosts, i: int):
        self.proc = hosts.popen(i, [sys.executable, "-c", AGENT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def ask(self, code: str, timeout: float = 15, **names) -> dict:
        prelude = "".join(f"{k} = {v!r}\n" for k, v in names.items())
        self.proc.stdin.write(json.dumps(prelude + code) + "\n")
        self.proc.stdin.flush()
        return self.lines.get(timeout=timeout)

    def do(self, code: str, timeout: float = 15, **names):
        out = self.ask(code, timeout, **names)
        assert "error" not in out, out["error"]
        return out["result"]

    def fails(self, code: str, timeout: float = 15, **names) -> str:
        out = self.ask(code, timeout, **names)
        assert "error" in out, f"expected a failure, got {out}"
        return out["error"]


@pytest.fixture(scope="module")
def hosts():
    with Hosts(3) as h:
        yield h


@pytest.fixture(scope="module")
def agents(hosts):
    return [Agent(hosts, i) for i in range(hosts.n)]


def test_hosts_reach_each_other_over_tcp_and_have_separate_loopbacks(hosts, agents):
    a0, a1 = agents[0], agents[1]
    port = a0.do("srv = socket.create_server((ADDR, 0)); result = srv.getsockname()[1]", ADDR=hosts.addr(0))
    a1.do("c = socket.create_connection((ADDR, PORT), timeout=3); c.sendall(b'hello')",
          ADDR=hosts.addr(0), PORT=port)
    got, peer = a0.do("conn, peer = srv.accept(); result = [conn.recv(5).decode(), peer[0]]; conn.close()")
    assert (got, peer) == ("hello", hosts.addr(1))
    # host 0 listens on its loopback and reaches it itself; host 1's loopback is another one
    lport = a0.do("lo = socket.create_server((LO, 0)); result = lo.getsockname()[1]", LO=LOOPBACK)
    a0.do("socket.create_connection((LO, P), timeout=3).close()", LO=LOOPBACK, P=lport)
    err = a1.fails("socket.create_connection((LO, P), timeout=3)", LO=LOOPBACK, P=lport)
    assert "ConnectionRefused" in err


def test_each_process_has_its_own_hostname_and_pid_namespace(hosts, agents):
    seen = [a.do("result = [socket.gethostname(), os.getpid(), "
                 "sorted(int(p) for p in os.listdir('/proc') if p.isdigit())]") for a in agents]
    for i, (name, pid, pids) in enumerate(seen):
        assert name == hosts.hostname(i)
        assert pid <= 3, f"host {i}: pid {pid} in its own namespace"
        assert pids == [1, pid], f"host {i} sees processes {pids}"
    assert len({name for name, _, _ in seen}) == hosts.n
    assert os.uname().nodename not in {name for name, _, _ in seen}


def test_terminate_reaches_the_program_and_kill_ends_the_whole_tree(hosts):
    p = hosts.popen(0, ["sleep", "60"])
    p.terminate()
    assert p.wait(5) == 128 + 15
    p = hosts.popen(0, ["sh", "-c", "sleep 60 & sleep 60 & wait"])
    inner = _wait_for(lambda: _pids_under(p.pid) if len(_pids_under(p.pid)) >= 5 else None)
    p.kill()
    assert p.wait(5) == 128 + 9
    _wait_for(lambda: not any(os.path.exists(f"/proc/{q}") for q in inner))


def test_cut_blackholes_both_ways_and_restore_brings_it_back(hosts, agents):
    a0, a1, a2 = agents
    ports = [a.do("s = socket.create_server((ADDR, 0)); result = s.getsockname()[1]", ADDR=hosts.addr(i))
             for i, a in enumerate(agents)]
    a1.do("old = socket.create_connection((ADDR, P), timeout=3)", ADDR=hosts.addr(0), P=ports[0])
    a0.do("kept, _ = s.accept(); kept.settimeout(15)")
    connect = "socket.create_connection((ADDR, P), timeout=1).close()"
    hosts.cut(0)
    try:
        t0 = time.monotonic()
        assert "timed out" in a1.fails(connect, ADDR=hosts.addr(0), P=ports[0])
        assert "timed out" in a0.fails(connect, ADDR=hosts.addr(1), P=ports[1])
        a1.do(connect, ADDR=hosts.addr(2), P=ports[2])  # the others still talk
        a1.do("old.sendall(b'y' * 1000)")  # into the cut: retransmitted later
        assert "timed out" in a0.fails("kept.settimeout(0.5); kept.recv(1)")
        a0.do("kept.settimeout(15)")
        time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
    finally:
        hosts.restore(0)
    got = a0.do(READ_ALL, N=1000, timeout=20)
    assert got == 1000, "the connection did not outlive the cut"
    a1.do("socket.create_connection((ADDR, P), timeout=5).close()", ADDR=hosts.addr(0), P=ports[0])
    a0.do("socket.create_connection((ADDR, P), timeout=5).close()", ADDR=hosts.addr(1), P=ports[1])


def test_shape_limits_a_hosts_egress(hosts, agents):
    a0, a2 = agents[0], agents[2]
    port = a0.do(SINK, ADDR=hosts.addr(0))
    n = 2_000_000
    fast = a2.do(SEND, ADDR=hosts.addr(0), PORT=port, N=n)
    hosts.shape(2, 8)
    try:
        slow = a2.do(SEND, ADDR=hosts.addr(0), PORT=port, N=n)
    finally:
        hosts.shape(2, None)
    again = a2.do(SEND, ADDR=hosts.addr(0), PORT=port, N=n)
    # 2 MB at 8 Mbit/s is 2 s; unshaped, a few milliseconds on a loaded machine
    assert slow > 1.0 and slow > 5 * fast, (fast, slow)
    assert again < slow / 5, (fast, slow, again)


@pytest.mark.parametrize("how", ["normal", "interrupt"])
def test_leaving_removes_everything_it_made(how):
    pids = []
    try:
        with Hosts(2) as h:
            prefix = h.prefix
            for i in range(h.n):
                p = h.popen(i, ["sh", "-c", "sleep 60 & sleep 60 & wait"])
                pids += _wait_for(lambda: _pids_under(p.pid) if len(_pids_under(p.pid)) >= 5 else None)
            assert any(ns.startswith(prefix) for ns in _netns())
            assert any(x.startswith(prefix) for x in _links())
            if how == "interrupt":
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert how == "interrupt"
    assert not [ns for ns in _netns() if ns.startswith(prefix)]
    assert not [x for x in _links() if x.startswith(prefix)]
    alive = [q for q in pids if os.path.exists(f"/proc/{q}")]
    assert alive == [], f"processes still alive after the hosts were removed: {alive}"


UNCLOSED = """
import sys, time
from skiptrain.runtime.netns import Hosts
h = Hosts(2)
h.open()
p = h.popen(1, ["sh", "-c", "sleep 60 & sleep 60 & wait"])
time.sleep(0.3)
print(h.prefix, p.pid, flush=True)
"""


def test_an_unclosed_instance_is_removed_at_interpreter_exit():
    out = subprocess.run([sys.executable, "-c", UNCLOSED], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    prefix, pid = out.stdout.split()
    assert not [ns for ns in _netns() if ns.startswith(prefix)]
    assert not [x for x in _links() if x.startswith(prefix)]
    assert not os.path.exists(f"/proc/{pid}")


def _pids_under(pid: int) -> list[int]:
    """``pid`` and all its descendants (root-namespace PIDs)."""
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        try:
            with open(f"/proc/{q}/task/{q}/children") as f:
                todo += [int(w) for w in f.read().split()]
        except OSError:
            pass
    return out


def _wait_for(fn, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {fn}")


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
