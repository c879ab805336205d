"""What a node shows while it runs: ``phases/<phase>/live_node<r>.json``, rewritten at most once a
second, for the dashboard and ``skiptrain status`` (:mod:`skiptrain.watch`).

A node's phase record (``phases/<phase>/node<r>.json``) is written only when its phase ends; this
file is the running part of it: the node's stages, its last committed iteration, the last few
iterations' entries (events in the simulator's format, so
:func:`~skiptrain.runtime.outputs.iteration_events` reads them like a phase record), and running
totals of what its ideas did (data-parallel payload against a dense fp32 all-reduce, checkpoint
stalls, activation-cache hits).  It is written atomically (a temporary file renamed over it), so a reader never sees half
of it; writing costs one small file a second per node.

Failure semantics: a write that fails (a full disk, a removed directory) is skipped, never raised:
the node trains on, and the next write tries again.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

#: Seconds between two writes of a node's live file.
LIVE_EVERY_S = 1.0
#: Iterations a live file keeps.
LIVE_KEPT = 3
#: The file name of node ``r``'s live record, under ``phases/<phase>/``.
LIVE_NAME = "live_node{rank}.json"


class LiveRecord:
    """One node's live file: call :meth:`after_iteration` after every committed iteration.

    It writes when an iteration's common start time (``entry["t0"]``, the same on every node of
    the swarm) enters a new :attr:`every_s` window, so the nodes write the same iterations; the
    file keeps the last :data:`LIVE_KEPT` iterations written (a reader finds one every node has)."""

    def __init__(self, rank: int, every_s: float = LIVE_EVERY_S):
        self.rank, self.every_s = rank, every_s
        self.window = None
        self.recent: deque[dict] = deque(maxlen=LIVE_KEPT)
        self.unwritten: tuple | None = None
        self.totals = {"iterations": 0, "payload_bytes": 0, "dense_fp32_bytes": 0, "ckpt_s": 0.0}

    def after_iteration(self, out_dir: Path, stages: list[int], iteration: int, entry: dict,
                        cache_hits: int | None = None) -> bool:
        """Count ``entry`` (iteration ``iteration``'s record, 1-based) in the totals (and note the
        node's activation-cache hits so far, when it has a cache); write the file when its start
        time opened a new window.  Returns whether it wrote."""
        sync = entry.get("sync") or {}
        t = self.totals
        if cache_hits is not None:
            t["cache_hits"] = int(cache_hits)
        t["iterations"] += 1
        t["payload_bytes"] += int(sync.get("payload", 0))
        t["dense_fp32_bytes"] += int(sync.get("dense", 0))
        t["ckpt_s"] += float(entry.get("ckpt_s", 0.0))
        window = int(float(entry.get("t0", time.time())) // self.every_s)
        self.unwritten = (Path(out_dir), list(stages), iteration, entry)
        if window == self.window:
            return False
        self.window = window
        return self.flush()

    def flush(self) -> bool:
        """Write the last iteration counted if it is not written yet (at the end of a phase)."""
        if self.unwritten is None:
            return False
        out_dir, stages, iteration, entry = self.unwritten
        self.unwritten = None
        self.recent.append({**{k: v for k, v in entry.items() if k != "samples"}, "iteration": iteration})
        rec = {"rank": self.rank, "stages": stages, "iteration": iteration, "t": time.time(),
               "totals": dict(self.totals), "iterations": list(self.recent)}
        path = out_dir / LIVE_NAME.format(rank=self.rank)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, path)
        except OSError:
            return False
        return True


def load_live_records(run_dir: str | Path, phase: str) -> list[dict]:
    """Every node's live record of ``phase`` (rank order); a file that is not a JSON object (being
    replaced, or damaged) is left out."""
    out = []
    for f in sorted((Path(run_dir) / "phases" / phase).glob(LIVE_NAME.format(rank="*"))):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("iterations"), list):
            out.append(rec)
    return sorted(out, key=lambda r: r.get("rank", 0))


def common_iteration(records: list[dict]) -> tuple[int | None, list[dict]]:
    """The newest iteration every record in ``records`` (live records) holds, and each record's
    entry of it as a one-iteration record (for :func:`~skiptrain.runtime.outputs.iteration_events`
    at index 0); when no iteration is common, the newest of each record.  ``(None, [])``: none."""
    held = [{e.get("iteration"): e for e in r["iterations"] if isinstance(e, dict)} for r in records]
    held = [h for h in held if h]
    if not held:
        return None, []
    common = set(held[0]).intersection(*held[1:])
    if common:
        it = max(common)
        return it, [{"iterations": [h[it]]} for h in held]
    return max(max(h) for h in held), [{"iterations": [h[max(h)]]} for h in held]
