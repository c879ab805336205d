"""The working directory of a benchmark: the user's ``--keep`` folder, or a new folder
``runs/bench/<name>/<date-time>`` of the repository.  Either is kept: a benchmark never deletes
what a run wrote."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def work_dir(keep: str | Path | None, prefix: str) -> Iterator[Path]:
    """``keep`` (created if missing) when given, else a new folder under ``runs/bench/`` named
    after ``prefix``; kept in both cases."""
    path = Path(keep) if keep else REPO / "runs" / "bench" / prefix.strip("-_") / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    yield path
