"""Writing a checkpoint: per-rank parts, the commit, and the background writer thread.

Protocol for step ``s`` with writer ranks ``R`` (one process each, or simulated in one process):

1. every rank ``r`` writes its planned shards into ``ROOT/.tmp-step-s/data-r{r}.bin`` and
   fsyncs it, then atomically writes ``part-r{r}.json`` (its shard list with CRC-32s; a rank with
   nothing to write still writes an empty part; not fsynced, as its content goes into the
   fsynced metadata);
2. the coordinating rank waits until all ``part-r*.json`` of ``R`` exist (a file-system barrier:
   no process group needed), merges them into ``metadata.json`` (fsynced), checks that every
   tensor is covered exactly once, fsyncs the directory and renames it to ``ROOT/step-s`` (the
   commit point), atomically replaces ``LATEST``, fsyncs ``ROOT`` (making both renames durable)
   and deletes all but the newest ``keep`` checkpoints.

A crash (even SIGKILL) before the rename leaves only a ``.tmp-`` directory, which readers ignore
and the next coordinator removes; after it, the checkpoint is complete and fsynced.

Throughput: one sequential file per rank; the CRC-32 of each shard of a large part is computed on
a helper thread while the writer thread writes (both release the GIL), so checksumming hides
behind the disk (a part under ``CRC_THREAD_BYTES`` is checksummed in line: cheaper than a thread).

This module uses only the standard library and numpy (buffers are anything with the buffer
protocol), so a writer can run in a light child process.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping

from . import store
from .format import (METADATA_FILE, CheckpointError, CheckpointMeta, NonFiniteCheckpoint, ShardMeta, TensorMeta,
                     align, checksum, step_dir_name, tmp_dir_name)
from .plan import SavePlan

_ZEROS = bytes(64)


CRC_THREAD_BYTES = 16 << 20     # parts at least this large are checksummed on a helper thread


def _done(value: int) -> Future:
    """A checksum already computed, read like the helper thread's."""
    f: Future = Future()
    f.set_result(value)
    return f


def part_name(rank: int) -> str:
    return f"part-r{rank}.json"


def data_name(rank: int) -> str:
    return f"data-r{rank}.bin"


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def write_part(root: str | Path, step: int, rank: int, plan: SavePlan,
               buffers: Mapping[str, Any], rank_state: dict[str, Any] | None = None,
               nonfinite: list[str] | None = None) -> dict[str, Any]:
    """Write rank ``rank``'s shards of ``plan`` for ``step`` into the temporary directory.

    ``buffers[name]`` is the tensor's whole row-major content as bytes (any buffer-protocol
    object, viewed as unsigned bytes); ``nonfinite``: the names among them that hold NaN or
    infinite values (the commit refuses the step).  Returns the part record that was written.
    """
    tmp = Path(root) / tmp_dir_name(step)
    tmp.mkdir(parents=True, exist_ok=True)
    items = plan.items(rank)
    views = []
    for it in items:
        buf = memoryview(buffers[it.name]).cast("B")
        if len(buf) != plan.specs[it.name].nbytes:
            raise CheckpointError(f"buffer for {it.name} has {len(buf)} bytes, its spec needs "
                                  f"{plan.specs[it.name].nbytes}")
        views.append(buf[it.byte_start: it.byte_start + it.nbytes])
    fname = data_name(rank)
    shards: dict[str, list[dict[str, Any]]] = {}
    written: list[dict[str, Any]] = []  # shard records in write order, CRCs filled in below
    # a helper thread checksums while this one writes; a small part is checksummed here (handing
    # it over would cost more than the checksums: a thread start and a GIL switch per shard)
    helper = sum(len(v) for v in views) >= CRC_THREAD_BYTES
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") if helper else nullcontext() as pool:
        crcs = [pool.submit(checksum, v) for v in views] if helper else [_done(checksum(v)) for v in views]
        fd = os.open(tmp / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pos = 0
        try:
            for it, v in zip(items, views):
                pad = align(pos) - pos
                if pad:
                    _write_all(fd, memoryview(_ZEROS)[:pad])
                    pos += pad
                _write_all(fd, v)
                spec = plan.specs[it.name]
                rec = ShardMeta(it.offsets(len(spec.shape)), it.lengths(spec.shape), fname, pos,
                                it.nbytes, 0).to_json()
                shards.setdefault(it.name, []).append(rec)
                written.append(rec)
                pos += it.nbytes
            os.fsync(fd)
        finally:
            os.close(fd)
        for rec, fut in zip(written, crcs):
            rec["crc32"] = fut.result()
    record = {"rank": rank, "step": step, "file": fname, "file_bytes": pos,
              "specs": {n: {"dtype": plan.specs[n].dtype, "shape": list(plan.specs[n].shape)} for n in shards},
              "shards": shards, "rank_state": rank_state or {}, "nonfinite": list(nonfinite or [])}
    # Atomic (the coordinator must never read half a part) but not fsynced: the part's content
    # ends up in metadata.json, which is fsynced before the commit; the data file already is.
    store.atomic_write(tmp / part_name(rank), json.dumps(record).encode(), durable=False)
    return record


def commit(root: str | Path, step: int, ranks: list[int], plan: SavePlan | None = None,
           state: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
           keep: int = 0, timeout: float = 600.0, timings: dict[str, float] | None = None,
           cancel: threading.Event | None = None, expect: list[str] | None = None) -> Path:
    """Coordinator: wait for every rank's part, write metadata, rename into place, update LATEST.

    Raises CheckpointError if a part is missing after ``timeout`` seconds or once ``cancel`` is
    set (a writer died: the ``.tmp-`` directory stays uncommitted), or if the parts do not cover
    every tensor of ``plan`` (without a plan: the names ``expect``) exactly once.
    """
    root = Path(root)
    tmp = root / tmp_dir_name(step)
    deadline = time.monotonic() + timeout
    parts: dict[int, dict[str, Any]] = {}
    while True:
        for r in ranks:
            if r not in parts and (tmp / part_name(r)).is_file():
                parts[r] = json.loads((tmp / part_name(r)).read_text())
        missing = [r for r in ranks if r not in parts]
        if not missing:
            break
        if cancel is not None and cancel.is_set():
            raise CheckpointError(f"save of step {step}: abandoned while ranks {missing} had not finished "
                                  f"writing; {tmp} stays uncommitted")
        if time.monotonic() > deadline:
            raise CheckpointError(f"save of step {step}: ranks {missing} did not finish writing within "
                                  f"{timeout:.0f} s; {tmp} stays uncommitted")
        time.sleep(0.005)
    _refuse_nonfinite(root, step, tmp, parts)
    tensors: dict[str, TensorMeta] = {}
    files: dict[str, int] = {}
    rank_state: dict[str, Any] = {}
    for r in sorted(parts):
        p = parts[r]
        if p["step"] != step:
            raise CheckpointError(f"part of rank {r} in {tmp} belongs to step {p['step']}, not {step}")
        files[p["file"]] = p["file_bytes"]
        if p.get("rank_state"):
            rank_state[str(r)] = p["rank_state"]
        for name, shard_list in p["shards"].items():
            spec = p["specs"][name]
            t = tensors.setdefault(name, TensorMeta(spec["dtype"], list(spec["shape"])))
            t.shards.extend(ShardMeta.from_json(s) for s in shard_list)
    for t in tensors.values():
        t.shards.sort(key=lambda s: s.offsets)
    _check_coverage(tensors, set(plan.specs) if plan is not None else expect, tmp)
    st = dict(state or {})
    if rank_state:
        st["ranks"] = rank_state
    meta = CheckpointMeta(step, tensors, st, dict(layout or {}), files)
    for r in ranks:
        (tmp / part_name(r)).unlink(missing_ok=True)
    store.write_file(tmp / METADATA_FILE, meta.encode())  # inside the uncommitted dir: no rename needed
    store.fsync_path(tmp)
    final = root / step_dir_name(step)
    if final.exists():
        store.remove_tree(final)  # an older save of the same step (re-run after resume)
    os.rename(tmp, final)   # the commit point
    store.set_latest(root, final.name)  # also fsyncs root, making the rename durable
    if timings is not None:
        timings["committed"] = time.perf_counter()
    if keep:
        store.prune(root, keep)
    return final


def _refuse_nonfinite(root: Path, step: int, tmp: Path, parts: dict[int, dict[str, Any]]) -> None:
    """A step whose parts hold non-finite values is removed, never committed: LATEST keeps naming
    the newest good step, which the error names."""
    bad = sorted({n for p in parts.values() for n in p.get("nonfinite") or []})
    if not bad:
        return
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    good = store.latest(root, warn=False)
    raise NonFiniteCheckpoint(f"checkpoint step {step} not committed: {len(bad)} tensor(s) hold NaN or infinite "
                              f"values ({', '.join(bad[:3])}): the run has diverged; "
                              + (f"{good} stays the newest good checkpoint (resume from it, e.g. with a lower "
                                 "train.lr)" if good is not None else "no earlier checkpoint was committed"))


def _check_coverage(tensors: dict[str, TensorMeta], names, where: Path) -> None:
    if names is not None:
        missing = sorted(set(names) - set(tensors))
        extra = sorted(set(tensors) - set(names))
        if missing or extra:
            raise CheckpointError(f"save into {where}: parts miss tensors {missing[:5]} / have unplanned {extra[:5]}")
    for name, t in tensors.items():
        rows = t.shape[0] if t.shape else 1
        covered = 0
        for s in t.shards:
            r0 = s.offsets[0] if s.offsets else 0
            if r0 != covered:
                raise CheckpointError(f"save into {where}: tensor {name} shards overlap or leave a gap at row {covered}")
            covered += s.lengths[0] if s.lengths else 1
        if covered != rows:
            raise CheckpointError(f"save into {where}: tensor {name} covers {covered} of {rows} rows")


class BackgroundWriter:
    """Runs one save job at a time on a background thread.

    :meth:`start` refuses to start while a job runs (the caller waits first: saves never overlap,
    and the snapshot buffers a job reads must not be overwritten).  An exception raised by a job
    is kept and re-raised by the next :meth:`wait` (or :meth:`start`), so failures are never lost.
    One worker thread serves every job (started with the first): handing a job over costs no
    thread start, which on a busy machine can take milliseconds of the caller's time.  At
    interpreter exit a job in flight is finished first.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._done: threading.Event | None = None
        self._error: BaseException | None = None
        self.last_result: Any = None

    @property
    def busy(self) -> bool:
        return self._done is not None and not self._done.is_set()

    def start(self, fn: Callable[[], Any]) -> None:
        if self.busy:
            raise RuntimeError("a checkpoint save is still running; call wait() first")
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ckpt-writer", daemon=True)
            self._thread.start()
            atexit.register(self._drain)
        self._done = threading.Event()
        self._jobs.put((fn, self._done))

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                self.last_result = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            done.set()

    def wait(self) -> Any:
        if self._done is not None:
            self._done.wait()
            self._done = None
        self._raise()
        return self.last_result

    def _drain(self) -> None:
        if self._done is not None:
            self._done.wait()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err
