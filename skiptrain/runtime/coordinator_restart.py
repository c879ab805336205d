"""``python -m skiptrain.runtime.coordinator_restart --run RUN_DIR``: a new coordinator for a
restartable run on this host whose coordinator (its launcher) died; see :func:`main`."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from .event_log import LOG_NAME
from .failure import RuntimeFailure, pid_running
from .job import Job
from .launcher import adopt


def main(argv: list[str] | None = None) -> int:
    """``python -m skiptrain.runtime.coordinator_restart --run RUN_DIR``: replace a coordinator that died
    (a run launched with ``Job(restartable=True)`` / ``--restartable``).  It reads the job, the
    store address and the join secret from the run directory and takes the live run over from
    its store (:func:`~skiptrain.runtime.launcher.adopt`): at the end it merges the outputs like
    the launcher and stops the store."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.coordinator_restart", description=main.__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="run directory of the running job")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds after the restart before giving up on the run (the run then fails and its store "
                         "stops); default: no limit, the nodes' own timeouts apply")
    args = ap.parse_args(argv)
    run_dir = Path(args.run)
    try:
        job = Job.load(run_dir / "job.json")
        info = json.loads((run_dir / "store.json").read_text())
        secret = (run_dir / "join_secret").read_text()
    except OSError as e:
        print(f"skiptrain coordinator: {run_dir} is not a running restartable job ({e.strerror}: {e.filename}); "
              "launch with restartable=True (--restartable)", file=sys.stderr)
        return 2
    gone = (f"skiptrain coordinator: the store of {run_dir} is gone, so the run has ended; its checkpoints "
            f"are in {run_dir / 'checkpoints'} (skiptrain launch --resume --out {run_dir} continues)")
    try:
        if not pid_running(int(info["pid"])):
            print(gone, file=sys.stderr)
            return 2
        address = (str(info["host"]), int(info["port"]))
    except (KeyError, ValueError, TypeError) as e:
        print(f"{gone} ({str(e).splitlines()[0][:120]})", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        adopt(job, address, secret, remote=False, timeout_s=math.inf if args.timeout is None else args.timeout)
    except RuntimeFailure as e:
        if e.node is None and "no generation 0 yet" in str(e):   # nothing to resume (the store is stopped)
            print(f"skiptrain coordinator: {e}", file=sys.stderr)
            return 2
        print(f"skiptrain coordinator: the run failed: {str(e).splitlines()[0]} (membership events: "
              f"{run_dir / LOG_NAME}; resume it from its last checkpoint with `skiptrain launch --resume --out "
              f"{run_dir}`)", file=sys.stderr)
        return 1
    except RuntimeError as e:          # (no store answers there)
        print(f"{gone} ({str(e).splitlines()[0][:120]})", file=sys.stderr)
        return 2
    print(f"skiptrain coordinator: the run finished ({time.time() - t0:.1f} s after the restart)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
