"""One wire format for training state by global name: a single ``bytes`` message.

The tensors are named as the checkpoint format names them (:mod:`skiptrain.checkpoint.state`):
parameters by global name, optimizer state as ``optim.{key}.{name}``, plus any other named
tensors the caller adds (a sync strategy's state), the optimizer record by parameter names, and
JSON (step, data cursor, RNG, layout, ...).  Because names are global, a node built for any
stage subset and partition loads exactly its part -- the same in-memory resharding a checkpoint
load does.  The frame: an 8-byte little-endian header length, the JSON header (per tensor:
name, dtype, shape, offset, bytes), then the raw tensor bytes; no pickle, dtypes exact.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterable, Mapping

import torch

from .reader import byte_view, dtype_name, torch_dtype
from .state import load_optimizer, model_tensors, optimizer_tensors, split_optim_name


def state_sizes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                frozen_names: Iterable[str] = ()) -> dict[str, int]:
    """Bytes of every tensor a replica needs: parameters, plus optimizer state of trainable ones."""
    frozen = set(frozen_names)
    sizes = {n: t.numel() * t.element_size() for n, t in model_tensors(model).items()}
    if optimizer is not None:
        opt, _ = optimizer_tensors(model.named_parameters(), optimizer)
        for n, t in opt.items():
            if split_optim_name(n)[1] not in frozen:
                sizes[n] = t.numel() * t.element_size()
    return sizes


def pack_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, names: Iterable[str] | None,
               state: Mapping[str, Any] | None = None, extra: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """One message: the named tensors (``None`` = all of the model's and optimizer's, plus
    ``extra``), the optimizer record and JSON ``state``."""
    tensors = model_tensors(model)
    record: dict[str, Any] = {}
    if optimizer is not None:
        opt, record = optimizer_tensors(model.named_parameters(), optimizer)
        tensors.update(opt)
    tensors.update(extra or {})
    wanted = sorted(tensors) if names is None else sorted(names)
    return pack_tensors({n: tensors[n] for n in wanted}, state, record)


def pack_tensors(tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any] | None = None,
                 record: Mapping[str, Any] | None = None) -> bytes:
    """One message of ``tensors`` by name (in name order), JSON ``state`` and an optimizer
    ``record``; read by :func:`unpack_tensors`."""
    metas, chunks, off = [], [], 0
    for n in sorted(tensors):
        t = tensors[n].detach().cpu().contiguous()     # the bytes of a device tensor, from the host
        b = bytes(byte_view(t))
        metas.append({"name": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": off,
                      "nbytes": len(b)})
        chunks.append(b)
        off += len(b)
    header = json.dumps({"tensors": metas, "optimizer": dict(record or {}), "state": dict(state or {})}).encode()
    return struct.pack("<Q", len(header)) + header + b"".join(chunks)


def unpack_tensors(blob: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors by name, optimizer record, JSON state) from :func:`pack_state`'s message."""
    (hlen,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8:8 + hlen])
    base = 8 + hlen
    out = {}
    for m in header["tensors"]:
        raw = bytearray(blob[base + m["offset"]: base + m["offset"] + m["nbytes"]])
        dt = torch_dtype(m["dtype"])
        t = torch.frombuffer(raw, dtype=dt) if raw else torch.empty(0, dtype=dt)
        out[m["name"]] = t.reshape(m["shape"]).clone()
    return out, header["optimizer"], header["state"]


def unpack_state(blob: bytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                 ) -> dict[str, Any]:
    """Load a :func:`pack_state` message into ``model`` (its tensors present in the message)
    and ``optimizer``; returns the JSON state."""
    tensors, record, state = unpack_tensors(blob)
    live = model_tensors(model)
    with torch.no_grad():
        for n, t in live.items():
            if n in tensors:
                t.copy_(tensors[n])
    if optimizer is not None:
        mine = {n for n, _ in model.named_parameters()}
        opt_t = {n: t for n, t in tensors.items() if (k := split_optim_name(n)) and k[1] in mine}
        load_optimizer(optimizer, model.named_parameters(), opt_t, record)
    return state
