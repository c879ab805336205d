"""Reading a checkpoint under any layout: only the byte ranges asked for, every one checksummed.

:class:`CheckpointReader` opens one committed checkpoint (or the latest under a root), reads
``metadata.json`` and then serves tensors by global name.  Loading is layout-free: a node that
holds stages {2, 3} of a 2-stage partition asks for exactly its tensors' names, whatever layout
wrote them; each shard of those tensors is read with ``pread`` straight into the destination
tensor's memory (no staging copy) and its CRC-32 is checked (on a helper thread, overlapping the
next read).

Failure behaviour: a missing or truncated data file, a checksum mismatch, or unreadable metadata
raises :class:`CheckpointCorruptError` naming the checkpoint, the file and the tensor, and
offering the newest older committed checkpoint.  Unknown format versions or dtypes raise
:class:`CheckpointFormatError`.  A tensor name that is not in the checkpoint is a KeyError-like
:class:`CheckpointError` listing close names.
"""

from __future__ import annotations

import difflib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

import torch

from . import store
from .format import (METADATA_FILE, CheckpointCorruptError, CheckpointError, CheckpointMeta, TensorMeta,
                     checksum)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a writable numpy uint8 array (no copy)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return flat.view(torch.uint8).numpy()


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the latest committed one when ``path`` is a checkpoint root."""
    path = Path(path)
    if (path / METADATA_FILE).is_file():
        return path
    found = store.latest(path)
    if found is None:
        if path.name.startswith(".tmp-"):
            raise CheckpointError(f"{path} is an uncommitted save (interrupted); it cannot be loaded")
        raise CheckpointError(f"no committed checkpoint at {path} (expected {METADATA_FILE} or a "
                              f"checkpoint root with step-* directories)")
    return found


class CheckpointReader:
    def __init__(self, path: str | Path):
        self.path = resolve(path)
        try:
            raw = (self.path / METADATA_FILE).read_bytes()
        except OSError as e:
            raise self._corrupt(f"cannot read {METADATA_FILE}: {e}", METADATA_FILE) from None
        try:
            self.meta: CheckpointMeta = CheckpointMeta.decode(raw, str(self.path))
        except CheckpointCorruptError as e:
            raise e.with_previous(store.previous(self.path)) from None
        self._sizes: dict[str, int] = {}

    # ---- convenience ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def state(self) -> dict:
        return self.meta.state

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.meta.tensors if n.startswith(prefix))

    def tensor_meta(self, name: str) -> TensorMeta:
        try:
            return self.meta.tensors[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self.meta.tensors), n=3)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.path}{hint}") from None

    def _corrupt(self, msg: str, file: str | None = None, tensor: str | None = None) -> CheckpointCorruptError:
        return CheckpointCorruptError(msg, self.path, file, tensor, store.previous(self.path))

    def _file_size(self, fname: str, tensor: str) -> int:
        if fname not in self._sizes:
            try:
                self._sizes[fname] = os.stat(self.path / fname).st_size
            except FileNotFoundError:
                raise self._corrupt("data file is missing", fname, tensor) from None
        return self._sizes[fname]

    # ---- reading --------------------------------------------------------------------------

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_into({name: out} if out is not None else {name: None})[name]

    def read_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return self.read_into({n: None for n in names})

    def read_into(self, targets: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Fill each target (or a new tensor where the target is None) with the stored tensor.

        Reads the needed shards in file and offset order, straight into the targets' memory,
        verifying every shard's CRC-32.  A target must be a contiguous CPU tensor with the stored
        shape and dtype (so parameters can be loaded in place).
        """
        out: dict[str, torch.Tensor] = {}
        jobs = []  # (file, byte_offset, view, shard, name)
        for name, target in targets.items():
            t = self.tensor_meta(name)
            dt = torch_dtype(t.dtype)
            if target is None:
                target = torch.empty(t.shape, dtype=dt)
            elif (list(target.shape) != t.shape or target.dtype != dt or target.device.type != "cpu"
                  or not target.is_contiguous()):
                raise CheckpointError(
                    f"cannot load {name} from {self.path}: stored {t.dtype}{t.shape}, destination is "
                    f"{dtype_name(target.dtype)}{list(target.shape)} on {target.device}; the model's "
                    "configuration differs from the checkpoint's")
            out[name] = target
            buf = byte_view(target)
            row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
            for s in t.shards:
                if t.shape and (s.offsets[1:] != [0] * (len(t.shape) - 1) or s.lengths[1:] != t.shape[1:]):
                    raise CheckpointError(f"{self.path}: tensor {name} has a shard that is not a block "
                                          "of whole rows; this reader loads row-block shards only")
                start = s.offsets[0] * row_bytes if t.shape else 0
                if start + s.nbytes > t.nbytes:
                    raise self._corrupt("shard lies outside the tensor", s.file, name)
                jobs.append((s.file, s.byte_offset, buf[start: start + s.nbytes], s, name))
        jobs.sort(key=lambda j: (j[0], j[1]))
        fds: dict[str, int] = {}
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as pool:
                pending = []
                for fname, off, view, s, name in jobs:
                    size = self._file_size(fname, name)
                    if off + s.nbytes > size:
                        raise self._corrupt(f"truncated: shard needs bytes [{off}, {off + s.nbytes}) "
                                            f"but the file has {size} bytes", fname, name)
                    if fname not in fds:
                        fds[fname] = os.open(self.path / fname, os.O_RDONLY)
                    _pread_all(fds[fname], view, off)
                    pending.append((pool.submit(checksum, view), s, name))
                for fut, s, name in pending:
                    got = fut.result()
                    if got != s.crc32:
                        raise self._corrupt(f"checksum mismatch in bytes [{s.byte_offset}, "
                                            f"{s.byte_offset + s.nbytes}) (stored {s.crc32:#010x}, "
                                            f"read {got:#010x})", s.file, name)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def verify(self, names: Iterable[str] | None = None, chunk: int = 64) -> int:
        """Read and checksum every shard (or those of ``names``); returns the bytes checked.

        Also checks each data file's size against the metadata.  Raises CheckpointCorruptError
        at the first problem.  Tensors are read ``chunk`` at a time to bound memory.
        """
        names = self.names() if names is None else list(names)
        for fname, size in self.meta.files.items():
            have = self._file_size(fname, self._first_tensor_in(fname))
            if have != size:
                raise self._corrupt(f"file has {have} bytes, metadata says {size} (truncated or "
                                    "appended to)", fname, self._first_tensor_beyond(fname, have))
        total = 0
        for i in range(0, len(names), chunk):
            got = self.read_many(names[i: i + chunk])
            total += sum(t.numel() * t.element_size() for t in got.values())
        return total

    def _first_tensor_in(self, fname: str) -> str | None:
        for n, t in sorted(self.meta.tensors.items()):
            if any(s.file == fname for s in t.shards):
                return n
        return None

    def _first_tensor_beyond(self, fname: str, size: int) -> str | None:
        best = None
        for n, t in self.meta.tensors.items():
            for s in t.shards:
                if s.file == fname and s.byte_offset + s.nbytes > size:
                    if best is None or s.byte_offset < best[0]:
                        best = (s.byte_offset, n)
        return best[1] if best else None


def _pread_all(fd: int, view, offset: int) -> None:
    mv = memoryview(view).cast("B")
    while mv:
        n = os.preadv(fd, [mv], offset)
        if n <= 0:
            raise OSError(f"unexpected end of file at offset {offset}")
        mv, offset = mv[n:], offset + n
