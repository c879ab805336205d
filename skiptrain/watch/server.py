"""``skiptrain dashboard RUN_DIR``: a read-only web page of a run, served from this package.

The standard library's ``ThreadingHTTPServer`` serves three files of ``static/`` (the page, its
script and its style: nothing is fetched from anywhere else) and ``/state.json``, the run's state
(:func:`~skiptrain.watch.state.run_state`), which the page fetches about once a second.  The state
is computed at most every :data:`STATE_TTL_S` seconds however many pages are open, and only from
files: the dashboard never talks to a node or the coordinator.

Failure semantics: a run directory that does not exist and a port in use are one-line
:class:`~skiptrain.errors.UserError`\\ s before anything is served; a run that is starting, or whose
files are half written, is a page that says so; a run directory removed while the page is open
reads as an error line in the page, never a traceback.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ..errors import UserError
from .state import check_run_dir, run_state

#: Default address: loopback only.
DEFAULT_BIND = "127.0.0.1:8765"
#: Seconds a computed state is served again before it is read afresh.
STATE_TTL_S = 0.5
STATIC = Path(__file__).parent / "static"
FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/style.css": ("style.css", "text/css; charset=utf-8")}


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1) as ``(host, port)``; one-line error else."""
    host, _, port = text.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not 0 <= p <= 65535:
        raise UserError(f"--bind {text!r}: expected HOST:PORT with a port 0-65535 (0: any free port), e.g. {DEFAULT_BIND}")
    return host or "127.0.0.1", p


class StateCache:
    """The run's state, recomputed at most every :data:`STATE_TTL_S` seconds (one at a time)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.lock = run_dir, threading.Lock()
        self.at, self.body = 0.0, b""

    def get(self) -> bytes:
        with self.lock:
            if time.monotonic() - self.at > STATE_TTL_S:
                try:
                    st = run_state(self.run_dir)
                except UserError as e:
                    st = {"status": "error", "line": str(e), "run_dir": str(self.run_dir)}
                self.body, self.at = json.dumps(st).encode(), time.monotonic()
            return self.body


def handler_for(cache: StateCache):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            path = self.path.split("?", 1)[0]
            if path == "/state.json":
                self.reply(200, "application/json", cache.get())
            elif path in FILES:
                name, ctype = FILES[path]
                self.reply(200, ctype, (STATIC / name).read_bytes())
            else:
                self.reply(404, "text/plain; charset=utf-8", b"not found: the dashboard serves /, /state.json\n")

        def reply(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args) -> None:    # (quiet: a request a second would fill the terminal)
            pass

    return Handler


def make_server(run_dir: str | Path, bind: str = DEFAULT_BIND) -> ThreadingHTTPServer:
    """The dashboard's server for ``run_dir`` on ``bind``, listening (not yet serving)."""
    path = check_run_dir(run_dir)
    host, port = parse_bind(bind)
    try:
        server = ThreadingHTTPServer((host, port), handler_for(StateCache(path)))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use (another dashboard?); pass --bind {host}:PORT with "
                            f"another port, or --bind {host}:0 for any free one") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}; pass --bind HOST:PORT with an address "
                        "of this machine") from None
    server.daemon_threads = True
    return server
