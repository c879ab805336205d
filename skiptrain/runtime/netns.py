"""Emulated hosts on one machine: one network namespace per host, all on one bridge.

``with Hosts(4) as hosts:`` makes four hosts that reach each other only through a bridge in the
root namespace, each with its own address on one private /24, its own loopback, and (for the
processes started with :meth:`Hosts.popen`) its own PID and UTS namespaces, so a process sees
itself as a small PID on a machine called ``host<i>``.  Tests and benchmarks start independent
processes on them, shape a host's egress bandwidth (:meth:`Hosts.shape`) and cut a host off the
network and back (:meth:`Hosts.cut`, :meth:`Hosts.restore`).

Layout (names from the instance's ``prefix``, ``sk`` and random hex by default)::

    root namespace: bridge <prefix>br, no address; ports <prefix>v<i> (one per host)
    namespace <prefix>-h<i>: lo up, eth0 (the veth peer of <prefix>v<i>) with addr(i)/24

Failure semantics, in short: making the hosts either succeeds whole or undoes what it made and
raises :class:`HostsError` (the failing command and its stderr in the message); leaving the
``with`` block (normally, by an exception, by ``KeyboardInterrupt``) or, failing that, the
interpreter's exit (``atexit``) kills the processes started here and deletes the namespaces,
veths and bridge made here, and nothing else: a prefix already in use is refused, and cleanup
works from the lists of what this instance made.  A ``SIGKILL`` of the Python process itself
leaves them behind (``ip netns list``/``ip link`` show them by prefix).

This is the only module that names private-range addresses; everything else gets them from it.
It needs root, ``ip``, ``tc``, ``bridge`` and ``unshare`` (see :meth:`Hosts.available`); delay
is not emulated here (no netem in the kernel this was written on): only bandwidth and partitions.
Bridged frames pass the root namespace's iptables FORWARD chain where ``br_netfilter`` is loaded
with ``bridge-nf-call-iptables=1``: a DROP policy there (Docker sets one) silences the hosts.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

LOOPBACK = "127.0.0.1"
POOL = ipaddress.ip_network("10.0.0.0/8")
_PREFIX = re.compile(r"[a-z][a-z0-9]{1,9}")
_IFNAMSIZ = 15
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class HostsError(RuntimeError):
    """A command that makes, changes or removes the emulated hosts failed (message: command, stderr)."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` (no shell), output captured.  With ``check`` a failure (non-zero exit, tool
    missing, 30 s timeout) raises :class:`HostsError` carrying the command and its stderr;
    without, an exit or timeout is only returned (``returncode`` -1 for the latter two)."""
    try:
        return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)
    except subprocess.CalledProcessError as e:
        raise HostsError(f"{' '.join(argv)}: exit {e.returncode}: {e.stderr.strip()}") from None
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise HostsError(f"{' '.join(argv)}: {e}") from None
        return subprocess.CompletedProcess(argv, -1, "", str(e))


def _tool(name: str) -> str:
    """Absolute path of a system tool (``/usr/sbin`` included though root's PATH may lack it)."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise HostsError(f"{name}: not found")
    return path


def used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks the root namespace has addresses or routes in (any table)."""
    out = []
    for line in _run([_tool("ip"), "-o", "-4", "addr", "show"]).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            out.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in _run([_tool("ip"), "-4", "route", "show", "table", "all"]).stdout.splitlines():
        words = line.split()
        words = words[1:] if words and words[0] in ("local", "broadcast", "unicast", "multicast") else words
        if words and words[0] != "default":
            try:
                out.append(ipaddress.ip_network(words[0], strict=False))
            except ValueError:
                pass
    return out


def pick_subnet(used: list[ipaddress.IPv4Network], rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that overlaps none of ``used``; :class:`HostsError` if there is none."""
    rng = rng or random.Random()
    blocked = [u for u in used if u.version == 4 and u.overlaps(POOL)]
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{rng.randrange(1, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in blocked):
            return net
    raise HostsError(f"no free /24 in {POOL} (used: {blocked})")


def existing_names() -> tuple[set[str], set[str]]:
    """(network namespace names, link names of the root namespace) that exist now."""
    ns = {line.split()[0] for line in _run([_tool("ip"), "netns", "list"]).stdout.splitlines()
          if line.strip()}
    links = set()
    for line in _run([_tool("ip"), "-o", "link", "show"]).stdout.splitlines():
        links.add(line.split(":")[1].strip().split("@")[0])
    return ns, links


def children(pid: int) -> list[int]:
    """PIDs of the direct children of ``pid`` (empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(w) for w in f.read().split()]
    except OSError:
        return []


class HostProcess(subprocess.Popen):
    """A process started in a host (:meth:`Hosts.popen`).

    ``pid`` is the ``unshare`` supervisor in the root PID namespace; under it the host's init
    (PID 1 there: :func:`host_init`) runs the program (PID 2).  Signals (:meth:`terminate`,
    :meth:`kill`, ``SIGSTOP``...) go to the program itself, once it runs (up to 5 s are waited
    for that; a ``SIGKILL`` before then kills the supervisor, whose ``--kill-child`` ends the
    rest).  When the program ends, the init returns and the kernel kills whatever else runs in
    the host's PID namespace: :meth:`kill` ends the whole tree.  ``returncode`` is the program's
    exit status, or 128+N if signal N ended it (137 after :meth:`kill`, 143 after
    :meth:`terminate` of a program without a handler).
    """

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        program = self.program_pid(timeout=0 if sig == signal.SIGKILL else 5)
        try:
            if program is not None:
                os.kill(program, sig)
            elif sig == signal.SIGKILL:
                super().send_signal(sig)
        except ProcessLookupError:  # it has just ended
            pass

    def program_pid(self, timeout: float = 0) -> int | None:
        """The program's PID in the root PID namespace; None if it is not running (yet: waits up
        to ``timeout`` seconds for it)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            init = children(self.pid)
            program = children(init[0]) if init else []
            if program:
                return program[0]
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return None


class Hosts:
    """``n`` emulated hosts; a context manager (see the module docstring for the layout).

    ``prefix`` (2-10 lowercase letters/digits, starting with a letter) names everything made;
    one that any existing namespace or root link already starts with is refused.  ``subnet``
    overrides the /24 otherwise picked at random among those free in the root namespace.
    """

    def __init__(self, n: int, prefix: str | None = None, subnet: str | None = None):
        if n < 1:
            raise ValueError(f"need at least one host, not {n}")
        self.prefix = prefix or f"sk{random.getrandbits(24):06x}"
        if not _PREFIX.fullmatch(self.prefix) or len(self.port(n - 1)) > _IFNAMSIZ:
            raise ValueError(f"prefix {self.prefix!r}: 2-10 of [a-z0-9], a letter first, "
                             f"short enough for {n} interface names of at most {_IFNAMSIZ} characters")
        self.n = n
        self.subnet = ipaddress.ip_network(subnet) if subnet else None
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self._procs: list[HostProcess] = []
        self._open = False
        self._at_exit = lambda: self.close(raise_errors=False)

    # ---- names and addresses

    def name(self, i: int) -> str:
        """The network namespace of host ``i`` (for ``ip netns exec``/``ip -n``)."""
        return f"{self.prefix}-h{self._check(i)}"

    def hostname(self, i: int) -> str:
        """The hostname processes started in host ``i`` see."""
        return f"host{self._check(i)}"

    def port(self, i: int) -> str:
        """The root namespace's end of host ``i``'s veth (a bridge port)."""
        return f"{self.prefix}v{i}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def addr(self, i: int) -> str:
        """Host ``i``'s IPv4 address (its ``eth0``); valid once the hosts are made."""
        if self.subnet is None:
            raise HostsError("the hosts are not made yet (use `with Hosts(...) as hosts`)")
        return str(self.subnet.network_address + 1 + self._check(i))

    def _check(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i} of {self.n}")
        return i

    # ---- making and removing

    def __enter__(self) -> Hosts:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_errors=exc_type is None)

    def open(self) -> None:
        """Make the bridge, namespaces and veths.  All or nothing: on any failure what was made
        is removed again and the :class:`HostsError` (or interrupt) propagates."""
        if self._open:
            raise HostsError("already open")
        namespaces, links = existing_names()
        taken = sorted(x for x in namespaces | links if x.startswith(self.prefix))
        if taken:
            raise HostsError(f"prefix {self.prefix!r} is in use: {taken}")
        if self.subnet is None:
            self.subnet = pick_subnet(used_networks())
        self._open = True
        atexit.register(self._at_exit)
        try:
            self._make_bridge()
            for i in range(self.n):
                self._make_host(i)
        except BaseException:
            self.close(raise_errors=False)
            raise

    def _make_bridge(self) -> None:
        ip = _tool("ip")
        _run([ip, "link", "add", self.bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
        self._links.append(self.bridge)
        _quiet_ipv6(self.bridge)
        _run([ip, "link", "set", self.bridge, "up"])

    def _make_host(self, i: int) -> None:
        ip, ns, port = _tool("ip"), self.name(i), self.port(i)
        _run([ip, "netns", "add", ns])
        self._namespaces.append(ns)
        _run([ip, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
        self._links.append(port)
        _quiet_ipv6(port)
        _run([ip, "link", "set", port, "master", self.bridge, "up"])
        _run([ip, "-n", ns, "addr", "add", f"{self.addr(i)}/{self.subnet.prefixlen}", "dev", "eth0"])
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        _run([ip, "-n", ns, "link", "set", "eth0", "up"])

    def close(self, raise_errors: bool = True) -> None:
        """Kill the processes started here (``SIGKILL``, each whole PID-namespace tree), then
        delete the veths, bridge and namespaces made here.  Idempotent; every step is tried even
        when an earlier one fails.  Failures raise one :class:`HostsError` listing them when
        ``raise_errors`` (a clean ``with`` exit), else they are reported as a warning (an
        exception is already on its way out, or this is the ``atexit`` fallback)."""
        if not self._open:
            return
        errors = self._kill_all()
        ip = _tool("ip")
        for link in reversed(self._links):
            res = _run([ip, "link", "del", link], check=False)
            if res.returncode != 0 and link in existing_names()[1]:
                errors.append(f"ip link del {link}: {res.stderr.strip()}")
        for ns in reversed(self._namespaces):
            res = _run([ip, "netns", "del", ns], check=False)
            if res.returncode != 0 and ns in existing_names()[0]:
                errors.append(f"ip netns del {ns}: {res.stderr.strip()}")
        self._links, self._namespaces, self._open = [], [], False
        atexit.unregister(self._at_exit)
        if errors and raise_errors:
            raise HostsError("cleanup: " + "; ".join(errors))
        if errors:
            warnings.warn(f"skiptrain netns cleanup ({self.prefix}): " + "; ".join(errors), stacklevel=2)

    def _kill_all(self) -> list[str]:
        """SIGKILL every process started here that still runs and reap it; [] or what failed."""
        errors = []
        for p in self._procs:
            try:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:  # a stuck init: the supervisor's --kill-child
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired) as e:
                errors.append(f"process {p.pid}: {e}")
        self._procs = [p for p in self._procs if p.returncode is None]
        return errors

    # ---- processes

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None, **kw) -> HostProcess:
        """Start ``argv`` in host ``i``: its network namespace plus fresh PID, UTS and mount
        namespaces (``/proc`` shows the host's processes only; hostname :meth:`hostname`).
        ``env`` and ``**kw`` go to :class:`subprocess.Popen` (``start_new_session`` defaults to
        True: the terminal's Ctrl-C is not the host's).  See :class:`HostProcess` for signals;
        :meth:`close` kills it.  A program that cannot be started makes the process exit 127."""
        if not self._open:
            raise HostsError("the hosts are not made (use `with Hosts(...) as hosts`)")
        kw.setdefault("start_new_session", True)
        cmd = [_tool("ip"), "netns", "exec", self.name(i),
               _tool("unshare"), "--pid", "--uts", "--mount-proc", "--fork", "--kill-child", "--",
               sys.executable, "-I", os.path.abspath(__file__), self.hostname(i), *argv]
        p = HostProcess(cmd, env=env, **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``i`` to its end (as :meth:`popen`; ``stdout``/``stderr``
        captured as text); a timeout kills it and raises :class:`subprocess.TimeoutExpired`."""
        p = self.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    # ---- the network

    def shape(self, i: int, rate_mbit: float | None) -> None:
        """Limit host ``i``'s egress (everything it sends) to ``rate_mbit`` Mbit/s with an HTB
        qdisc on its ``eth0``; ``None`` removes the limit.  Replaces an earlier limit; raises
        :class:`HostsError` if ``tc`` fails."""
        tc, ns = _tool("tc"), self.name(i)
        if rate_mbit is None:
            if "htb" in _run([tc, "-n", ns, "qdisc", "show", "dev", "eth0"]).stdout:
                _run([tc, "-n", ns, "qdisc", "del", "dev", "eth0", "root"])
            return
        if rate_mbit <= 0:
            raise ValueError(f"rate {rate_mbit} Mbit/s")
        rate = f"{max(1, round(rate_mbit * 1000))}kbit"
        _run([tc, "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"])
        _run([tc, "-n", ns, "class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:1",
              "htb", "rate", rate, "ceil", rate])

    def cut(self, i: int) -> None:
        """Partition host ``i``: the bridge drops every frame to and from it (its port set to the
        ``disabled`` STP state).  A blackhole: both ends keep their links up and their sockets
        open, unacknowledged data is retransmitted, so TCP connections outlive a short cut
        (until their own timeouts); new connections time out.  Undo with :meth:`restore`."""
        self._port_state(i, "disabled")

    def restore(self, i: int) -> None:
        """Reconnect host ``i`` after :meth:`cut` (its bridge port forwards again); no-op if not cut."""
        self._port_state(i, "forwarding")

    def _port_state(self, i: int, state: str) -> None:
        code = {"disabled": "0", "forwarding": "3"}[state]
        _run([_tool("bridge"), "link", "set", "dev", self.port(self._check(i)), "state", code])

    # ---- whether this machine can

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, "") if hosts can be made here, else (False, why): not Linux, not root, a tool
        missing, or the kernel refusing a namespace, bridge, veth, HTB qdisc or PID namespace
        (tried inside a throwaway namespace, deleted again)."""
        if not sys.platform.startswith("linux"):
            return False, f"network namespaces need Linux, not {sys.platform}"
        if os.geteuid() != 0:
            return False, "network namespaces need root (euid 0)"
        probe, made = f"skprobe{random.getrandbits(24):06x}", False
        try:
            ip, tc, unshare, _ = (_tool(name) for name in ("ip", "tc", "unshare", "bridge"))
            _run([ip, "netns", "add", probe])
            made = True
            _run([ip, "-n", probe, "link", "add", "b0", "type", "bridge"])
            _run([ip, "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
            _run([ip, "-n", probe, "link", "set", "v0", "master", "b0"])
            _run([tc, "-n", probe, "qdisc", "add", "dev", "v1", "root", "handle", "1:", "htb"])
            _run([ip, "netns", "exec", probe, unshare, "--pid", "--uts", "--mount-proc", "--fork", "true"])
        except HostsError as e:
            return False, str(e)
        finally:
            if made:
                _run([_tool("ip"), "netns", "del", probe], check=False)
        return True, ""


def _quiet_ipv6(link: str) -> None:
    """No IPv6 link-local address on the root namespace's bridge and ports (they stay address-
    free); best effort: a kernel without IPv6 has nothing to quiet."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass


def host_init(hostname: str, argv: list[str]) -> int:
    """PID 1 of a host's PID namespace (run by :meth:`Hosts.popen`): set the hostname, start
    ``argv`` (PID 2), pass those of ``_FORWARDED`` sent to the init on to it (PID 1 would ignore
    them), reap every orphan, and return
    its exit status (128+N if signal N ended it; 127 if it could not start).  When this returns,
    the kernel kills whatever else still runs in the namespace."""
    socket.sethostname(hostname)
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        child = os.posix_spawnp(argv[0], argv, os.environ, setsigmask=())
    except OSError as e:
        print(f"{argv[0]}: {e}", file=sys.stderr)
        return 127

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(host_init(sys.argv[1], sys.argv[2:]))
