"""The working directory of a benchmark: the user's ``--keep`` folder, kept, or a temporary one
that is removed when the benchmark ends, however it ends."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def work_dir(keep: str | Path | None, prefix: str) -> Iterator[Path]:
    """``keep`` (created if missing) when given, else a fresh temporary directory named
    ``prefix...`` that is deleted on exit."""
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)
