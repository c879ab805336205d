"""Wide-area link emulation for the pipeline transport: per-directed-link FIFOs in user space.

What is emulated (and what is not):

* **Links.**  Every directed link ``a -> b`` of a :class:`~skiptrain.net.topology.Topology` is a
  FIFO.  A message of ``B`` real bytes counts as ``B * bytes_scale`` emulated bytes; it waits
  until the messages queued before it on the same link have left the link, occupies the link for
  ``B * bytes_scale / bandwidth[a][b]`` seconds, and is delivered ``latency[a][b] +
  hop_overhead_s`` after it leaves the link.  This is exactly the simulator's contention model
  (:func:`skiptrain.schedule.simulator.simulate`), so the same numbers drive both.
* **Time scale.**  :func:`scale_topology` multiplies every latency by ``time_scale`` and divides
  every bandwidth by it: a run with ``time_scale = 1/16`` plays the wide-area network 16 times
  faster than real time.  Together with ``bytes_scale`` this puts a tiny model on a CPU in the
  paper's regime (per-hop transfer about 1-2x a stage's forward time): the bench's tiny model
  sends 128 KiB per hop, ``bytes_scale = 256`` makes that SkipPipe's 32 MiB.
* **Compute** (:class:`ComputePadding`): each forward, backward and loss task is padded to a
  fixed emulated duration from the cost model (sleep until ``start + emulated``).  Twelve or more
  node processes share two CPU cores here, so real compute is time-sliced; padding makes every
  task last what the simulator assumes, as long as the real compute fits inside it (tasks that
  overrun are counted and reported, never hidden).
* **Data-parallel sync** (optional): after the real all-reduce the node waits until the
  uncontended ring time of the cost model (:meth:`CostModel.dp_sync_s`) has passed.  Sync
  traffic does not enter the pipeline link FIFOs (the simulator's does; see docs/runtime.md).

The emulation is sender-side: the sending node holds a message until its emulated delivery
time, then really sends it over gloo (loopback: tens of microseconds).  One sender thread per
destination keeps each link's FIFO order.  Nothing here blocks or fails; it only computes times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..net.topology import Topology


def scale_topology(topo: Topology, time_scale: float) -> Topology:
    """``topo`` with latencies times ``time_scale`` and bandwidths divided by it."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    bw = np.asarray(topo.bandwidth_Bps, dtype=float) / time_scale
    return Topology(topo.nodes, np.asarray(topo.latency_s, dtype=float) * time_scale, bw,
                    name=f"{topo.name}x{time_scale:g}" if time_scale != 1 else topo.name)


@dataclass
class LinkFifo:
    """The outgoing links of one node: ``schedule`` returns (leaves-queue, delivered) times."""
    src: int
    latency_s: list[list[float]]
    inv_bandwidth: list[list[float]]
    bytes_scale: float = 1.0
    hop_overhead_s: float = 0.0
    free_at: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_topology(cls, topo: Topology, src: int, bytes_scale: float = 1.0,
                      hop_overhead_s: float = 0.0) -> "LinkFifo":
        return cls(src, topo.lat_rows, topo.inv_bw_rows, bytes_scale, hop_overhead_s)

    def schedule(self, dst: int, nbytes: int, now: float) -> tuple[float, float]:
        """Queue ``nbytes`` real bytes on ``src -> dst`` at ``now`` (seconds, any clock).

        Returns ``(start, deliver)``: when the message starts occupying the link and when it is
        delivered at ``dst``.  Later calls for the same link queue behind earlier ones."""
        if dst >= len(self.latency_s):           # a joined node outside the topology: not emulated
            return now, now
        ser = nbytes * self.bytes_scale * self.inv_bandwidth[self.src][dst]
        start = max(now, self.free_at.get(dst, 0.0))
        self.free_at[dst] = start + ser
        return start, start + ser + self.latency_s[self.src][dst] + self.hop_overhead_s

    def reset(self) -> None:
        """Forget queued messages (a new iteration starts on idle links)."""
        self.free_at.clear()


@dataclass
class ComputePadding:
    """Pad compute tasks to emulated durations; count tasks whose real compute ran longer."""
    enabled: bool = False
    overruns: int = 0
    overrun_s: float = 0.0

    def pad(self, start: float, emulated_s: float) -> float:
        """Sleep until ``start + emulated_s`` (``time.time()`` clock); return the end time."""
        now = time.time()
        if not self.enabled:
            return now
        end = start + emulated_s
        if now > end:
            self.overruns += 1
            self.overrun_s += now - end
            return now
        time.sleep(end - now)
        return time.time()
