"""The one seam for emulation and measurement on one machine.

A swarm on one host (tests, benchmarks, the demo) plays a wide-area network and unequal devices
in user space (:mod:`skiptrain.runtime.wan`): messages leave on per-link FIFOs with the
topology's latency and bandwidth, compute tasks are padded to the cost model's durations at the
node's speed, replica groups' collectives are delayed as rings on the topology's links.  All of
that enters the node's production code here and only here:

* the executor gets :meth:`Emulation.finish` as its task timer (a real run: a task ends when its
  compute ends);
* the pipeline transport gets its pacing (:meth:`Emulation.pace`; a real run sends at once);
* a replica group's sync strategy gets its emulated ring, or both shapes of the dense sum where
  the cost model may take the hierarchical one (:meth:`Emulation.sync_link`);
* the prefill of the activation cache pads its compute (:meth:`Emulation.pad`);
* it registers its own statistics columns (:meth:`Emulation.add_stats`): tasks that overran their
  emulated duration, the process's CPU seconds of the iteration, and how late the common start
  time reached this node.

A phase asks for emulation with its :class:`~skiptrain.runtime.job.EmulationSpec`
(``Phase.emulation``); without one the object only measures.
"""

from __future__ import annotations

import time

from .executor import BWD, FWD
from .job import EmulationSpec
from .wan import ComputePadding, LinkFifo


class Emulation:
    """What phase ``ph`` emulates on node ``rank`` (topology ``topo``, cost model ``cost``)."""

    def __init__(self, ph, topo, cost, rank: int):
        self.rank, self.topo, self.cost = rank, topo, cost
        self.in_topology = topo is not None and rank < topo.n
        self.base_speed = topo.speed(rank) if self.in_topology else 1.0
        self.speed = self.base_speed          # what the cost model's durations are divided by
        spec = ph.emulation or EmulationSpec()
        self.links = spec.links and self.in_topology
        self.bytes_scale = spec.bytes_scale
        self.padding = ComputePadding(spec.compute and cost is not None)
        self.sync_topo = topo if spec.sync and topo is not None else None
        self.start_delay = 0.0
        self.cpu0 = time.process_time()

    # ---- compute -------------------------------------------------------------------------

    def task_s(self, kind: int, stage: int) -> float:
        """The emulated compute seconds of one task (0 without a cost model); the cost model's
        per-task overhead is not emulated: the runtime pays its own."""
        if self.cost is None:
            return 0.0
        if kind == FWD:
            return self.cost.fwd_compute_s(stage, self.speed)
        if kind == BWD:
            return self.cost.bwd_compute_s(stage, self.speed)
        return self.cost.loss_compute_s(self.speed)

    def finish(self, kind: int, stage: int, start: float) -> float:
        """The executor's task timer: when a task that started at ``start`` ends (padded to its
        emulated duration when compute is emulated; now otherwise)."""
        return self.padding.pad(start, self.task_s(kind, stage))

    def pad(self, start: float, seconds: float) -> float:
        """Wait until ``start + seconds`` when compute is emulated; returns the end time."""
        return self.padding.pad(start, seconds)

    # ---- links ---------------------------------------------------------------------------

    def pace(self, transport) -> None:
        """Set the pipeline transport's pacing: the phase's emulated links, else none."""
        hop = self.cost.hop_overhead_s if self.cost else 0.0
        transport.pacing = (LinkFifo.from_topology(self.topo, self.rank, self.bytes_scale, hop)
                            if self.links else None)

    def sync_link(self, replicas: list[int]):
        """The emulated links of a replica group's collectives (``EmulationSpec.sync``): the ring
        over ``replicas`` on the phase's topology, or, where the cost model's ``dp_topology`` may
        take the hierarchical dense sum (:meth:`~skiptrain.schedule.cost.CostModel.hierarchical_phases`),
        both shapes (:class:`~skiptrain.dp.link.HierarchicalLinks`: the transport runs the one the
        cost model's rule picks); None (the ``dp`` config's links) otherwise.  Members are named by
        their rank in the group: the group lists its members' ranks sorted, and node ``i`` is rank
        ``i`` on the emulated topology (as for the pipeline's links)."""
        topo = self.sync_topo
        if topo is None or len(replicas) < 2 or max(replicas) >= topo.n:
            return None
        from ..dp.link import HierarchicalLinks
        from ..schedule.cost import ring_order

        members = sorted(replicas)
        flat = self._ring_links(ring_order(topo, members))
        cost = self.cost
        hier = (cost.hierarchical_phases(topo, members)
                if cost is not None and cost.dp_mode == "dense" and cost.dp_topology != "flat" else None)
        if hier is None:
            return flat
        (local, _), (shards, _), _ = hier
        alone = [[n] for n in members if not any(n in ring.nodes for ring in local)]
        regions = [list(ring.nodes) for ring in local] + alone
        pos = {n: i for i, n in enumerate(members)}
        return HierarchicalLinks(flat, tuple(tuple(pos[n] for n in r) for r in regions),
                                 tuple(self._ring_links(r) for r in regions),
                                 tuple(tuple(pos[n] for n in ring.nodes) for ring in shards),
                                 tuple(self._ring_links(list(ring.nodes)) for ring in shards),
                                 tuple(tuple(pos[n] for n in ring.owners) for ring in local) + ((),) * len(alone),
                                 cost.dp_topology)

    def _ring_links(self, ring: list[int]):
        """:class:`~skiptrain.dp.link.RingLinks` of ``ring`` (node ids, ring order) on the sync
        topology (no links for a ring of one)."""
        from ..dp.link import RingLinks

        topo = self.sync_topo
        if len(ring) < 2:
            return RingLinks(byte_scale=float(self.bytes_scale))
        pairs = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
        return RingLinks(tuple(float(topo.latency_s[a][b]) for a, b in pairs),
                         tuple(1.0 / float(topo.bandwidth_Bps[a][b]) for a, b in pairs), float(self.bytes_scale))

    # ---- measurement ---------------------------------------------------------------------

    def iteration_started(self, start_delay: float) -> None:
        """The iteration starts (at the common start time, which reached this node
        ``start_delay`` seconds after rank 0 sent it); its CPU seconds count from now."""
        self.start_delay = start_delay
        self.cpu0 = time.process_time()

    def add_stats(self, stats) -> None:
        """This node's emulation and measurement columns of the iteration's statistics."""
        stats.add("overruns", self.padding.overruns)
        stats.add("overrun_s", self.padding.overrun_s)
        stats.add("cpu_s", time.process_time() - self.cpu0)
        stats.add("start_delay", self.start_delay)
