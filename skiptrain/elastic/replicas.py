"""AutoDP: nodes freed by a shrink become replicas; state moves by the checkpoint format's names.

:func:`assign_nodes` maps the ``N`` nodes onto the new stages (``N // S`` replicas each, as
many as fit): each new stage takes the nodes that already hold the largest part of its
tensors, so most nodes keep most of their bytes.  :func:`transfer_plan` then lists, for every
node, the tensors it lacks and a peer that holds them (the least-loaded holder, so the sends
spread over the old replicas), with byte counts: the bill of a transition.

The state itself moves as the checkpoint format names it (:mod:`skiptrain.checkpoint.state`):
parameters by global name, AdamW state as ``optim.{key}.{name}``, the optimizer record by
parameter names, plus JSON (step, data cursor, RNG, freeze state, layout history).  Because
names are global, a node built for any stage subset and partition loads exactly its part --
the same in-memory resharding a checkpoint load does.  :func:`pack_state` frames that as one
``bytes`` message (8-byte header length, JSON header, raw tensor bytes) for a socket;
:func:`unpack_state` loads it into a model + optimizer.  Frozen layers travel without
optimizer state (they have none to update); the learning-rate schedule is a function of the
step, and the global batch is kept, so both stay continuous.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..checkpoint.plan import tensor_stage
from ..checkpoint.reader import byte_view, dtype_name, torch_dtype
from ..checkpoint.state import load_optimizer, model_tensors, optimizer_tensors, split_optim_name
from ..model.partition import Partition


def node_tensors(names: Iterable[str], partition: Partition, placement: Sequence[Sequence[int]]
                 ) -> dict[int, set[str]]:
    """node -> the tensor names it holds under ``partition`` and ``placement``."""
    of_stage: dict[int, set[str]] = {}
    for name in names:
        of_stage.setdefault(tensor_stage(name, partition), set()).add(name)
    out: dict[int, set[str]] = {n: set() for nodes in placement for n in nodes}
    for s, nodes in enumerate(placement):
        for node in nodes:
            out[node] |= of_stage.get(s, set())
    return out


def assign_nodes(sizes: Mapping[str, int], old_partition: Partition, old_placement: Sequence[Sequence[int]],
                 new_partition: Partition, n_nodes: int) -> list[list[int]]:
    """New placement: ``n_nodes // S`` nodes per new stage, maximising bytes already held.

    ``sizes``: tensor name -> bytes.  Greedy over (bytes held, node) pairs, largest first.
    """
    S = new_partition.n_stages
    per = n_nodes // S
    if per < 1:
        raise ValueError(f"{n_nodes} nodes cannot serve {S} stages")
    held = node_tensors(sizes, old_partition, old_placement)
    need: dict[int, set[str]] = {s: set() for s in range(S)}
    for n in sizes:
        need[tensor_stage(n, new_partition)].add(n)
    old_stage = {n: s for s, nodes in enumerate(old_placement) for n in nodes}
    held_bytes: dict[tuple[int | None, int], int] = {}   # the nodes of one old stage hold the same
    pairs = []
    for node in range(n_nodes):
        for s in range(S):
            key = (old_stage.get(node), s)
            if key not in held_bytes:
                held_bytes[key] = sum(sizes[t] for t in need[s] & held.get(node, set()))
            pairs.append((-held_bytes[key], node, s))
    pairs.sort()
    placement: list[list[int]] = [[] for _ in range(S)]
    used: set[int] = set()
    for _, node, s in pairs:
        if node in used or len(placement[s]) >= per:
            continue
        placement[s].append(node)
        used.add(node)
    return [sorted(p) for p in placement]


@dataclass
class Transfer:
    src: int
    dst: int
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


def transfer_plan(sizes: Mapping[str, int], old_partition: Partition, old_placement: Sequence[Sequence[int]],
                  new_partition: Partition, new_placement: Sequence[Sequence[int]]) -> list[Transfer]:
    """Messages that give every node of the new placement the tensors of its stage."""
    held = node_tensors(sizes, old_partition, old_placement)
    holders: dict[str, list[int]] = {}
    for node, names in held.items():
        for n in names:
            holders.setdefault(n, []).append(node)
    of_stage: dict[int, list[str]] = {}
    for name in sorted(sizes):
        of_stage.setdefault(tensor_stage(name, new_partition), []).append(name)
    sent: dict[int, int] = {}
    out: dict[tuple[int, int], Transfer] = {}
    for s, nodes in enumerate(new_placement):
        for dst in nodes:
            have = held.get(dst, set())
            for name in of_stage.get(s, []):
                if name in have:
                    continue
                srcs = holders.get(name)
                if not srcs:
                    raise ValueError(f"no node holds {name}")
                src = min(srcs, key=lambda n: (sent.get(n, 0), n))
                sent[src] = sent.get(src, 0) + sizes[name]
                tr = out.setdefault((src, dst), Transfer(src, dst))
                tr.names.append(name)
                tr.nbytes += sizes[name]
    return sorted(out.values(), key=lambda t: (t.src, t.dst))


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
               state: Mapping[str, Any] | None = None) -> bytes:
    """One message: the named tensors (``None`` = all), the optimizer record and JSON ``state``."""
    tensors = model_tensors(model)
    record: dict[str, Any] = {}
    if optimizer is not None:
        opt, record = optimizer_tensors(model.named_parameters(), optimizer)
        tensors.update(opt)
    wanted = sorted(tensors) if names is None else sorted(names)
    metas, chunks, off = [], [], 0
    for n in wanted:
        t = tensors[n].detach().contiguous()
        b = bytes(byte_view(t))
        metas.append({"name": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": off,
                      "nbytes": len(b)})
        chunks.append(b)
        off += len(b)
    header = json.dumps({"tensors": metas, "optimizer": record, "state": dict(state or {})}).encode()
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
