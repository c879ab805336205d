"""The checkpoint directory protocol: names, atomic file replacement, listing, LATEST, pruning.

``ROOT/`` holds committed checkpoints ``step-XXXXXXXX/`` (each with ``metadata.json``), the
``LATEST`` pointer, and transient entries that are never mistaken for checkpoints:
``.tmp-step-XXXXXXXX/`` (a save in progress, or one killed mid-way) and ``.trash-*`` (being
deleted).  A directory is *committed* when it has its final name, which happens by one
``rename`` after all its files and the metadata are fsynced; so after a crash at any instant the
root holds only committed checkpoints, plus transient entries that :func:`clean_stale` removes.

``LATEST`` is replaced atomically (write temp file, fsync, rename, fsync directory).  Readers
trust it when it names a committed directory and otherwise fall back to the committed directory
with the highest step (e.g. a crash between the directory rename and the ``LATEST`` update),
with a warning on stderr that names the checkpoint used.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .format import LATEST_FILE, METADATA_FILE, STEP_DIR_RE


def fsync_path(path: str | Path) -> None:
    """Make durable what was written to the directory, or the file, at ``path`` (a file written by
    another process, or moved here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` (truncating), fsynced when ``durable``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new file, never a mix.

    ``durable=False`` skips the fsyncs: the replacement is still atomic for concurrent readers
    but may be lost in a power failure (used for files a later fsync covers or makes moot).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_file(tmp, data, durable)
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)


def step_of(name: str) -> int | None:
    m = STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def list_committed(root: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        step = step_of(entry.name)
        if step is not None and (entry / METADATA_FILE).is_file():
            out.append((step, entry))
    return sorted(out)


def start_branch(root: str | Path, step: int) -> Path | None:
    """A run resumed from its committed step ``step`` while newer steps are committed under
    ``root``: those belong to another branch of the run (another trajectory).  They move to
    ``root/branch-<time>-after-<step>/``, where nothing loads or prunes them, and ``LATEST``
    names ``step``, so the new branch's saves are written (a save of a committed step is a
    no-op) and a crash resumes within it.  Returns that folder, None when nothing was newer."""
    import time

    root = Path(root)
    newer = [p for s, p in list_committed(root) if s > step]
    if not newer:
        return None
    set_latest(root, f"step-{step:08d}")        # (first: a crash while moving leaves LATEST on this branch)
    dest = root / f"branch-{time.strftime('%Y%m%dT%H%M%S')}-after-{step}"
    dest.mkdir()
    for p in newer:
        os.rename(p, dest / p.name)
    fsync_path(dest)
    fsync_path(root)
    return dest


def latest(root: str | Path, warn: bool = True) -> Path | None:
    """The checkpoint ``LATEST`` names if it is committed, else the newest committed one, else None.

    Falling back is never silent: with ``warn`` a missing, empty, unreadable or dangling ``LATEST``
    next to committed checkpoints is reported on stderr, naming the checkpoint used instead.
    """
    root = Path(root)
    try:
        name = (root / LATEST_FILE).read_text().strip()
        problem = f"names {name!r}, which is not a committed checkpoint" if name else "is empty"
    except FileNotFoundError:
        name, problem = "", "is missing"
    except (OSError, UnicodeDecodeError) as e:
        name, problem = "", f"is unreadable ({getattr(e, 'strerror', None) or e})"
    if name and step_of(name) is not None and (root / name / METADATA_FILE).is_file():
        return root / name
    committed = list_committed(root)
    if not committed:
        return None
    step, path = committed[-1]
    if warn:
        print(f"skiptrain: warning: {root / LATEST_FILE} {problem}; using the newest committed checkpoint "
              f"{path.name} (step {step}) instead", file=sys.stderr, flush=True)
    return path


def previous(path: str | Path) -> Path | None:
    """The newest committed checkpoint in the same root with a lower step than ``path``."""
    path = Path(path)
    step = step_of(path.name)
    older = [p for s, p in list_committed(path.parent) if step is None or s < step]
    return older[-1] if older else None


def set_latest(root: str | Path, name: str) -> None:
    """Point LATEST at ``name``: atomic rename, then one fsync of ``root``.

    The file's content is not fsynced on its own: if a power failure left it empty or stale,
    :func:`latest` falls back to the newest committed directory, which is durable already.
    The directory fsync also makes the checkpoint's own rename durable, so a commit costs one
    root fsync, not two.
    """
    atomic_write(Path(root) / LATEST_FILE, (name + "\n").encode(), durable=False)
    fsync_path(root)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no half-deleted committed name is ever visible: rename first."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints (never the one LATEST names)."""
    if keep <= 0:
        return []
    root = Path(root)
    pinned = latest(root, warn=False)
    committed = list_committed(root)
    removed = []
    for _, p in committed[:-keep]:
        if pinned is not None and p.name == pinned.name:
            continue
        remove_tree(p)
        removed.append(p)
    return removed


def clean_stale(root: str | Path) -> list[Path]:
    """Remove leftovers of interrupted saves and deletions (``.tmp-*``, ``.trash-*``, ``LATEST.tmp``).

    Only the coordinating rank calls this, and only when no save of this run is in progress.
    """
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.name.startswith((".tmp-", ".trash-")) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif entry.name == LATEST_FILE + ".tmp":
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
