"""The on-disk format: one layout-independent metadata file plus raw data files.

A committed checkpoint is a directory ``ROOT/step-00000100/`` holding

* ``metadata.json``: the only file a reader needs to plan its reads.  It maps every tensor's
  **global name** (model parameters as in an unsplit model, e.g. ``layers.7.attn.wq.weight``;
  optimizer state by the same name with a prefix, ``optim.exp_avg.layers.7.attn.wq.weight``) to
  its dtype, global shape and shards.  A shard is a box of the tensor (``offsets`` and ``lengths``
  per dimension; skiptrain's writer cuts only along dimension 0, so every shard is one contiguous
  byte range of the row-major tensor) stored at ``[byte_offset, byte_offset + nbytes)`` of a data
  file, with the CRC-32 of those bytes.  It also holds the step, JSON state (config, data cursor,
  RNG states, placement, freeze state, optimizer hyper-parameters), the layout that wrote it and a
  CRC-32 of the metadata itself.
* ``data-r{rank}.bin``: the raw bytes written by writer ``rank``, shards packed back to back
  (each aligned to 64 bytes), no headers.

``ROOT/LATEST`` names the newest committed directory; it is replaced atomically.

Versioning: ``format`` must be ``"skiptrain-checkpoint"`` and ``version`` one this code knows
(:data:`SUPPORTED_VERSIONS`); anything else (a newer writer, another program's JSON, unknown
dtypes) is a :class:`CheckpointFormatError` naming the file and what was found.

This module imports only the standard library and numpy, so writer child processes start fast.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError

FORMAT_NAME = "skiptrain-checkpoint"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
METADATA_FILE = "metadata.json"
LATEST_FILE = "LATEST"
ALIGN = 64

STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")

# dtype name -> (itemsize, numpy dtype used to view the raw bytes).  bfloat16 has no numpy dtype:
# its bytes are handled as uint16 and re-typed by torch on load.
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "<f8"), "float32": (4, "<f4"), "float16": (2, "<f2"), "bfloat16": (2, "<u2"),
    "int64": (8, "<i8"), "int32": (4, "<i4"), "int16": (2, "<i2"), "int8": (1, "i1"),
    "uint8": (1, "u1"), "bool": (1, "?"),
}


class CheckpointError(UserError):
    """A checkpoint cannot be used; the message says which and what to do."""


class NonFiniteCheckpoint(CheckpointError):
    """A save whose tensors hold NaN or infinite values: it is not committed, LATEST stays."""


class CheckpointFormatError(CheckpointError):
    """The files are not a checkpoint this version of skiptrain understands."""


class CheckpointCorruptError(CheckpointError):
    """Data or metadata do not match their checksums, or a file is missing or truncated.

    ``path`` is the checkpoint directory, ``file`` and ``tensor`` locate the first problem found,
    ``previous`` is the newest *older* committed checkpoint (or None), which the message offers.
    """

    def __init__(self, message: str, path: str | Path, file: str | None = None,
                 tensor: str | None = None, previous: str | Path | None = None):
        self.path, self.file, self.tensor = str(path), file, tensor
        self.previous = None if previous is None else str(previous)
        self.detail = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = [f"checkpoint {self.path} is corrupt"]
        if self.file:
            where.append(f"file {self.file}")
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        msg = ": ".join([", ".join(where), self.detail])
        if self.previous:
            msg += f"; the previous committed checkpoint is {self.previous} (load that one instead)"
        else:
            msg += "; no older committed checkpoint exists"
        return msg

    def with_previous(self, previous: str | Path | None) -> "CheckpointCorruptError":
        return CheckpointCorruptError(self.detail, self.path, self.file, self.tensor, previous)


def checksum(buf) -> int:
    """CRC-32 of a bytes-like object (zlib; about 2 GB/s here and it releases the GIL)."""
    return zlib.crc32(buf) & 0xFFFFFFFF


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int) -> str:
    return f".tmp-{step_dir_name(step)}"


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_info(name: str, where: str = "") -> tuple[int, str]:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointFormatError(f"{where}unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


@dataclass
class ShardMeta:
    offsets: list[int]
    lengths: list[int]
    file: str
    byte_offset: int
    nbytes: int
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {"offsets": self.offsets, "lengths": self.lengths, "file": self.file,
                "byte_offset": self.byte_offset, "nbytes": self.nbytes, "crc32": self.crc32}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardMeta":
        return cls([int(x) for x in d["offsets"]], [int(x) for x in d["lengths"]], str(d["file"]),
                   int(d["byte_offset"]), int(d["nbytes"]), int(d["crc32"]))


@dataclass
class TensorMeta:
    dtype: str
    shape: list[int]
    shards: list[ShardMeta] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype][0]

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": self.shape, "shards": [s.to_json() for s in self.shards]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorMeta":
        return cls(str(d["dtype"]), [int(x) for x in d["shape"]], [ShardMeta.from_json(s) for s in d["shards"]])


@dataclass
class CheckpointMeta:
    """Everything in ``metadata.json``."""

    step: int
    tensors: dict[str, TensorMeta]
    state: dict[str, Any] = field(default_factory=dict)   # config, data, rng, placement, freeze, ...
    layout: dict[str, Any] = field(default_factory=dict)  # how it was written (stages, ranks)
    files: dict[str, int] = field(default_factory=dict)   # data file -> size in bytes

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def to_json(self) -> dict[str, Any]:
        body = self._body()
        body["checksum"] = _meta_crc(body)
        return body

    def _body(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": self.step,
                "files": self.files, "layout": self.layout, "state": self.state,
                "tensors": {n: t.to_json() for n, t in sorted(self.tensors.items())}}

    def encode(self) -> bytes:
        """``metadata.json``: the body in its checksummed form (one line, keys sorted), the
        checksum appended as its last key.  Encoded once, by json's C encoder: an indent would
        take the pure-Python one, several times slower (tens of milliseconds per save of a
        9-node job, on the committing node's GIL)."""
        text = _canonical(self._body())
        return (text[:-1] + f',"checksum":{checksum(text.encode())}}}\n').encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> "CheckpointMeta":
        """Parse and check ``metadata.json``; raises CheckpointFormatError / CheckpointCorruptError."""
        try:
            body = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointCorruptError(f"{METADATA_FILE} is not valid JSON ({e}); truncated or overwritten",
                                         where, METADATA_FILE) from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            found = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise CheckpointFormatError(f"{where}/{METADATA_FILE} is not a skiptrain checkpoint "
                                        f"(format {found!r}, expected {FORMAT_NAME!r})")
        version = body.get("version")
        if version not in SUPPORTED_VERSIONS:
            raise CheckpointFormatError(
                f"{where}/{METADATA_FILE} has format version {version!r}; this skiptrain reads "
                f"versions {', '.join(map(str, SUPPORTED_VERSIONS))}: upgrade skiptrain to load it")
        stored = body.pop("checksum", None)
        if stored != _meta_crc(body):
            raise CheckpointCorruptError(f"metadata checksum mismatch (stored {stored!r}, computed "
                                         f"{_meta_crc(body)})", where, METADATA_FILE)
        try:
            tensors = {str(n): TensorMeta.from_json(t) for n, t in body["tensors"].items()}
            for n, t in tensors.items():
                dtype_info(t.dtype, f"{where}/{METADATA_FILE}: tensor {n}: ")
            return cls(int(body["step"]), tensors, dict(body.get("state", {})),
                       dict(body.get("layout", {})), {str(k): int(v) for k, v in body.get("files", {}).items()})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{where}/{METADATA_FILE}: malformed entry ({e!r})") from None


def _canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _meta_crc(body: dict[str, Any]) -> int:
    return checksum(_canonical(body).encode())
