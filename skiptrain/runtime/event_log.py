"""``RUN_DIR/recoveries.jsonl``: the coordinator's record of membership events (a node failed,
refused, joined, a join cancelled, the coordinator restarted), one JSON object a line."""

from __future__ import annotations

import json
from pathlib import Path

LOG_NAME = "recoveries.jsonl"


def log_event(log_path: Path, row: dict) -> None:
    """Append ``row`` to the events log at ``log_path``."""
    with open(log_path, "a") as f:
        f.write(json.dumps(row) + "\n")


def event_kind(row: dict) -> str:
    """What a logged row records: ``restart`` (a coordinator took the run over), ``refused`` (a
    node or joiner refused admission), ``join_cancelled``, ``joined``, else ``failed`` (a node
    died, hung past its deadline or was banned, and was fenced)."""
    if row.get("restart"):
        return "restart"
    if row.get("refused"):
        return "refused"
    if row.get("join"):
        return "join_cancelled" if str(row.get("cause", "")).startswith("join cancelled") else "joined"
    return "failed"


def membership_events(run_dir: Path) -> list[dict]:
    """The run's membership events, oldest first, one dict each: ``time`` (the coordinator's
    clock when it acted, unix seconds), ``kind`` (:func:`event_kind`), ``node``, ``gen`` (the
    generation it published) and ``cause``.  A log line that is not a JSON object is skipped."""
    path = Path(run_dir) / LOG_NAME
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append({"time": row.get("t_detect"), "kind": event_kind(row), "node": row.get("node"),
                        "gen": row.get("gen"), "cause": row.get("cause")})
    return sorted(out, key=lambda e: (e["time"] is None, e["time"] or 0.0))
