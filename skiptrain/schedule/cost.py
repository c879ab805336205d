"""Cost model: seconds of compute per task and bytes per message, from plain numbers.

Semantics (the simulator, the planner and the benches all use these and only these):

* A micro-batch is ``samples`` samples of ``tokens_per_sample`` tokens.  One hop (activations
  forward, or their gradients backward) carries ``activation_bytes = samples * tokens_per_sample *
  d_model * dtype_bytes`` bytes.
* The forward of stage ``s`` on a node of relative speed ``v`` takes
  ``s_per_sample_per_layer * layers(s) * samples / v`` seconds.  Backward takes
  ``backward_factor`` (1.5) times the forward; the loss (final norm, head, loss, start of the
  backward) on the originator takes ``loss_factor`` (0.25) times stage 0's forward there.
* Per-task overhead: every forward task and the loss pay ``fwd_task_s`` and every backward task
  ``bwd_task_s`` on top of that compute (the start of a task, its header message, the executor's
  dispatch; SkipPipe's simulator charges 0.13 s / 0.09 s, :data:`SKIPPIPE_TASK_S`); it does not
  scale with the node's speed.  :data:`~skiptrain.config.RUNTIME_TASK_S` is what
  ``bench/runtime_geo.py`` fits from the runtime's timelines on this machine (real seconds: 4.4
  ms / 0 ms, resolved only to a few milliseconds); :data:`DEFAULT_TASK_S` is the same scaled the
  way that bench scales compute (x 16: its compute runs at 1/16 of SkipPipe's), the default of
  ``skiptrain simulate``.  The dataclass default is 0 (the cost model from plain numbers).
* A hop from ``a`` to ``b`` costs ``latency + bytes / bandwidth + hop_overhead_s``; the fixed
  overhead (host/device copies, serialisation: 0.35 s in SkipPipe's setup) is paid per message.
  Only ``bytes / bandwidth`` occupies the link (that is what queues under contention).
* Activation compression: on links slower than ``act_fast_GBps`` the hop carries
  ``act_codec`` (``"int8"`` or ``"int4"`` with one fp32 scale per row of ``d_model`` values,
  :mod:`skiptrain.schedule.actcodec`) instead of fp32, forward and backward alike, and pays
  ``act_codec_s`` per message for encoding and decoding (bf16: no scale, no encode time); faster
  links carry ``act_plain``, the compute precision's plain encoding (fp32, or bf16 under
  ``train.precision=bf16``: half the bytes) (:meth:`CostModel.hop_bytes`, :meth:`CostModel.hop_codec`).
* Data-parallel sync of stage ``s`` after the last backward: ``dp_mode="dense"`` is a ring
  all-reduce of ``params(s) * grad_dtype_bytes`` bytes over the stage's replicas
  (``2 (n-1)`` steps of ``bytes / n`` per ring link); ``"compressed"`` is a ring all-gather of a
  ``compressed_payload_bytes`` payload per replica (``n - 1`` steps, e.g. DeMo); ``"none"``
  skips it.  Sync messages pay latency + bytes / bandwidth, no per-hop overhead.
* The dense sync's shape, ``dp_topology`` (:meth:`CostModel.sync_phases`): ``"flat"`` is the one
  ring over all replicas; ``"hierarchical"`` groups the replicas by the topology's regions
  (:meth:`~skiptrain.net.topology.Topology.region_of`: its latency clusters, one geo12 location
  each) and runs three phases, each starting when the previous one ended: (1) every region
  sums its replicas' gradients over its own ring; (2) the gradient is cut into ``k`` shards, ``k``
  the smallest region's replica count, and shard ``j`` is all-reduced over one ring across regions
  made of every region's ``j``-th replica (``k`` rings at once, on distinct links); (3) every region
  spreads the total over its ring again.  A region of ``m`` replicas does (1) as a reduce-scatter
  that leaves shard ``j``'s region sum on its ``j``-th replica and (3) as the mirror all-gather
  (``m - 1`` steps of ``bytes / k`` each) while ``m <= 2k``; a region with more replicas than that
  does both as all-reduces (``2 (m-1)`` steps of ``bytes / m``; in (3) every member contributes the
  shard it summed across regions, zeros elsewhere), which is then the cheaper
  (:mod:`skiptrain.schedule.sync_rings`: the rings and their chains of messages).  Every ring step
  lasts as long as the ring's slowest link, a phase as long as its slowest ring, the sync the sum
  of its phases.  ``"auto"`` (the default) takes, per stage, whichever of the two is faster on the
  uncontended links (ties: flat).  The slow phase is ``2 (R-1)`` steps of ``bytes / (k R)`` across
  ``R`` regions, against the flat ring's ``2 (n-1)`` steps of ``bytes / n`` on its slowest
  (inter-region) link.  The runtime runs the same three phases
  (:class:`skiptrain.dp.link.HierarchicalLinks`, :meth:`skiptrain.dp.transport.Transport.all_reduce_sum`).

:func:`reference_cost` is SkipPipe's 20-node setup as its reference description states it
(hop = latency + 32 MiB / bw + 0.35 s, forward 1.76 s per stage: 8 samples of 1024 tokens);
:func:`published_cost` is the setting behind SkipPipe's published schedule and times (same
32 MiB hops, forward 0.44 s per stage: 2 samples of 4096 tokens, 4x less compute per hop);
:func:`from_model_config` derives layers and parameters from
:class:`skiptrain.config.ModelConfig`; :func:`profile_s_per_sample_per_layer` measures the
per-layer cost on this machine.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..config import MAX_TASK_S, RUNTIME_TASK_S
from ..errors import UserError
from ..net.topology import Topology
from .actcodec import CODECS, PLAIN, encoded_bytes, quantizes, slow_link_codec
from .sync_rings import SyncRing, scatter_pays

DP_MODES = ("dense", "compressed", "none")
#: shapes of the dense sync (:meth:`CostModel.sync_phases`)
DP_TOPOLOGIES = ("flat", "hierarchical", "auto")
#: per-task overhead (forward incl. loss, backward) of SkipPipe's own simulator, seconds
SKIPPIPE_TASK_S = (0.13, 0.09)
#: the compute scale of that bench (its compute runs at this fraction of SkipPipe's seconds)
RUNTIME_GEO_TIME_SCALE = 1 / 16
#: :data:`RUNTIME_TASK_S` in SkipPipe's units (scaled as that bench scales compute)
DEFAULT_TASK_S = (RUNTIME_TASK_S[0] / RUNTIME_GEO_TIME_SCALE, RUNTIME_TASK_S[1] / RUNTIME_GEO_TIME_SCALE)
#: a link whose hop takes more than this many times the median hop is unusable for routes
USABLE_HOP_FACTOR = 10.0


class CostError(UserError, ValueError):
    """An impossible cost-model setting."""



def layer_params(d_model: int, ffn_hidden: int, kv_dim: int | None = None) -> int:
    """Parameters of one LLaMA-style layer: attention (q, k, v, o), SwiGLU MLP, two norms."""
    kv = d_model if kv_dim is None else kv_dim
    return 2 * d_model * d_model + 2 * d_model * kv + 3 * d_model * ffn_hidden + 2 * d_model


@dataclass
class CostModel:
    """Per-task seconds and per-message bytes; see the module docstring for the exact formulas."""
    d_model: int = 1024
    tokens_per_sample: int = 1024
    samples: int = 8
    dtype_bytes: int = 4
    layers_per_stage: list[int] = field(default_factory=lambda: [4] * 6)
    s_per_sample_per_layer: float = 0.055
    backward_factor: float = 1.5
    loss_factor: float = 0.25
    hop_overhead_s: float = 0.35
    params_per_stage: list[int] = field(default_factory=list)
    grad_dtype_bytes: int = 4
    dp_mode: str = "dense"
    compressed_payload_bytes: int = 0
    act_codec: str = "fp32"         # encoding of activations/gradients on slow links
    act_fast_GBps: float = 1.0      # links at least this fast (GB = 2^30 B/s) always carry act_plain
    act_codec_s: float = 0.0        # encode + decode seconds per quantised message
    act_plain: str = "fp32"         # encoding of the other links (the compute precision's: fp32 or bf16)
    byte_scale: float = 1.0         # emulated bytes per encoded byte (the runtime's bytes_scale)
    fwd_task_s: float = 0.0         # fixed seconds per forward task and per loss (not scaled by speed)
    bwd_task_s: float = 0.0         # fixed seconds per backward task
    dp_topology: str = "auto"       # dense sync: one ring ("flat"), regions then shards across them ("hierarchical"), the faster

    def __post_init__(self) -> None:
        if self.dp_mode not in DP_MODES:
            raise CostError(f"dp_mode {self.dp_mode!r} is not one of {DP_MODES}")
        if self.dp_topology not in DP_TOPOLOGIES:
            raise CostError(f"dp_topology {self.dp_topology!r} is not one of {DP_TOPOLOGIES}")
        if self.act_codec not in CODECS:
            raise CostError(f"act_codec {self.act_codec!r} is not one of {CODECS}")
        if self.act_plain not in PLAIN:
            raise CostError(f"act_plain {self.act_plain!r} is not one of {tuple(PLAIN)}")
        if not self.act_fast_GBps >= 0:
            raise CostError(f"cost model act_fast_GBps={self.act_fast_GBps} must be >= 0")
        self._hop_tables: dict[tuple, tuple[Topology, list[list[int]], list[list[float]]]] = {}
        for name in ("d_model", "tokens_per_sample", "samples", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise CostError(f"cost model {name} must be >= 1")
        if any(x < 0 for x in self.layers_per_stage) or not self.layers_per_stage:
            raise CostError("layers_per_stage must list >= 0 layers for every stage")
        for name in ("s_per_sample_per_layer", "hop_overhead_s", "act_codec_s", "fwd_task_s", "bwd_task_s"):
            if not 0 <= getattr(self, name) <= MAX_TASK_S:  # (< 0, nan, inf, or so large that sums overflow)
                raise CostError(f"cost model {name}={getattr(self, name)} is not a number of seconds in "
                                f"[0, {MAX_TASK_S:g}]; give a measured time (e.g. 0.055)")
        self.layers_per_stage = list(self.layers_per_stage)
        self.params_per_stage = list(self.params_per_stage)
        if self.params_per_stage and len(self.params_per_stage) != len(self.layers_per_stage):
            raise CostError("params_per_stage must have one entry per stage")

    @property
    def n_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def activation_bytes(self) -> int:
        return self.samples * self.tokens_per_sample * self.d_model * self.dtype_bytes

    def fwd_compute_s(self, stage: int, speed: float = 1.0) -> float:
        """Compute seconds of one forward of ``stage`` at ``speed`` (no per-task overhead)."""
        return self.s_per_sample_per_layer * self.layers_per_stage[stage] * self.samples / speed

    def bwd_compute_s(self, stage: int, speed: float = 1.0) -> float:
        return self.backward_factor * self.fwd_compute_s(stage, speed)

    def loss_compute_s(self, speed: float = 1.0) -> float:
        return self.loss_factor * self.fwd_compute_s(0, speed)

    def fwd_s(self, stage: int, speed: float = 1.0) -> float:
        """Seconds of one forward task: compute plus ``fwd_task_s``."""
        return self.fwd_compute_s(stage, speed) + self.fwd_task_s

    def bwd_s(self, stage: int, speed: float = 1.0) -> float:
        """Seconds of one backward task: ``backward_factor`` x the forward's compute plus ``bwd_task_s``."""
        return self.bwd_compute_s(stage, speed) + self.bwd_task_s

    def loss_s(self, speed: float = 1.0) -> float:
        """Seconds of the loss task on the originator: compute plus ``fwd_task_s``."""
        return self.loss_compute_s(speed) + self.fwd_task_s

    def with_task_s(self, fwd: float, bwd: float) -> "CostModel":
        """A copy with per-task overheads ``fwd`` / ``bwd`` seconds."""
        return CostModel.from_dict({**self.to_dict(), "fwd_task_s": fwd, "bwd_task_s": bwd})

    def hop_codec(self, topo: Topology, a: int, b: int) -> str:
        """Encoding of messages ``a -> b``: ``act_codec`` on links slower than ``act_fast_GBps``,
        ``act_plain`` (fp32, or bf16 under bf16 compute) on the others, and everywhere when
        ``act_codec`` is fp32 (never wider than the compute precision's own encoding)."""
        if topo.bandwidth_Bps[a][b] >= self.act_fast_GBps * 2 ** 30:
            return self.act_plain
        return slow_link_codec(self.act_codec, self.act_plain)

    def hop_bytes(self, topo: Topology, a: int, b: int) -> int:
        """Bytes of one activation (or gradient) message ``a -> b`` as encoded on that link
        (:func:`skiptrain.schedule.actcodec.encoded_bytes`; fp32 is ``activation_bytes``)."""
        codec = self.hop_codec(topo, a, b)
        if codec == "fp32":
            return self.activation_bytes
        return int(encoded_bytes(codec, self.samples * self.tokens_per_sample, self.d_model) * self.byte_scale)

    def hop_s(self, topo: Topology, a: int, b: int) -> float:
        """Uncontended time of one activation (or gradient) message ``a -> b``: latency, the
        encoded bytes over the bandwidth, the per-message overhead and, when compressed,
        ``act_codec_s``."""
        extra = self.act_codec_s if quantizes(self.hop_codec(topo, a, b)) else 0.0
        return topo.transfer_s(a, b, self.hop_bytes(topo, a, b)) + self.hop_overhead_s + extra

    def hop_seconds(self, topo: Topology) -> list[list[float]]:
        """:meth:`hop_s` of every directed link ``[a][b]``; 0 from a node to itself (two stages of
        one node: no link)."""
        return [[self.hop_s(topo, a, b) if a != b else 0.0 for b in range(topo.n)] for a in range(topo.n)]

    def hop_table(self, topo: Topology) -> tuple[list[list[int]], list[list[float]]]:
        """Per directed link: (message bytes, fixed seconds = overhead + codec time), cached per
        topology object and hop settings (the simulator reads it on every call)."""
        key = (id(topo), self.activation_bytes, self.samples * self.tokens_per_sample, self.d_model,
               self.act_codec, self.act_fast_GBps, self.act_codec_s, self.hop_overhead_s, self.act_plain)
        hit = self._hop_tables.get(key)
        if hit is not None and hit[0] is topo:
            return hit[1], hit[2]
        n = topo.n
        nbytes = [[self.hop_bytes(topo, a, b) if a != b else 0 for b in range(n)] for a in range(n)]
        fixed = [[self.hop_overhead_s + (self.act_codec_s if a != b and quantizes(self.hop_codec(topo, a, b)) else 0.0)
                  for b in range(n)] for a in range(n)]
        if len(self._hop_tables) >= 8:
            self._hop_tables.clear()
        self._hop_tables[key] = (topo, nbytes, fixed)
        return nbytes, fixed

    def usable_hop_s(self, topo: Topology, factor: float = USABLE_HOP_FACTOR) -> float:
        """Slowest hop a route may use: ``factor`` x the median hop over all node pairs (geo12 at
        32 MiB: median 1.9 s, so only the 132 s NL-London link is unusable)."""
        if topo.n < 2:
            return math.inf
        hops = sorted(self.hop_s(topo, a, b) for a in range(topo.n) for b in range(topo.n) if a != b)
        return factor * hops[len(hops) // 2]

    def stage_params(self, stage: int) -> int:
        if self.params_per_stage:
            return self.params_per_stage[stage]
        # Default: LLaMA-style layers with a 4x MLP; stage 0 also holds a 32k embedding and head.
        p = self.layers_per_stage[stage] * layer_params(self.d_model, 4 * self.d_model)
        if stage == 0:
            p += 2 * 32000 * self.d_model + self.d_model
        return p

    def sync_bytes(self, stage: int) -> int:
        """Bytes each replica contributes to its stage's sync (dense gradient or compressed payload)."""
        if self.dp_mode == "dense":
            return self.stage_params(stage) * self.grad_dtype_bytes
        if self.dp_mode == "compressed":
            return self.compressed_payload_bytes
        return 0

    def sync_steps(self, n_replicas: int) -> tuple[int, float]:
        """(ring steps, fraction of :meth:`sync_bytes` sent per step) for ``n_replicas``."""
        if n_replicas <= 1 or self.dp_mode == "none":
            return 0, 0.0
        if self.dp_mode == "dense":
            return 2 * (n_replicas - 1), 1.0 / n_replicas
        return n_replicas - 1, 1.0

    def ring_s(self, topo: Topology, ring: SyncRing, nbytes: float) -> float:
        """Uncontended time of ``ring`` (:class:`~skiptrain.schedule.sync_rings.SyncRing`) on
        ``nbytes`` per replica: its chains' hops, each as long as the ring's slowest link."""
        _, hops, frac = ring.chains(self.sync_steps(len(ring)))
        if hops == 0:
            return 0.0
        nodes = ring.nodes
        return hops * max(topo.transfer_s(nodes[i], nodes[(i + 1) % len(nodes)], nbytes * frac)
                          for i in range(len(nodes)))

    def phases_s(self, topo: Topology, phases: Sequence[tuple[Sequence[SyncRing], float]],
                 nbytes: float) -> float:
        """Uncontended time of a sync given as phases (:meth:`sync_phases`): each phase as long as
        its slowest ring on its share of ``nbytes``, the phases one after the other."""
        return sum(max((self.ring_s(topo, ring, nbytes * share) for ring in rings), default=0.0)
                   for rings, share in phases)

    def hierarchical_phases(self, topo: Topology, replicas: Sequence[int]) -> list[tuple[list[SyncRing], float]] | None:
        """The three phases of the hierarchical sync of ``replicas`` (module doc) as (rings, share
        of the bytes each ring carries): region rings (a reduce-scatter to the region's shard
        members where that pays, :func:`~skiptrain.schedule.sync_rings.scatter_pays`, else an
        all-reduce), the ``k`` shard rings across regions, the region rings again (the mirror
        gather, or an all-reduce); None when it is no different from one ring (one region, or one
        replica in every region)."""
        region_of = topo.region_of()
        groups: dict[int, list[int]] = {}
        for r in sorted(replicas):
            groups.setdefault(region_of[r], []).append(r)
        if len(groups) < 2 or len(groups) == len(replicas):
            return None
        k = min(len(g) for g in groups.values())
        gather, scatter = [], []
        for g in groups.values():
            if len(g) < 2:
                continue
            ring, owners = tuple(ring_order(topo, g)), tuple(g[:k])
            pays = scatter_pays(len(g), k)
            scatter.append(SyncRing(ring, "scatter", owners) if pays else SyncRing(ring))
            gather.append(SyncRing(ring, "gather", owners) if pays else SyncRing(ring))
        shards = [SyncRing(tuple(ring_order(topo, [g[j] for g in groups.values()]))) for j in range(k)]
        return [(scatter, 1.0), (shards, 1.0 / k), (gather, 1.0)]

    def sync_phases(self, topo: Topology, replicas: Sequence[int], nbytes: float) -> list[tuple[list[SyncRing], float]]:
        """The sync of ``replicas`` (``nbytes`` each) as phases of (rings, share of the bytes), by
        ``dp_topology``: ``[([ring], 1.0)]`` flat, or :meth:`hierarchical_phases`; ``"auto"`` takes
        the faster (:meth:`phases_s`).  Only the dense sync is hierarchical."""
        flat = [([SyncRing(tuple(ring_order(topo, replicas)))], 1.0)] if len(replicas) > 1 else []
        if self.dp_mode != "dense" or self.dp_topology == "flat":
            return flat
        hier = self.hierarchical_phases(topo, replicas)
        if hier is None:
            return flat
        if self.dp_topology == "hierarchical":
            return hier
        return hier if self.phases_s(topo, hier, nbytes) < self.phases_s(topo, flat, nbytes) else flat

    def dp_sync_s(self, topo: Topology, replicas: Sequence[int], stage: int) -> float:
        """Uncontended sync time of ``stage`` over ``replicas`` (:meth:`sync_phases`)."""
        nbytes = self.sync_bytes(stage)
        return self.phases_s(topo, self.sync_phases(topo, replicas, nbytes), nbytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        return cls(**d)


#: Rings of more nodes than this are searched with bounded effort (:func:`ring_order`).
RING_FULL_SEARCH = 16
RING_STARTS, RING_WINDOW = 8, 16


def ring_order(topo: Topology, nodes: Sequence[int]) -> list[int]:
    """A ring over ``nodes`` whose slowest link (by inverse bandwidth) is as fast as possible,
    ties broken by the sum.  Exact for up to 7 nodes; up to :data:`RING_FULL_SEARCH` nodes greedy
    nearest neighbour from every start followed by 2-opt moves to a local optimum; beyond that
    (effort cubic in the ring size) greedy from the first :data:`RING_STARTS` nodes and 2-opt
    moves that reverse at most :data:`RING_WINDOW` nodes."""
    nodes = list(nodes)
    if len(nodes) <= 3:
        return nodes
    inv = topo.inv_bw_rows

    def key(ring: Sequence[int]) -> tuple[float, float]:
        links = [inv[ring[i]][ring[(i + 1) % len(ring)]] for i in range(len(ring))]
        return (max(links), sum(links))

    if len(nodes) <= 7:
        first, rest = nodes[0], nodes[1:]
        return min(([first, *p] for p in itertools.permutations(rest) if p[0] < p[-1]), key=key)
    big = len(nodes) > RING_FULL_SEARCH
    best, best_key = nodes, key(nodes)
    for start in nodes[:RING_STARTS] if big else nodes:
        ring, left = [start], set(nodes) - {start}
        while left:
            cur = ring[-1]
            nxt = min(left, key=lambda b: (inv[cur][b], b))
            ring.append(nxt)
            left.remove(nxt)
        k = key(ring)
        if k < best_key:
            best, best_key = ring, k
    improved = True
    while improved:
        improved = False
        for i in range(1, len(best) - 1):
            for j in range(i + 1, min(len(best), i + RING_WINDOW) if big else len(best)):
                cand = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                k = key(cand)
                if k < best_key:
                    best, best_key, improved = cand, k, True
    return best


def reference_cost(tokens_per_microbatch: int = 8 * 1024, dp_mode: str = "dense",
                   task_s: tuple[float, float] = (0.0, 0.0)) -> CostModel:
    """SkipPipe's 20-node setup (skippipe_reference.json): d=1024 fp32, 6 stages x 4 layers,
    0.055 s/sample/layer, 0.35 s per hop; ``tokens_per_microbatch`` in multiples of 1024;
    ``task_s``: (forward, backward) overhead per task (:data:`SKIPPIPE_TASK_S` is SkipPipe's)."""
    if tokens_per_microbatch % 1024:
        raise CostError("tokens per micro-batch must be a multiple of the 1024-token context")
    return CostModel(d_model=1024, tokens_per_sample=1024, samples=tokens_per_microbatch // 1024,
                     dtype_bytes=4, layers_per_stage=[4] * 6, s_per_sample_per_layer=0.055,
                     hop_overhead_s=0.35, dp_mode=dp_mode, fwd_task_s=task_s[0], bwd_task_s=task_s[1])


def published_cost(dp_mode: str = "dense", task_s: tuple[float, float] = (0.0, 0.0)) -> CostModel:
    """The cost behind SkipPipe's published schedule.json and its 79.9 s / 33.3 s: 2 samples of
    4096 tokens per micro-batch (32 MiB per hop, d=1024 fp32), forward 0.055 s x 4 layers x 2
    samples = 0.44 s per stage, 0.35 s per hop (``how_to_read`` in schedule/data); ``task_s`` as
    in :func:`reference_cost`."""
    return CostModel(d_model=1024, tokens_per_sample=4096, samples=2, dtype_bytes=4,
                     layers_per_stage=[4] * 6, s_per_sample_per_layer=0.055, hop_overhead_s=0.35,
                     dp_mode=dp_mode, fwd_task_s=task_s[0], bwd_task_s=task_s[1])


def from_model_config(model: Any, samples: int, s_per_sample_per_layer: float | None = None,
                      dtype_bytes: int = 4, **kw: Any) -> CostModel:
    """A cost model for :class:`skiptrain.config.ModelConfig` ``model`` with ``samples`` per
    micro-batch.  Layers: ``stage0_layers`` on stage 0 (or an even split when -1), the rest
    spread over the body stages.  Without ``s_per_sample_per_layer`` it is measured
    (:func:`profile_s_per_sample_per_layer`)."""
    S, L = model.n_stages, model.n_layers
    s0 = model.stage0_layers if model.stage0_layers >= 0 else L // S
    body = L - s0
    if S > 1:
        layers = [s0] + [body // (S - 1) + (1 if i < body % (S - 1) else 0) for i in range(S - 1)]
    else:
        layers = [L]
    per_layer = layer_params(model.d_model, model.hidden, model.kv_heads * model.head_dim)
    params = [n * per_layer for n in layers]
    params[0] += 2 * model.vocab_size * model.d_model + model.d_model
    if s_per_sample_per_layer is None:
        s_per_sample_per_layer = profile_s_per_sample_per_layer(model.d_model, model.seq_len,
                                                                model.n_heads, model.hidden)
    return CostModel(d_model=model.d_model, tokens_per_sample=model.seq_len, samples=samples,
                     dtype_bytes=dtype_bytes, layers_per_stage=layers,
                     s_per_sample_per_layer=s_per_sample_per_layer, params_per_stage=params, **kw)


def profile_s_per_sample_per_layer(d_model: int, seq_len: int, n_heads: int = 8,
                                   ffn_hidden: int | None = None, samples: int = 2,
                                   repeats: int = 3) -> float:
    """Measure forward seconds per sample per layer on this machine with a stock
    ``torch.nn.TransformerEncoderLayer`` (median of ``repeats`` after one warm-up)."""
    import torch

    layer = torch.nn.TransformerEncoderLayer(d_model, n_heads, ffn_hidden or 4 * d_model,
                                             batch_first=True, dropout=0.0)
    x = torch.randn(samples, seq_len, d_model)
    times = []
    with torch.no_grad():
        layer(x)
        for _ in range(repeats):
            t = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] / samples
