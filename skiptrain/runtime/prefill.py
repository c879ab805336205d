"""A freeze's prefill across the swarm: every activation cache brought to the new depth for the
windows its originators will start, each window computed once, on a cache that holds it
deepest, and its row sent to the other caches that need it
(:func:`skiptrain.elastic.prefill.plan_prefill`).

Every node takes part: the caches' depths are gathered from every node, then the rows move point
to point in the one wire format (:func:`skiptrain.checkpoint.wire.pack_tensors`).  The compute
is forward only, padded to the cost model like any task; a received row counts as arrived no
earlier than its sender's compute plus the message's modelled wire time.  Rows travel only
with a topology and a cost model to price them (a row is sent when its wire time is below the
layers the receiver would run); without them each cache brings up its own windows.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ..checkpoint.wire import pack_tensors, unpack_tensors
from ..elastic.prefill import PrefillPlan, plan_prefill
from .transition import exchange

ROW_MESSAGE_BYTES = 64 * 2**20      # rows per message up to this size; more go in further rounds


class PrefillError(RuntimeError):
    """A peer's prefill rows do not fit this cache (another depth, prefix or shape)."""


def cache_groups(fr) -> dict[str, list[int]]:
    """Cache key (``SwarmFreezing.cache_of``) -> the originators in force that write it."""
    groups: dict[str, list[int]] = {}
    for r in sorted({mb.originator for mb in fr.st.sched.micro_batches}):
        groups.setdefault(fr.cache_of(r), []).append(r)
    return groups


def prefill_plan(fr) -> PrefillPlan:
    """Every node's same plan for the layout in force: the windows each cache's originators
    start until the end of the phase (``SwarmFreezing.share``), the depths the caches hold them
    at (reported by each cache's first originator, gathered from every node: a collective) and
    a row's wire time between caches in layer forwards (first originator to first originator)."""
    st, node = fr.st, fr.node
    workers = cache_groups(fr)
    needs = {k: list(dict.fromkeys(w for r in rs for w in fr.share(r))) for k, rs in workers.items()}
    mine: dict[str, dict[int, int]] = {}
    k = fr.cache_of(node.rank)
    if fr.cache is not None and workers.get(k, [None])[0] == node.rank:
        union = sorted({w for ws in needs.values() for w in ws})
        mine[k] = {w: f[1] for w, f in zip(union, fr.cache.lookup(union)) if f is not None}
    depth: dict[str, dict[int, int]] = {}
    for _, blob in node.control.gather_bytes(json.dumps(mine).encode()):
        depth.update({c: {int(w): int(d) for w, d in v.items()} for c, v in json.loads(blob.decode()).items()})
    topo, cost = st.topo, fr.base_cost
    priced = cost is not None and topo is not None and all(r < topo.n for rs in workers.values() for r in rs)
    m = fr.cfg.model
    row_bytes = m.seq_len * m.d_model * 4

    def row_cost(a: str, b: str) -> float:
        if not priced:
            return math.inf
        return topo.transfer_s(workers[a][0], workers[b][0], row_bytes) / cost.s_per_sample_per_layer

    return plan_prefill(needs, depth, workers, fr.frozen, row_cost)


def run_prefill(fr, plan: PrefillPlan, t0: float) -> dict[str, int]:
    """This node's part of ``plan`` (every node calls it): bring its windows to the depth in
    its cache (padded to the cost model from ``t0``), send the rows its peers receive from it,
    write those it receives.  Returns ``rows`` and ``layer_rows`` computed, ``received`` rows."""
    st, node, me = fr.st, fr.node, fr.node.rank
    out = {"rows": 0, "layer_rows": 0, "received": 0}
    if fr.runner is not None and plan.work.get(me):
        t = fr.cfg.train
        rec = fr.runner.prefill(lambda ws: node.src.window_batch(ws)[0], t.micro_batch * len(st.order),
                                plan.work[me])
        out["rows"], out["layer_rows"] = rec["rows"], rec["layer_rows"]
    if plan.layers.get(me, 0) > 0:
        st.emulation.pad(t0, _compute_s(fr, plan, me))
    m = fr.cfg.model
    per = max(1, ROW_MESSAGE_BYTES // (m.seq_len * m.d_model * 4))
    rounds = max((math.ceil(len(ws) / per) for ws in plan.sends.values()), default=0)
    arrive = 0.0
    for i in range(rounds):
        outgoing = {d: _pack_rows(fr, ws[i * per:(i + 1) * per]) for d, ws in plan.sent(me).items()
                    if len(ws) > i * per}
        incoming = sorted(s for s, ws in plan.received(me).items() if len(ws) > i * per)
        got = exchange(outgoing, incoming, node.control.rank_of, node.control.check_generation)
        for src, blob in got.items():
            out["received"] += _write_rows(fr, src, blob)
            if st.topo is not None and fr.base_cost is not None and src < st.topo.n and me < st.topo.n:
                arrive = max(arrive, _compute_s(fr, plan, src) + st.topo.transfer_s(src, me, len(blob)))
    if arrive > 0:
        st.emulation.pad(t0, arrive)
    return out


def _compute_s(fr, plan: PrefillPlan, rank: int) -> float:
    """The modelled seconds of ``rank``'s prefill compute (0 without a cost model)."""
    cost, topo = fr.base_cost, fr.st.topo
    if cost is None:
        return 0.0
    speed = topo.speed(rank) if topo is not None and rank < topo.n else 1.0
    return plan.layers.get(rank, 0) * cost.s_per_sample_per_layer / speed


def _pack_rows(fr, windows: list[int]) -> bytes:
    """One message of this node's cache rows for ``windows`` (each at the frozen depth)."""
    found = fr.cache.lookup(windows)
    bad = [w for w, f in zip(windows, found) if f is None or f[1] != fr.frozen]
    if bad:
        raise PrefillError(f"node {fr.node.rank}: window {bad[0]} is not in its cache at depth {fr.frozen} "
                           "though the prefill plan says it sends it")
    rows = fr.cache.read([f[0] for f in found])
    return pack_tensors({"rows": rows, "windows": torch.tensor(windows, dtype=torch.int64)},
                        {"depth": fr.frozen, "fingerprint": fr.runner.fps[fr.frozen]})


def _write_rows(fr, src: int, blob: bytes) -> int:
    """Write a peer's rows into this node's cache; returns how many."""
    try:
        tensors, _, state = unpack_tensors(blob)
        rows, windows = tensors["rows"], tensors["windows"].tolist()
    except Exception as e:  # noqa: BLE001 - any malformed message is the same error
        raise PrefillError(f"node {fr.node.rank}: node {src} sent prefill rows that do not parse ({e})") from e
    want: dict[str, Any] = {"depth": fr.frozen, "fingerprint": fr.runner.fps[fr.frozen]}
    shape = (len(windows), *fr.cache.shape)
    if {k: state.get(k) for k in want} != want or tuple(rows.shape) != shape or rows.dtype != torch.float32:
        raise PrefillError(f"node {fr.node.rank}: node {src} sent prefill rows for another prefix "
                           f"({ {k: state.get(k) for k in want} }, rows {tuple(rows.shape)}; expected {want}, {shape})")
    for w, row in zip(windows, rows):
        fr.cache.write(int(w), fr.frozen, want["fingerprint"], row)
    return len(windows)
