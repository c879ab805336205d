"""``RUN_DIR/recoveries.jsonl``: the coordinator's record of membership events (a node failed,
refused, joined, a join cancelled, the coordinator restarted), one JSON object a line."""

from __future__ import annotations

import json
from pathlib import Path


def log_event(log_path: Path, row: dict) -> None:
    """Append ``row`` to the events log at ``log_path``."""
    with open(log_path, "a") as f:
        f.write(json.dumps(row) + "\n")
