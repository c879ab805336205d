"""Who may speak in a run's membership: the store's address, and signed membership writes.

The rendezvous store (a ``TCPStore``) has no access control: anyone who reaches its port may
read and write any key.  So

* the store listens on one address only (:func:`host_store`; loopback by default), never on
  every interface;
* every membership write a node makes (heartbeat ``hb/<r>``, failure report ``report/<g>/<r>``,
  PID ``pid/<r>``, a joiner's ``join/hello/<r>``, the lowest node's schedule in force
  ``sched/cur``), and what the coordinator writes for the nodes to act on (generation records
  ``gen/<g>``, join results ``join/result/<r>`` and assignments ``join/assign/<r>``, the job
  description ``job``; with the key of id :data:`COORDINATOR`), carries an HMAC-SHA256 tag made
  with the writer's *member key*, ``HMAC-SHA256(run secret, "skiptrain member key|<r>")``.  Only
  a process that knows the run's secret (every admitted node has it; the coordinator has it) can
  make the tag, and the tag covers the key name, so a value cannot be moved to another key or
  node;
* the coordinator reads these keys through :class:`Verifier`: a value whose tag does not verify
  is ignored and logged (an older lease renewal written back over a newer one is the
  coordinator's :class:`~skiptrain.runtime.lease.LeaseTable`'s to refuse), never acted on; nodes
  read the coordinator's the same way (``recovery.generation_record``, ``join.read_job``).

A signed value is ``<value>#sig=<64 hex digits>``.  Runs without a secret (no ``--recover``)
write plain values; readers that only display or time values strip the tag
(:func:`strip_tag`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

SECRET_ENV = "SKIPTRAIN_JOIN_SECRET"
TAG = "#sig="
#: The member-key id of the coordinator (its saved strikes, the join results it writes).
COORDINATOR = -1
_LABEL = b"skiptrain member key|"


def member_key(secret: str | bytes, node: int) -> bytes:
    """The member key of node ``node``: derived from the run's secret, never sent anywhere."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, _LABEL + str(int(node)).encode(), hashlib.sha256).digest()


def secret_from_env() -> str | None:
    """The run's secret, which the launcher hands its nodes in :data:`SECRET_ENV` (None: no secret)."""
    return os.environ.get(SECRET_ENV) or None


def key_from_env(node: int) -> bytes | None:
    """This node's member key from the run's secret in the environment (None: no secret)."""
    secret = secret_from_env()
    return member_key(secret, node) if secret else None


def tag(key: bytes, name: str, value: str) -> str:
    return hmac.new(key, name.encode() + b"\n" + value.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes | None, name: str, value: str) -> str:
    """``value`` with its tag for store key ``name`` (``value`` unchanged without a key)."""
    return value if key is None else f"{value}{TAG}{tag(key, name, value)}"


def open_signed(key: bytes, name: str, raw: str) -> str | None:
    """The value of a signed ``raw`` read from store key ``name``, or None if its tag is wrong."""
    value, sep, got = raw.rpartition(TAG)
    if not sep:
        return None
    try:
        ok = hmac.compare_digest(tag(key, name, value).encode(), got.encode())
    except (TypeError, UnicodeError):
        return None
    return value if ok else None


def open_value(key: bytes | None, name: str, raw: str) -> str | None:
    """:func:`open_signed` with ``key``; ``raw`` itself when ``key`` is None (a run without a
    secret writes plain values)."""
    return raw if key is None else open_signed(key, name, raw)


def coordinator_key(secret: str | bytes | None) -> bytes | None:
    """The coordinator's member key (id :data:`COORDINATOR`) from the run's secret; None without one."""
    return member_key(secret, COORDINATOR) if secret else None


def strip_tag(raw: str) -> str:
    """The value of ``raw`` without its tag (for readers that do not act on it)."""
    value, sep, _ = raw.rpartition(TAG)
    return value if sep else raw


def read_raw(store, name: str) -> str | None:
    """The value of store key ``name`` as stored (tag included), None when absent; a store hiccup
    reads as "nothing there yet"."""
    try:
        if not store.check([name]):
            return None
        return store.get(name).decode(errors="replace")
    except Exception:  # noqa: BLE001
        return None


#: No run hands out more node ids than this: a larger ``nodes/next`` was forged (see :func:`read_count`).
MAX_NODE_IDS = 1 << 20


def read_count(store, name: str, at_most: int | None = None) -> int | None:
    """The counter ``name`` (one that processes take numbers from with ``store.add``), read
    without ``add``: anyone who reaches the store port can set any key, and ``add`` on a value
    that is not an integer fails on the store server, which then closes the caller's connection
    for good.  None when the key is absent, is not a non-negative integer, or is above
    ``at_most`` (a forged jump: the caller keeps what it had)."""
    return _count(read_raw(store, name), at_most)


def _count(raw: str | None, at_most: int | None = None) -> int | None:
    try:
        n = int(raw) if raw is not None else None
    except ValueError:
        return None
    return n if n is not None and n >= 0 and (at_most is None or n <= at_most) else None


def raise_count(store, name: str, at_least: int, at_most: int | None = None) -> None:
    """Set the counter ``name`` to at least ``at_least`` by compare-and-set (never ``add``, see
    :func:`read_count`), without losing a number another process takes meanwhile; a value that is
    not a counter (or is above ``at_most``) is replaced.  Gives up after a few tries while another
    process keeps rewriting it."""
    for _ in range(8):
        raw = read_raw(store, name)
        current = _count(raw, at_most)
        if current is not None and current >= at_least:
            return
        got = store.compare_set(name, raw if raw is not None else "", str(at_least))
        if bytes(got).decode(errors="replace") == str(at_least):
            return


def set_member(store, node: int, name: str, value: str) -> None:
    """Node side: write ``name = value``, signed with this node's member key when the run has a secret."""
    store.set(name, sign(key_from_env(node), name, value))


class Verifier:
    """Coordinator side: reads node-written keys and keeps only what the writer's key signed.

    A value that fails (missing or wrong tag) is ignored; each distinct forgery is printed to stderr and logged to ``log_path`` once.
    """

    def __init__(self, secret: str, log_path: Path | None = None):
        self.secret = secret
        self.log_path = log_path
        self.keys: dict[int, bytes] = {}
        self.logged: set[tuple[str, str]] = set()
        self.forged = 0

    def key(self, node: int) -> bytes:
        if node not in self.keys:
            self.keys[node] = member_key(self.secret, node)
        return self.keys[node]

    def read(self, store, node: int, name: str) -> str | None:
        """The verified value of ``name`` (written by ``node``), None when absent or forged."""
        raw = read_raw(store, name)
        if raw is None:
            return None
        value = open_signed(self.key(node), name, raw)
        if value is None:
            self.reject(name, raw, "its tag does not verify with the member key of node "
                        f"{node}: not written by an admitted node")
        return value

    def reject(self, name: str, raw: str, why: str) -> None:
        self.forged += 1
        if (name, raw) in self.logged:
            return
        self.logged.add((name, raw))
        print(f"[coordinator] ignored a write to {name}: {why}", file=sys.stderr, flush=True)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"forged": name, "why": why, "value": raw[:200], "t": time.time()}) + "\n")


def listen_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (``port`` 0: chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(512)
    return s


def host_store(world: int, timeout_s: float, host: str = "127.0.0.1", port: int = 0):
    """Host a ``TCPStore`` that listens on ``host`` only (``port`` 0: any free one); returns
    ``(store, socket)``.

    A ``TCPStore`` server binds every interface by itself; here it serves on a socket bound to
    ``host``.  The caller keeps the socket referenced as long as the store serves.
    """
    import torch.distributed as dist

    s = listen_socket(host, port)
    store = dist.TCPStore(host, s.getsockname()[1], world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s), master_listen_fd=s.fileno())
    return store, s
