"""Drift re-planning (issue 8): measured compute and link times replace the static topology, and
the routes are re-planned when the measured iteration time drifts past a threshold.

* **Measuring** (:class:`DriftMonitor`, every node, every committed iteration): the node's
  *compute factor* = its measured forward/backward/loss durations over the cost model's durations
  at the topology's speed for this node, and a *link factor* per destination = measured send
  time (link queue start to hand-off after emulated delivery) over the topology's uncontended
  transfer time (latency + bytes / bandwidth + hop overhead).  Both are exponential moving
  averages (``alpha``).  The factors travel with the iteration's stats gather to rank 0.
* **Deciding** (rank 0): the moving average of the measured iteration time against the
  simulated iteration time of the schedule in force (static topology); past ``1 + threshold``,
  the topology is rebuilt from the measurements (:func:`measured_topology`: node speeds divided
  by compute factors, latencies multiplied and bandwidths divided by link factors) and the
  planner re-plans the **routes with the placement fixed** (nobody changes stage, so no state
  moves); the new schedule is adopted only when it simulates at least ``min_gain`` faster than
  the current one on the measured topology.  Rank 0 broadcasts it; every node switches at the
  next iteration.  After a re-plan the reference becomes the new schedule's simulated time on
  the measured topology.
* **Limits**: only while every node of the phase's schedule is alive (the planner plans the full
  node set; after a failure the repair of :func:`~skiptrain.runtime.recovery.replan` stays in
  force); only with a topology and cost model in the phase; the re-plan (about 1 s of planner
  time on rank 0 for 12 nodes) stalls the swarm for that time once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..net.topology import Node, Topology


class DriftMonitor:
    def __init__(self, rank: int, n_nodes: int, cost, topo: Topology | None, bytes_scale: float, alpha: float = 0.3):
        self.rank, self.n, self.cost, self.topo = rank, n_nodes, cost, topo
        self.bytes_scale, self.alpha = bytes_scale, alpha
        self.compute = 1.0
        self.links = np.ones(n_nodes)

    def _ema(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def observe(self, events) -> torch.Tensor:
        """Update from one iteration's events; returns ``[compute, link_0 .. link_{n-1}]``."""
        if self.cost is not None and self.topo is not None and self.rank < self.topo.n:
            sp = self.topo.speed(self.rank)
            meas = exp = 0.0
            for e in events:
                if e.kind in ("fwd", "bwd", "loss"):
                    meas += e.end - e.start
                    exp += (self.cost.fwd_s(e.stage, sp) if e.kind == "fwd" else
                            self.cost.bwd_s(e.stage, sp) if e.kind == "bwd" else self.cost.loss_s(sp))
            if exp > 0:
                self.compute = self._ema(self.compute, meas / exp)
            per: dict[int, list[float]] = {}
            for e in events:
                if e.kind == "send" and e.peer is not None and e.peer < min(self.n, self.topo.n):
                    ex = self.topo.transfer_s(self.rank, e.peer, e.bytes * self.bytes_scale) + self.cost.hop_overhead_s
                    if ex > 0:
                        per.setdefault(e.peer, []).append((e.end - e.start) / ex)
            for d, v in per.items():
                self.links[d] = self._ema(self.links[d], float(np.mean(v)))
        return torch.tensor([self.compute, *self.links.tolist()], dtype=torch.float64)


def measured_topology(topo: Topology, compute: dict[int, float], links: np.ndarray) -> Topology:
    """``topo`` with node speeds divided by their compute factors and link ``a -> b`` latency
    multiplied / bandwidth divided by ``links[a][b]`` (factors of 1 where nothing was measured)."""
    n = topo.n
    f = np.ones((n, n))
    k = min(n, links.shape[0])
    f[:k, :k] = np.where(links[:k, :k] > 0, links[:k, :k], 1.0)
    nodes = [Node(i, nd.location, nd.speed / max(compute.get(i, 1.0), 1e-6)) for i, nd in enumerate(topo.nodes)]
    return Topology(nodes, np.asarray(topo.latency_s, dtype=float) * f, np.asarray(topo.bandwidth_Bps, dtype=float) / f,
                    name=f"{topo.name}+measured")


def replan_routes(schedule, topo: Topology, cost, cfg, min_gain: float = 0.05):
    """Re-plan the routes of ``schedule`` on ``topo`` (measured) with its placement fixed.
    Returns ``(new schedule or None, current simulated s, new simulated s)``."""
    from ..schedule.planner import PlanConfig, plan
    from ..schedule.simulator import simulate

    nodes = sorted(n for p in schedule.placement for n in p)
    sub = topo.subset(nodes) if nodes != list(range(topo.n)) else topo
    if nodes != list(range(len(nodes))):
        return None, None, None                 # ids must equal positions for the planner
    cur = simulate(schedule, sub, cost, contention=True, dp_sync=False, record=False).iteration_s
    pc = PlanConfig(n_stages=len(schedule.placement), stage_sizes=[len(p) for p in schedule.placement],
                    skip_ratio=schedule.skip_ratio, max_swaps=schedule.max_swaps, memory=schedule.memory,
                    mb_per_originator=cfg.runtime.mb_per_originator, seed=cfg.runtime.plan_seed, contention=True,
                    dp_sync=False, placement=[list(p) for p in schedule.placement])
    new = plan(sub, cost, pc)
    if sorted(m.id for m in new.micro_batches) != sorted(m.id for m in schedule.micro_batches) or \
            new.placement != schedule.placement:
        return None, cur, None
    ns = simulate(new, sub, cost, contention=True, dp_sync=False, record=False).iteration_s
    return (new if ns < cur * (1 - min_gain) else None), cur, ns
