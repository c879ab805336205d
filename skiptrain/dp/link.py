"""User-space WAN emulation for data-parallel collectives: real sleeps derived from real bytes.

A :class:`LinkModel` gives every node the same access link: ``up_mbps`` upload,
``down_mbps`` download (Mbit/s) and one-way ``latency_ms`` per message.  After a collective
has really run (over gloo on loopback), :class:`~skiptrain.dp.transport.Transport` sleeps for
the time the same collective would take on those links, computed from the bytes it actually
moved, following the ring algorithms gloo uses:

* all-gather of ``B`` bytes per node over ``N`` nodes: ``N-1`` rounds; in each a node sends
  ``B`` bytes up and receives ``B`` bytes down at the same time:
  ``(N-1) * (latency + max(8B/up, 8B/down))``;
* all-reduce of ``S`` bytes: reduce-scatter then all-gather of ``S/N``-byte pieces,
  ``2(N-1)`` rounds: ``2(N-1) * (latency + max(8S/(N up), 8S/(N down)))``.

The delay is wall-clock time added on top of the real loopback transfer (so it is slightly
pessimistic).  Every node computes the same delay, so nodes stay in step.  This is a model of
one shared access link per node, not per-link FIFO queues; the pipeline transport emulates
those separately.

:class:`RingLinks` is the same delay over a ring of point-to-point links of a topology (a
stage's replicas on geo links): every round moves its piece over every ring link at once and
lasts as long as the slowest (latency + bytes / bandwidth); bytes count ``byte_scale`` times
(the emulated bytes per real byte of the topology's emulation).


:class:`HierarchicalLinks` is a group's two shapes of the dense sum over a topology's regions (the
cost model's ``dp_topology``, :meth:`skiptrain.schedule.cost.CostModel.sync_phases`): the flat
ring, or the hierarchical sum (each region's ring, ``k`` shard rings across regions, each region's
ring again: a reduce-scatter and its gather, or an all-reduce twice); with ``mode="auto"`` the
faster at the bytes at hand, by the same ring formula.
:class:`~skiptrain.dp.transport.Transport` runs the shape it picks and sleeps its time.

Named presets (:data:`LINK_PRESETS`, chosen with ``dp.link``; empty = the ``dp.link_up_mbps`` /
``dp.link_down_mbps`` / ``dp.link_latency_ms`` fields):

* ``consumer``: a home internet line, 10 Mbit/s up, 100 Mbit/s down, 25 ms one-way latency.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    up_mbps: float = 0.0
    down_mbps: float = 0.0
    latency_ms: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.up_mbps > 0 or self.down_mbps > 0 or self.latency_ms > 0

    def _xfer_s(self, nbytes: float) -> float:
        up = nbytes * 8 / (self.up_mbps * 1e6) if self.up_mbps > 0 else 0.0
        down = nbytes * 8 / (self.down_mbps * 1e6) if self.down_mbps > 0 else 0.0
        return max(up, down)

    def all_gather_s(self, nbytes_per_node: int, world: int) -> float:
        if world <= 1 or not self.enabled:
            return 0.0
        return (world - 1) * (self.latency_ms / 1e3 + self._xfer_s(nbytes_per_node))

    def all_reduce_s(self, nbytes: int, world: int) -> float:
        if world <= 1 or not self.enabled:
            return 0.0
        return 2 * (world - 1) * (self.latency_ms / 1e3 + self._xfer_s(nbytes / world))

    @classmethod
    def from_config(cls, dp_cfg) -> "LinkModel":
        """The links of ``dp_cfg``: the preset ``dp.link`` if set, else the ``link_*`` fields."""
        if dp_cfg.link:
            return LINK_PRESETS[dp_cfg.link]
        return cls(dp_cfg.link_up_mbps, dp_cfg.link_down_mbps, dp_cfg.link_latency_ms)


@dataclass(frozen=True)
class RingLinks:
    """The ring links of a group: per ring link (member ``i`` to member ``i + 1``) its latency in
    seconds and seconds per byte; ``byte_scale`` emulated bytes per real byte."""
    latency_s: tuple[float, ...] = ()
    s_per_byte: tuple[float, ...] = ()
    byte_scale: float = 1.0

    @property
    def enabled(self) -> bool:
        return len(self.latency_s) > 1

    def _round_s(self, nbytes: float) -> float:
        return max(lat + nbytes * self.byte_scale * spb for lat, spb in zip(self.latency_s, self.s_per_byte))

    def all_gather_s(self, nbytes_per_node: int, world: int) -> float:
        if world <= 1 or not self.enabled:
            return 0.0
        return (world - 1) * self._round_s(nbytes_per_node)

    def all_reduce_s(self, nbytes: int, world: int) -> float:
        if world <= 1 or not self.enabled:
            return 0.0
        return 2 * (world - 1) * self._round_s(nbytes / world)

    def scatter_s(self, nbytes: float, world: int, pieces: int) -> float:
        """A reduce-scatter of ``nbytes`` to ``pieces`` owners over the ``world`` members (or
        its mirror all-gather): ``world - 1`` rounds of ``nbytes / pieces``."""
        if world <= 1 or not self.enabled:
            return 0.0
        return (world - 1) * self._round_s(nbytes / pieces)


@dataclass(frozen=True)
class HierarchicalLinks:
    """A replica group's sync shapes over a topology, members named by their rank in the group:
    ``flat`` the ring links over all members; ``regions`` the members of every region in ring
    order (one-member regions included) with ``region_links`` their rings' links (disabled for a
    region of one); ``shards`` the ``k`` rings across regions (ring ``j``: every region's ``j``-th
    member), each summing the ``j``-th of ``k`` pieces of the buffer, with ``shard_links``;
    ``owners`` per region the member that sums each piece there (``owners[i][j]``: region ``i``'s
    member in shard ring ``j``) when the region reduce-scatters to them and gathers back, empty
    where it all-reduces instead (:func:`skiptrain.schedule.sync_rings.scatter_pays`);
    ``mode`` ``"hierarchical"`` or ``"auto"`` (the faster, ties flat)."""
    flat: RingLinks
    regions: tuple[tuple[int, ...], ...]
    region_links: tuple[RingLinks, ...]
    shards: tuple[tuple[int, ...], ...]
    shard_links: tuple[RingLinks, ...]
    owners: tuple[tuple[int, ...], ...]
    mode: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.flat.enabled

    def hierarchical_s(self, nbytes: float) -> float:
        """The three phases: the slowest region ring twice (its reduce-scatter and gather, or its
        all-reduce), the slowest shard ring once (on its ``1 / k`` of the bytes)."""
        k = len(self.shards)
        local = max((links.scatter_s(nbytes, len(m), k) if own else links.all_reduce_s(nbytes, len(m))
                     for links, m, own in zip(self.region_links, self.regions, self.owners)), default=0.0)
        return 2 * local + max(links.all_reduce_s(nbytes / k, len(m)) for links, m in zip(self.shard_links, self.shards))

    def hierarchical(self, nbytes: float, world: int) -> bool:
        """Whether a sum of ``nbytes`` over the ``world`` members takes the hierarchical shape."""
        return self.mode == "hierarchical" or self.hierarchical_s(nbytes) < self.flat.all_reduce_s(nbytes, world)

    def all_gather_s(self, nbytes_per_node: int, world: int) -> float:
        return self.flat.all_gather_s(nbytes_per_node, world)

    def all_reduce_s(self, nbytes: int, world: int) -> float:
        if self.hierarchical(nbytes, world):
            return self.hierarchical_s(nbytes)
        return self.flat.all_reduce_s(nbytes, world)


#: named per-node links (``dp.link``); the config's choices for ``dp.link`` are these names
LINK_PRESETS: dict[str, LinkModel] = {
    "consumer": LinkModel(up_mbps=10.0, down_mbps=100.0, latency_ms=25.0),
}
