"""Admission by challenge-response (joining): a node proves it knows the run's join
secret without sending it, before it may enter any process group.

Protocol (over the rendezvous store, keys under ``join/``):

1. the node announces itself: ``join/hello/<node>``;
2. the coordinator answers with a fresh random nonce: ``join/nonce/<node>`` (32 bytes, hex);
3. the node replies ``join/resp/<node> = HMAC-SHA256(secret, nonce || node id)`` (hex);
4. the coordinator verifies with a constant-time compare and writes ``join/result/<node>`` =
   ``ok`` or ``refused``, signed with its own member key (a node accepts only a signed ``ok``);
   only admitted nodes are put in generation 0's alive set, and process groups are formed over
   that set only.

A node joining a *running* job (``python -m skiptrain.runtime.node --join HOST:PORT``, or
``skiptrain launch --join HOST:PORT``) first takes a fresh node id (:func:`request_node_id`),
then runs the same exchange with the coordinator's main loop (:func:`challenge`,
:func:`check_response`); its ``hello`` is signed with its member key
(:mod:`skiptrain.runtime.membership`).  No PID is ever sent: a node on another host fences
itself when its lease runs out (:mod:`skiptrain.runtime.fencing`).

Failure semantics: a node whose response is wrong, or that does not answer within the timeout,
is refused; the node raises :class:`JoinRefused` and exits without calling
``init_process_group`` (exit status :data:`EXIT_REFUSED`).  A join the run's nodes will never take up (they all finished first) is
cancelled: the coordinator writes the reason, signed, to ``join/cancel/<node>``
(:func:`cancel_join`), and the joiner, which waits for its placement (:func:`wait_for_placement`:
the coordinator's signed ``join/assign/<node>`` and the signed generation record behind it) and
then for the lowest node's ``join/go/<generation>`` before it enters the new groups
(:func:`wait_for_join`), exits with :class:`JoinRefused` naming it.  A store that stops answering while it waits ends it the same way.
The secret reaches the nodes through the environment variable
:data:`SECRET_ENV` (never the job file).  What this does and does not protect: docs/failures.md.
"""

from __future__ import annotations

import hashlib
import json
import hmac
import os
import secrets
import socket
import sys
import time

from .failure import NodeFailure
from .membership import (COORDINATOR, SECRET_ENV, coordinator_key, member_key, open_signed, open_value,
                         secret_from_env, sign)
from .recovery import generation_record

#: The store key of the job description joiners read (signed by the coordinator).
JOB_KEY = "job"

__all__ = ["SECRET_ENV", "JOB_KEY", "publish_job", "read_job", "EXIT_REFUSED", "JoinRefused", "secret_from_env", "new_secret", "respond", "verify",
           "node_join", "admit", "challenge", "check_response", "refuse", "request_node_id",
           "wait_for_join", "assign_join", "wait_for_placement", "cancel_join", "set_result", "read_result"]

EXIT_REFUSED = 5


class JoinRefused(NodeFailure):
    """The coordinator refused this node (wrong or missing join secret), or cancelled its join."""


def new_secret() -> str:
    return secrets.token_hex(32)


def respond(secret: str | bytes, nonce_hex: str, node: int) -> str:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, bytes.fromhex(nonce_hex) + str(int(node)).encode(), hashlib.sha256).hexdigest()


def verify(secret: str | bytes, nonce_hex: str, node: int, response: str) -> bool:
    """Whether ``response`` is the HMAC of the challenge; any malformed response is simply wrong."""
    try:
        return hmac.compare_digest(respond(secret, nonce_hex, node).encode(), response.encode())
    except (TypeError, AttributeError, UnicodeError):
        return False


def wait_for_join(store, node: int, secret: str | None, key: str, timeout_s: float,
                  poll_s: float = 0.01, signed: bool = False) -> str | None:
    """Joiner side: the value of ``key`` once the store holds it, None after ``timeout_s``
    (``signed``: only a value the coordinator signed counts; anything else is waited past).
    Raises :class:`JoinRefused` when the coordinator cancels this node's join first (its signed
    reason) or when the store stops answering (the run ended or its store host failed)."""
    cancel = f"join/cancel/{node}"
    coord = coordinator_key(secret)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            why = open_signed(coord, cancel, store.get(cancel).decode(errors="replace")) \
                if coord is not None and store.check([cancel]) else None
            if why is None and store.check([key]):       # (a cancellation wins over any value)
                raw = store.get(key).decode(errors="replace")
                value = open_value(coord if signed else None, key, raw)
                if value is not None:
                    return value
        except RuntimeError as e:          # torch's store errors (DistError and its kin) included
            raise JoinRefused(f"node {node}: the run's store stopped answering while this node waited to "
                              f"join ({str(e).splitlines()[0][:120]}): the run ended or failed", node=node) from None
        if why is not None:
            raise JoinRefused(f"node {node}: join cancelled by the coordinator: {why}", node=node)
        time.sleep(poll_s)
    return None


def assign_join(store, node: int, secret: str, gen: int) -> None:
    """Coordinator side: ``join/assign/<node>`` = the join generation that will place it, signed;
    written before that generation is published (:func:`wait_for_placement`)."""
    name = f"join/assign/{node}"
    store.set(name, sign(member_key(secret, COORDINATOR), name, str(gen)))


def wait_for_placement(store, node: int, secret: str | None, timeout_s: float, poll_s: float = 0.01) -> tuple[int, dict]:
    """Joiner side, once admitted: the join generation that places this node, and its record.
    The coordinator assigns a generation (:func:`assign_join`), then publishes it.  A coordinator
    restarted between the two publishes the join again under the next free number and assigns
    that one, so an assigned generation whose record does not place this node is waited past.
    Raises :class:`JoinRefused` on cancellation, a lost store, or no placement in ``timeout_s``."""
    key = coordinator_key(secret)
    deadline = time.time() + timeout_s
    while True:
        g = wait_for_join(store, node, secret, f"join/assign/{node}", deadline - time.time(), signed=True)
        if g is None or time.time() > deadline:
            raise JoinRefused(f"node {node}: admitted but never placed by the coordinator", node=node)
        rec = generation_record(store, int(g), key) if g.isdigit() else None
        if rec is not None and str(node) in (rec.get("join") or {}):
            return int(g), rec
        time.sleep(poll_s)


def publish_job(store, job: dict, secret: str) -> None:
    """Coordinator side: the job description joiners read (:data:`JOB_KEY`), signed."""
    store.set(JOB_KEY, sign(member_key(secret, COORDINATOR), JOB_KEY, json.dumps(job)))


def read_job(store, secret: str | None) -> dict:
    """Joiner side, before anything else: the job description the coordinator signed.  Raises
    :class:`JoinRefused` without the secret or when the description does not verify with it
    (a wrong secret, or a rewrite by a process without it: a joiner never trains on, reads data
    for or writes files for a job nobody with the secret described)."""
    if not secret:
        raise JoinRefused(f"no join secret: set {SECRET_ENV} to the run's secret (the run's RUN_DIR/join_secret)")
    value = open_signed(member_key(secret, COORDINATOR), JOB_KEY, store.get(JOB_KEY).decode(errors="replace"))
    if value is None:
        raise JoinRefused(f"the job description in the run's store does not verify with this {SECRET_ENV}: the "
                          "secret is wrong (use the run's RUN_DIR/join_secret), or a process without it rewrote it")
    return json.loads(value)


def cancel_join(store, node: int, secret: str, why: str) -> None:
    """Coordinator side: ``join/cancel/<node>`` = ``why``, signed with the coordinator's key (a
    joiner believes no one else's cancellation)."""
    name = f"join/cancel/{node}"
    store.set(name, sign(member_key(secret, COORDINATOR), name, why))


def node_join(store, node: int, secret: str | None, timeout_s: float) -> None:
    """Node side: answer the coordinator's challenge; raise :class:`JoinRefused` if refused."""
    name = f"join/hello/{node}"
    store.set(name, sign(member_key(secret, node) if secret else None, name,     # (its host: for swarm.json)
                         json.dumps({"t": time.time(), "host": socket.gethostname()})))
    nonce = wait_for_join(store, node, secret, f"join/nonce/{node}", timeout_s)
    if nonce is None:
        raise JoinRefused(f"node {node}: no challenge from the coordinator within {timeout_s:g} s", node=node)
    store.set(f"join/resp/{node}", respond(secret or "", nonce, node) if secret else "")
    raw = wait_for_join(store, node, secret, f"join/result/{node}", timeout_s)
    res = read_result(secret, node, raw) if secret and raw is not None else raw
    if res != "ok":
        raise JoinRefused(f"node {node}: refused by the coordinator ({res or 'no answer'}): "
                          "wrong or missing join secret", node=node)


def admit(store, nodes: list[int], secret: str, timeout_s: float, alive=lambda n: True) -> dict[int, str]:
    """Coordinator side: challenge every node of ``nodes``; returns ``{node: "ok" | reason}``.
    ``alive(n)`` tells whether the process still runs (a dead one is not waited for)."""
    out: dict[int, str] = {}
    nonces = {}
    for n in nodes:
        nonces[n] = secrets.token_hex(32)
        store.set(f"join/nonce/{n}", nonces[n])
    deadline = time.time() + timeout_s
    pending = set(nodes)
    while pending and time.time() < deadline:
        for n in sorted(pending):
            if store.check([f"join/resp/{n}"]):
                resp = store.get(f"join/resp/{n}").decode(errors="replace")
                ok = bool(resp) and verify(secret, nonces[n], n, resp)
                out[n] = "ok" if ok else "refused: wrong challenge response"
                set_result(store, n, secret, ok)
                pending.discard(n)
            elif not alive(n):
                out[n] = "refused: exited before answering the challenge"
                pending.discard(n)
        time.sleep(0.01)
    for n in pending:
        out[n] = f"refused: no challenge response within {timeout_s:g} s"
        set_result(store, n, secret, False)
    return out


def challenge(store, node: int) -> str:
    """Coordinator side, one joining node: write a fresh nonce; returns it."""
    nonce = secrets.token_hex(32)
    store.set(f"join/nonce/{node}", nonce)
    return nonce


def check_response(store, node: int, nonce: str, secret: str) -> bool | None:
    """Coordinator side: ``None`` while no response, else whether it is right (and then the
    result is written: ``ok`` or ``refused``)."""
    if not store.check([f"join/resp/{node}"]):
        return None
    resp = store.get(f"join/resp/{node}").decode(errors="replace")
    ok = bool(resp) and verify(secret, nonce, node, resp)
    set_result(store, node, secret, ok)
    return ok


def refuse(store, node: int, secret: str) -> None:
    set_result(store, node, secret, False)


def set_result(store, node: int, secret: str, ok: bool) -> None:
    """Coordinator side: ``join/result/<node>`` = ``ok`` or ``refused``, signed with the coordinator's key."""
    name = f"join/result/{node}"
    store.set(name, sign(member_key(secret, COORDINATOR), name, "ok" if ok else "refused"))


def read_result(secret: str, node: int, raw: str) -> str | None:
    """The join result the coordinator signed, or None: a forged ``ok`` admits nobody."""
    return open_signed(member_key(secret, COORDINATOR), f"join/result/{node}", raw)


def request_node_id(store) -> int:
    """A joining process's node id: the next one after every id handed out so far (the launcher
    sets ``nodes/next`` to its node count before it publishes the store address)."""
    return int(store.add("nodes/next", 1)) - 1




def read_secret_file(path: str, make: bool = False) -> str:
    """The run's secret from the file ``path``; when it does not exist and ``make``, a new one
    written there (mode 0600, readable by this user only).  Raises
    :class:`~skiptrain.errors.UserError` (one line naming the fix) when it cannot."""
    from pathlib import Path

    from ..errors import UserError

    p = Path(path)
    if make and not p.exists():
        secret = new_secret()
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise UserError(f"cannot write the join secret file {path!r} ({e.strerror}); give a path in an "
                            "existing folder this user can write") from None
        os.write(fd, secret.encode())
        os.close(fd)
        print(f"skiptrain: wrote a new join secret to {p}; copy it to every host that runs a node",
              file=sys.stderr, flush=True)
        return secret
    try:
        secret = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the join secret file {path!r} ({getattr(e, 'strerror', None) or e}); copy the "
                        "run's secret file from the coordinator's host (RUN_DIR/join_secret for `skiptrain launch`)") from None
    if not secret:
        raise UserError(f"the join secret file {path!r} is empty; copy the run's secret file from the coordinator's host")
    return secret
