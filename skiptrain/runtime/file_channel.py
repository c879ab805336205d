"""Files between a coordinator and its nodes on other hosts, over HTTP, not the store.

The run's store holds every value in memory, so files (a stage's weights and optimizer state:
gigabytes for a large model) go around it: the coordinator serves a :class:`FileServer` next to
its store, on the same address, at the store's port + 1 (another one if that is taken),
announced in the store (``files/addr``, signed by the coordinator).  Three kinds of request, each
streamed to or from disk in blocks (nothing is held whole in memory):

* ``PUT /in/<node>/<phase>/<step>/<name>``: one file of node ``node``'s checkpoint part, written to
  ``<root of phase>/.incoming/<node>/<step>/<name>``;
* ``PUT /out/<node>/<path>``: one of the outputs node ``node`` ships when it ends (its stage's
  weights, its metrics and timelines: :mod:`~skiptrain.runtime.shipping`), written to
  ``<outputs>/<node>/<path>`` (at most :data:`OUT_DEPTH` plain names);
* ``GET /pub/<which>/<phase>/<step>/<name>``: a file of a checkpoint the coordinator published
  (:meth:`FileServer.publish`).  Reads are not signed, as reads of the store are not.

An upload carries the SHA-256 of its bytes (``X-Skiptrain-Sha256``) and is signed with the node's
member key (``X-Skiptrain-Node``, ``X-Skiptrain-Sig``: HMAC-SHA256 of the run's id, ``PUT <path>``
and the digest): an unsigned or foreign one, or one signed for another run of the same secret, is
refused (403) before a byte is written, and one whose bytes do not hash to the signed digest (400)
never lands (each upload is received into a temporary file of its own).  Neither side trusts the bytes beyond
that: a part's digest also travels in its signed slot of the ``ckpt`` log, an output's in its
node's signed manifest, a published checkpoint's in the coordinator's signed record, and each is
checked before anything is used.

Failure semantics: the server answers 400/403/404/500 to a malformed, unsigned, unknown or
unstorable request and never raises; a client call raises ``OSError`` (nothing answers, or a
refusal: the status and reason in its message); neither an upload nor a download ever leaves a
partial file behind.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .membership import coordinator_key, member_key, open_value, read_raw, sign, tag

#: The port of the coordinator's file server, signed by the coordinator (nodes reach it at the
#: address they reach the store at).
ADDR_KEY = "files/addr"
BLOCK = 1 << 20
#: A connection that sends or takes nothing this long is closed.
SOCKET_TIMEOUT_S = 60.0
#: The most folders and file names below ``/out/<node>/`` (``phases/<phase>/<file>``).
OUT_DEPTH = 3
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def plain_path(rel: str, depth: int = OUT_DEPTH) -> bool:
    """Whether ``rel`` is 1 to ``depth`` plain names joined by ``/`` (no ``.``/``..``, nothing absolute)."""
    segs = rel.split("/") if isinstance(rel, str) else []
    return 0 < len(segs) <= depth and all(_NAME.fullmatch(s) and s not in (".", "..") for s in segs)


def _parts(path: str) -> tuple[str, list[str]] | None:
    """``(head, segments after /head/)`` of a request path, each a plain name, else None."""
    head, _, rest = path.removeprefix("/").partition("/")
    n = {"in": 4, "pub": 4, "out": 1 + OUT_DEPTH}.get(head)
    if n is None or not plain_path(rest, n) or (head != "out" and rest.count("/") != n - 1) or \
            (head == "out" and "/" not in rest):
        return None
    return head, rest.split("/")


class FileServer:
    """The coordinator's side (see the module doc): ``roots`` maps a phase to its checkpoint root
    (incoming parts go under ``.incoming`` there), ``outputs`` is where the nodes' outputs go (None:
    none are taken); ``secret`` and ``run`` (the run's id) check the nodes' signatures."""

    def __init__(self, host: str, secret: str, roots: dict[str, Path], port: int = 0, outputs: Path | None = None,
                 run: str = ""):
        self.roots, self.secret, self.run = {p: Path(r) for p, r in roots.items()}, secret, run
        self.outputs = Path(outputs) if outputs is not None else None
        self.last_bytes: dict[int, float] = {}     # node -> when its uploads last brought bytes (monotonic)
        self.closed = False
        self.published: dict[tuple[str, str], tuple[int, Path]] = {}
        self.lock = threading.Lock()
        try:
            self.http = ThreadingHTTPServer((host, port), _Handler)
        except OSError as e:            # (taken: any free port; the nodes read it from the store)
            print(f"[coordinator] port {port} is not free for checkpoint files ({e.strerror}); using one the OS "
                  "picks", file=sys.stderr, flush=True)
            self.http = ThreadingHTTPServer((host, 0), _Handler)
        self.http.daemon_threads = True
        self.http.files = self
        self.address = (host, self.http.server_address[1])
        threading.Thread(target=self.http.serve_forever, name="file-server", daemon=True).start()

    def announce(self, store) -> None:
        """Tell the nodes this server's port (signed); they reach it at the address they reach the
        store at (the coordinator may listen on every address of its host)."""
        store.set(ADDR_KEY, sign(coordinator_key(self.secret), ADDR_KEY, json.dumps(self.address[1])))

    def incoming(self, phase: str, node: int, step: int) -> Path:
        return self.roots[phase] / ".incoming" / str(node) / str(step)

    def publish(self, which: str, phase: str, step: int, directory: Path) -> None:
        """Serve the files of ``directory`` as ``which`` of ``phase`` (they must stay in place)."""
        with self.lock:
            self.published[(which, phase)] = (step, Path(directory))

    def close(self) -> None:
        """Stop serving (a second call does nothing)."""
        if not self.closed:
            self.closed = True
            self.http.shutdown()
            self.http.server_close()

    def put_path(self, node: int, head: str, parts: list[str]) -> Path | None:
        """Where a node's upload goes (None: not a phase of this job, not a step, or outputs
        this server does not take)."""
        if head == "out":
            return self.outputs / str(node) / "/".join(parts) if self.outputs is not None else None
        phase, step, name = parts
        if phase not in self.roots or not step.isdigit():
            return None
        return self.incoming(phase, node, int(step)) / name

    def get_path(self, parts: list[str]) -> Path | None:
        which, phase, step, name = parts
        with self.lock:
            pub = self.published.get((which, phase))
        if pub is None or str(pub[0]) != step or not (pub[1] / name).is_file():
            return None
        return pub[1] / name


    def received_from(self, node: int) -> None:
        self.last_bytes[node] = time.monotonic()

    def sending(self, nodes) -> bool:
        """Whether an upload of any of ``nodes`` brought bytes within the last :data:`SOCKET_TIMEOUT_S`."""
        now = time.monotonic()
        return any(now - self.last_bytes.get(n, -math.inf) < SOCKET_TIMEOUT_S for n in nodes)


def _receive(rfile, f, size: int, progress) -> str | None:
    """``size`` bytes of a request body into the open file ``f`` (``progress()`` after each
    block); their SHA-256, None when the body ended early."""
    left, h = size, hashlib.sha256()
    while left > 0:
        block = rfile.read(min(BLOCK, left))
        if not block:
            return None
        h.update(block)
        f.write(block)
        left -= len(block)
        progress()
    return h.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    """One request to a :class:`FileServer` (``self.server.files``)."""

    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S        # (a peer that connects and sends nothing frees its thread)

    def log_message(self, *args) -> None:      # (one line per request would drown the coordinator's log)
        pass

    def do_PUT(self) -> None:
        parsed = _parts(self.path)
        node, digest = self.headers.get("X-Skiptrain-Node", ""), self.headers.get("X-Skiptrain-Sha256", "")
        size = self.headers.get("Content-Length", "")
        if parsed is None or parsed[0] == "pub" or not size.isdigit() or not node.lstrip("-").isdigit() \
                or not _DIGEST.fullmatch(digest):
            return self._reply(400, "malformed request")
        head, parts = parsed
        files = self.server.files
        if parts[0] != node or not hmac.compare_digest(
                tag(member_key(files.secret, int(node)), "PUT", upload_signed(files.run, self.path, digest)),
                self.headers.get("X-Skiptrain-Sig", "")):
            return self._reply(403, "not signed by the node it names for this run")
        dest = files.put_path(int(node), head, parts[1:])
        if dest is None:
            return self._reply(404, "not a phase and step of this job, nor an output it takes")
        self._reply(*self._store(dest, int(node), int(size), digest))

    def _store(self, dest: Path, node: int, size: int, digest: str) -> tuple[int, str]:
        """Receive the body into a temporary file of its own, then move it to ``dest`` when its bytes
        match ``digest``; (status, reason).  Nothing partial is left behind by the time it replies."""
        tmp = None
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
            os.fchmod(fd, 0o644)             # (as any file the run writes, not mkstemp's 0600)
            with os.fdopen(fd, "wb") as f:
                got = _receive(self.rfile, f, size, lambda: self.server.files.received_from(node))
            if got == digest:
                os.replace(tmp, dest)
                return 200, "ok"
            return 400, "the body ended early" if got is None else "the bytes do not match their signed digest"
        except OSError as e:             # (a full disk, a peer gone mid-body, a step dropped meanwhile)
            return 500, f"not stored: {e.strerror or type(e).__name__}"
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def do_GET(self) -> None:
        parsed = _parts(self.path)
        src = self.server.files.get_path(parsed[1]) if parsed is not None and parsed[0] == "pub" else None
        if src is None:
            return self._reply(404, "not published")
        try:
            with open(src, "rb") as f:
                self.send_response(200)
                self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
                self.end_headers()
                shutil.copyfileobj(f, self.wfile, BLOCK)
        except OSError:                  # (pruned meanwhile, or the peer went away: it fetches again)
            self.close_connection = True

    def _reply(self, code: int, why: str) -> None:
        body = why.encode()
        try:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass
        self.close_connection = self.close_connection or code != 200   # (an unread body may follow)


def server_address(store, key: bytes | None) -> tuple[str, int] | None:
    """The coordinator's file server: the address this store client reaches the coordinator at,
    and the port it announced (None: none announced, or not signed by the coordinator)."""
    raw = read_raw(store, ADDR_KEY)
    value = open_value(key, ADDR_KEY, raw) if raw is not None else None
    try:
        port = int(json.loads(value)) if value is not None else None
    except (ValueError, TypeError):
        return None
    return (store.host, port) if port else None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def upload_signed(run: str, path: str, digest: str) -> str:
    """What an upload's signature covers: the run's id, the request's path and the body's digest."""
    return f"{run}\n{path}\n{digest}"


def put_file(address: tuple[str, int], key: bytes, node: int, phase: str, step: int, src: Path,
             run: str = "", timeout_s: float = 120.0) -> str:
    """Send ``src`` as node ``node``'s file of ``phase``/``step`` of run ``run`` (streamed); its
    SHA-256.  Raises ``OSError``."""
    return _put(address, key, node, f"/in/{node}/{phase}/{step}/{src.name}", src, run, timeout_s)


def put_output(address: tuple[str, int], key: bytes, node: int, rel: str, src: Path, run: str = "",
               timeout_s: float = 120.0) -> str:
    """Send ``src`` as node ``node``'s output ``rel`` (a :func:`plain_path`) of run ``run``; its
    SHA-256.  Raises ``OSError``."""
    return _put(address, key, node, f"/out/{node}/{rel}", src, run, timeout_s)


def _put(address: tuple[str, int], key: bytes, node: int, path: str, src: Path, run: str, timeout_s: float) -> str:
    digest = sha256_of(src)
    conn = http.client.HTTPConnection(*address, timeout=timeout_s)
    try:
        with open(src, "rb") as f:
            conn.request("PUT", path, body=f, headers={
                "Content-Length": str(os.fstat(f.fileno()).st_size), "X-Skiptrain-Node": str(node),
                "X-Skiptrain-Sha256": digest, "X-Skiptrain-Sig": tag(key, "PUT", upload_signed(run, path, digest))})
            resp = conn.getresponse()
            why = resp.read(200).decode(errors="replace")
        if resp.status != 200:
            raise OSError(f"the coordinator refused {path}: {resp.status} {why}")
    except http.client.HTTPException as e:
        raise OSError(f"{path}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    return digest


def get_file(address: tuple[str, int], which: str, phase: str, step: int, name: str, dest: Path,
             timeout_s: float = 120.0) -> str:
    """Download a published file to ``dest`` (streamed); its SHA-256.  Raises ``OSError``, and
    leaves no partial ``dest`` behind."""
    path = f"/pub/{which}/{phase}/{step}/{name}"
    conn = http.client.HTTPConnection(*address, timeout=timeout_s)
    h = hashlib.sha256()
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"the coordinator has no {path}: {resp.status} {resp.read(200).decode(errors='replace')}")
        with open(dest, "wb") as f:
            for block in iter(lambda: resp.read(BLOCK), b""):
                h.update(block)
                f.write(block)
    except (OSError, http.client.HTTPException) as e:
        dest.unlink(missing_ok=True)
        raise OSError(str(e) or type(e).__name__) from None
    finally:
        conn.close()
    return h.hexdigest()

