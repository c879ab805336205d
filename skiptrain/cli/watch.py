"""``skiptrain dashboard RUN_DIR`` (a live web page of a run) and ``skiptrain status RUN_DIR`` (the
same facts in the terminal): both only read the run directory (docs/dashboard.md)."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_dashboard(args: argparse.Namespace) -> int:
    from ..watch.server import make_server

    server = make_server(args.run_dir, args.bind)
    host, port = server.server_address[:2]
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"skiptrain dashboard: note: listening on {host}, not only on this machine's loopback: anyone who "
              "reaches it can read the run's metrics", file=sys.stderr, flush=True)
    print(f"skiptrain dashboard: http://{host}:{port}/ shows {args.run_dir} (it only reads files; Ctrl-C stops)",
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..watch.state import run_state
    from ..watch.status import render, status_json

    st = run_state(args.run_dir)
    print(json.dumps(status_json(st), indent=1) if args.json else render(st), flush=True)
    return 0


def register(sub) -> None:
    from ..watch.server import DEFAULT_BIND

    p = sub.add_parser("dashboard", help="a live, read-only web page of a run (nodes, Gantt, loss, events, ideas)",
                       description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (in a run across hosts: the coordinator's)")
    p.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                   help=f"address to serve on (default {DEFAULT_BIND}: this machine only; port 0: any free one)")
    p.set_defaults(func=cmd_dashboard)
    p = sub.add_parser("status", help="a run's nodes, membership events and what each idea did, on one screen",
                       description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (in a run across hosts: the coordinator's)")
    p.add_argument("--json", action="store_true", help="print the state as JSON (for scripts)")
    p.set_defaults(func=cmd_status)
