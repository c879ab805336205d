"""Freeze transitions across node processes: the new layout, its schedule and cost model, and the
training state moved between the nodes by name.

A transition turns the layout in force (partition, placement, frozen depth) into the one the
freeze rule's new depth asks for, on the nodes alive now:

* :func:`skiptrain.elastic.freezer.plan_layout` (AutoPipe, then AutoDP) plans it;
* :func:`layout_schedule`: the micro-batches of the iteration (same ids, so the same samples)
  over the new placement: dealt over the stage-0 nodes, routes through the new body stages
  (:func:`skiptrain.elastic.freezer.layout_routes`); the caller may let
  the planner re-plan the routes; :func:`layout_cost`: the cost model of the new layout (a
  frozen layer costs its forward only, nothing when served from the cache);
* :func:`move_state`: every message of :func:`skiptrain.layout.transfer.transfer_plan` between
  node processes, point to point, in the one wire format
  (:func:`skiptrain.checkpoint.wire.pack_state`): parameters, optimizer state and sync-strategy
  state by global name;
* :func:`build_stage`: the node's stage under the new partition from the tensors it held and
  received (frozen parameters stop requiring gradients; their optimizer state is kept).
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checkpoint.state import load_optimizer, model_tensors, split_optim_name
from ..checkpoint.wire import pack_state, unpack_tensors
from ..elastic.freezer import layout_routes
from ..layout import is_frozen, tensor_stage
from ..layout.transfer import Transfer
from ..model.partition import Partition
from ..schedule.cost import layer_params
from ..schedule.schedule import MicroBatch, Schedule
from .job_checkpoint import stage_state, sync_tensors

LEN_TAG, BLOB_TAG = 11, 12


def deal_originators(stage0: list[int], ids: list[int], keep: dict[int, int] | None = None) -> dict[int, int]:
    """Micro-batch ``ids`` (sorted) over the stage-0 nodes, as evenly as they divide: without
    ``keep``, round-robin; with ``keep`` (micro-batch -> its originator before a layout change),
    each stage-0 node first keeps up to ``len(ids) // len(stage0)`` of its micro-batches (their
    samples are the windows its activation cache holds), then the rest go to the least-loaded
    node (ties: its previous originator, then placement order)."""
    keep = keep or {}
    count = {n: 0 for n in stage0}
    out: dict[int, int] = {}
    for i in ids:
        o = keep.get(i)
        if o in count and count[o] < len(ids) // len(stage0):
            out[i] = o
            count[o] += 1
    for i in ids:
        if i not in out:
            o = min(stage0, key=lambda n: (count[n], n != keep.get(i), stage0.index(n)))
            out[i] = o
            count[o] += 1
    return out


def layout_schedule(placement: list[list[int]], ids: list[int], skip_ratio: float, max_swaps: int, memory: int,
                    seed: int, keep: dict[int, int] | None = None) -> Schedule:
    """One iteration over ``placement``: micro-batch ``ids`` (sorted) dealt over the stage-0 nodes
    (:func:`deal_originators`, keeping ``keep``'s originators where it can), each on a route
    through the body stages (full routes with fewer than three stages or no skipping, else
    balanced skip routes drawn from ``seed``), each hop on the least-loaded replica of its stage
    not yet on the route (ties: lowest id), the hops assigned round by round of the originators'
    injections (every originator's first micro-batch, then every second, ...), so each replica
    gets early and late arrivals alike.  The micro-batches stay in id order (the injection order)."""
    S, ids = len(placement), sorted(ids)
    routes = layout_routes(S, skip_ratio, len(ids), random.Random(seed), max_swaps)
    load = {n: 0 for p in placement for n in p}
    origin = deal_originators(list(placement[0]), ids, keep)
    rank, seen = {}, dict.fromkeys(placement[0], 0)   # injection round: the originator's k-th micro-batch
    for i in ids:
        rank[i], seen[origin[i]] = seen[origin[i]], seen[origin[i]] + 1
    route_of = dict(zip(ids, routes))
    hops_of: dict[int, list[tuple[int, int]]] = {}
    for i in sorted(ids, key=lambda i: (rank[i], i)):   # round by round, so a replica gets early and late ones
        o = origin[i]
        load[o] += 1
        hops, used = [], {o}
        for s in route_of[i]:
            cands = [n for n in placement[s] if n not in used] or list(placement[s])
            n = min(cands, key=lambda x: (load[x], x))
            load[n] += 1
            used.add(n)
            hops.append((s, n))
        hops_of[i] = hops
    mbs = [MicroBatch(i, origin[i], hops_of[i], 0.0) for i in ids]
    per_orig = math.ceil(len(ids) / len(placement[0]))
    return Schedule(placement=[list(p) for p in placement], micro_batches=mbs,
                    memory=max(1, min(memory, per_orig) if S == 1 else memory),
                    skip_ratio=skip_ratio if S > 2 else 0.0, max_swaps=max_swaps, method="elastic",
                    meta={"elastic": True})


def reseat(placement: list[list[int]], nodes: list[int]) -> list[list[int]]:
    """The layout ``placement`` on the nodes ``nodes`` (a job resumed on other nodes than those
    that saved it): a saved node that is here keeps its place; the place of one that is gone goes
    to the lowest node not placed yet; nodes left over become replicas of the stage with the
    fewest (ties: the lowest stage).  A stage left without a node is an error."""
    here = set(nodes)
    spare = sorted(here - {n for p in placement for n in p})
    out = []
    for p in placement:
        out.append([n if n in here else spare.pop(0) for n in p if n in here or spare])
    if any(not p for p in out):
        raise ValueError(f"the layout {placement} has a stage none of the nodes {sorted(nodes)} can hold")
    for n in spare:
        min(out, key=len).append(n)
    return [sorted(p) for p in out]


def layout_cost(cost, model_cfg, counts: list[int], frozen: int, hit: float = 0.0):
    """``cost`` for the layout ``counts`` with ``frozen`` frozen layers: a stage's compute in
    active-layer units (a frozen layer's forward only, scaled by the cache's miss fraction), its
    parameters those that still train (the embedding freezes with the first layer)."""
    if cost is None:
        return None
    per_layer = layer_params(model_cfg.d_model, model_cfg.hidden, model_cfg.kv_heads * model_cfg.head_dim)
    eff, params, start = [], [], 0
    for s, c in enumerate(counts):
        nf = max(0, min(c, frozen - start))
        eff.append((c - nf) + nf * (1.0 - hit) / (1.0 + cost.backward_factor))
        p = (c - nf) * per_layer
        if s == 0:
            p += model_cfg.vocab_size * model_cfg.d_model * (1 if frozen else 2) + model_cfg.d_model
        params.append(p)
        start += c
    return dataclasses.replace(cost, layers_per_stage=eff, params_per_stage=params)


def stage_sizes(model, opt, strat) -> dict[str, int]:
    """Bytes of every tensor this node holds by global name (weights, optimizer, sync state);
    ``strat``: its sync strategy, or the list of them of a node serving several stages."""
    if model is None:
        return {}
    tensors, _ = stage_state(model, opt, strat, 0)
    return {n: t.numel() * t.element_size() for n, t in tensors.items()}


def wait_all(works: list, abort: Callable[[], None]) -> None:
    """Wait for point-to-point ``works``; ``abort()`` raises when the node must give up (a new
    membership generation).  gloo's send and recv works complete only inside ``wait``, and a
    send to a dead peer can block there until the group's timeout, so the waits run in a
    helper thread, abandoned (as the old groups are) when ``abort`` raises."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)

    t = threading.Thread(target=run, name="skiptrain-p2p-wait", daemon=True)
    t.start()
    while t.is_alive():
        abort()
        t.join(0.002)
    if errors:
        raise errors[0]


@dataclasses.dataclass
class Activations:
    """Activations handed between node processes outside the pipeline's transport (validation
    passes): to and from node ids, mapped to process-group ranks by ``rank_of``, on ``tag``,
    waited on as :func:`wait_all` waits (``abort`` raises when the node must give up)."""
    rank_of: dict[int, int]
    tag: int
    abort: Callable[[], None]

    def send(self, h: torch.Tensor, dst: int) -> None:
        wait_all([dist.isend(h.contiguous(), self.rank_of[dst], tag=self.tag)], self.abort)

    def recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        h = torch.empty(shape)
        wait_all([dist.irecv(h, self.rank_of[src], tag=self.tag)], self.abort)
        return h


def move_state(me: int, plan: list[Transfer], rank_of: dict[int, int], model, opt, strat,
               abort: Callable[[], None]) -> list[bytes]:
    """Send this node's messages of ``plan`` and receive its own (:func:`exchange`); returns the
    received messages (:func:`pack_state` frames).  ``strat`` as :func:`stage_sizes` takes it."""
    sends = [t for t in plan if t.src == me]
    blobs = {}
    if sends:
        extra, scalars = sync_tensors(strat)
        for t in sends:
            blobs[t.dst] = pack_state(model, opt, t.names, {"strategy": scalars}, extra)
    got = exchange(blobs, [t.src for t in plan if t.dst == me], rank_of, abort)
    return [got[t.src] for t in plan if t.dst == me]


def exchange(outgoing: dict[int, bytes], incoming: list[int], rank_of: dict[int, int],
             abort: Callable[[], None]) -> dict[int, bytes]:
    """Point to point among the nodes that take part: send ``outgoing[node]`` to each node and
    receive one message from each of ``incoming`` (node ids; ``rank_of``: node -> process-group
    rank), in two rounds (lengths, then the messages).  Every message must be matched by the
    peer's call; ``abort()`` raises when the node must give up (:func:`wait_all`)."""
    lens = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    works = [dist.isend(torch.tensor([len(b)], dtype=torch.int64), rank_of[dst], tag=LEN_TAG)
             for dst, b in outgoing.items()]
    works += [dist.irecv(lens[src], rank_of[src], tag=LEN_TAG) for src in incoming]
    wait_all(works, abort)
    bufs = {src: torch.empty(int(lens[src][0]), dtype=torch.uint8) for src in incoming}
    works = [dist.isend(torch.frombuffer(bytearray(b), dtype=torch.uint8), rank_of[dst], tag=BLOB_TAG)
             for dst, b in outgoing.items()]
    works += [dist.irecv(bufs[src], rank_of[src], tag=BLOB_TAG) for src in incoming]
    wait_all(works, abort)
    return {src: bufs[src].numpy().tobytes() for src in incoming}


def gather_state(model, opt, strat, blobs: list[bytes], wanted: set[str]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any] | None]:
    """The tensors named ``wanted`` from this node's own stage and the received messages, the
    optimizer record merged by parameter name, and the sync strategy's scalars (``strat`` as
    :func:`stage_sizes` takes it)."""
    tensors: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {"param_groups": [], "scalars": {}}
    scalars = None
    if model is not None:
        own, js = stage_state(model, opt, strat, 0)
        tensors.update({n: t.detach().clone() for n, t in own.items() if n in wanted})
        _merge_record(record, js["optimizer"])
        scalars = js["strategy"] or None
    for blob in blobs:
        got, rec, st = unpack_tensors(blob)
        tensors.update({n: t for n, t in got.items() if n in wanted})
        _merge_record(record, rec)
        scalars = scalars or st.get("strategy")
    return tensors, record, scalars


def _merge_record(into: dict[str, Any], rec: dict[str, Any] | None) -> None:
    if not rec:
        return
    into.setdefault("class", rec.get("class"))
    into["param_groups"] += rec.get("param_groups", [])
    into["scalars"].update(rec.get("scalars", {}))


def stage_names(sizes: dict[str, int], partition: Partition, stage: int | None) -> set[str]:
    """The global names a node of ``stage`` holds under ``partition``."""
    if stage is None:
        return set()
    return {n for n in sizes if tensor_stage(n, partition) == stage}


def build_stage(cfg, stage: int, partition: Partition, frozen: int, tensors: dict[str, torch.Tensor],
                record: dict[str, Any], rule: str, warm_up: Callable | None = None):
    """(model, optimizer) of ``stage`` under ``partition`` loaded from ``tensors`` by name; the
    optimizer covers every parameter (frozen ones keep their state for an undo) and frozen
    parameters then stop requiring gradients."""
    from ..model.transformer import StagedLM
    from ..optim import build_optimizer

    torch.manual_seed(cfg.train.seed)
    model = StagedLM(cfg.model, stages=[stage], partition=partition, seed=cfg.train.seed)
    model.train()
    with torch.no_grad():
        for n, t in model_tensors(model).items():
            if n not in tensors:
                raise ValueError(f"stage {stage} of partition {partition.to_list()}: no node sent {n}")
            t.copy_(tensors[n])
    if warm_up is not None:
        warm_up(model, stage, cfg)
    opt = build_optimizer(model.named_parameters(), cfg.train, rule)
    params = {n for n, _ in model.named_parameters()}
    load_optimizer(opt, model.named_parameters(),
                   {n: t for n, t in tensors.items() if (k := split_optim_name(n)) and k[1] in params}, record)
    freeze_parameters(model, frozen)
    return model, opt


def freeze_parameters(model, frozen: int) -> None:
    """Parameters frozen at depth ``frozen`` stop requiring gradients; the others require them."""
    for n, p in model.named_parameters():
        p.requires_grad_(not is_frozen(n, frozen))


def sync_state(tensors: dict[str, torch.Tensor], strat, frozen_before: int) -> dict[str, torch.Tensor]:
    """The ``sync.<key>.<param>`` tensors among ``tensors`` for ``strat``'s parameters.  A
    parameter that was frozen at depth ``frozen_before`` (trainable again after an undone freeze)
    had no sync state while frozen: it keeps ``strat``'s fresh one (as at launch, the same on
    every replica)."""
    own = {n for n, _ in strat.named}
    fresh, _ = sync_tensors(strat)
    out = {n: t for n, t in fresh.items() if is_frozen(n.split(".", 2)[2], frozen_before)}
    out.update({n: t for n, t in tensors.items() if n.startswith("sync.") and n.split(".", 2)[2] in own})
    return out
