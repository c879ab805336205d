"""Drift re-planning: measured compute and link times replace the static topology, and
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
* **Limits**: drift re-planning only while the phase's full placement, or the layout of the
  last freeze transition (``runtime.freezing``: the monitor then measures against the new
  layout's cost model), is in force (after a
  failure the repair of :func:`~skiptrain.runtime.recovery.replan` is followed once by a
  post-recovery :func:`replan_routes` of the survivors, ``Replanner.recovery_replan``); only with a
  topology and cost model in the phase; the re-plan (about 1 s of planner time on rank 0 for 12
  nodes, capped at ``node.replan.RECOVERY_PLAN_TIME_S`` CPU seconds) stalls the swarm for that time once.
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
                    exp += (self.cost.fwd_compute_s(e.stage, sp) if e.kind == "fwd" else
                            self.cost.bwd_compute_s(e.stage, sp) if e.kind == "bwd" else self.cost.loss_compute_s(sp))
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


def replan_routes(schedule, topo: Topology, cost, cfg, min_gain: float = 0.05, time_limit_s: float | None = None,
                  max_evals: int | None = None):
    """Re-plan the routes of ``schedule`` on ``topo`` (static or measured) with its placement fixed.
    Returns ``(new schedule or None, current simulated s, new simulated s)``.

    Works for any set of node ids (e.g. the survivors after :func:`~skiptrain.runtime.recovery.replan`
    or a join): the placement's nodes, sorted, are relabelled to positions ``0..n'-1`` on
    ``topo.subset(nodes)`` (which renumbers in that order), the planner plans there and the node ids
    are mapped back.  The micro-batch ids are kept: the planner's micro-batches, in id order, take
    the schedule's ids in id order (same count; every node's data cursor maps ids to samples, so no
    sample is lost or repeated).  Returns ``(None, cur, None)`` when the planner cannot produce the
    same problem: a stage with no replica (the planner needs every stage served) or a micro-batch
    count that is not a multiple of the originators (the planner gives each the same number), or
    when the planner refuses the placement (:class:`~skiptrain.schedule.schedule.ScheduleError`)."""
    from ..schedule.planner import PlanConfig, plan
    from ..schedule.schedule import MicroBatch, Schedule, ScheduleError
    from ..schedule.simulator import simulate

    nodes = sorted({n for p in schedule.placement for n in p})
    if not nodes or any(n >= topo.n for n in nodes):
        return None, None, None
    pos = {n: i for i, n in enumerate(nodes)}
    sub = topo.subset(nodes) if nodes != list(range(topo.n)) else topo
    rel_pl = [[pos[n] for n in p] for p in schedule.placement]
    rel = Schedule(placement=rel_pl,
                   micro_batches=[MicroBatch(m.id, pos[m.originator], [(s, pos[n]) for s, n in m.route], m.start_s)
                                  for m in schedule.micro_batches],
                   memory=schedule.memory, skip_ratio=schedule.skip_ratio, max_swaps=schedule.max_swaps,
                   policy=schedule.policy, method=schedule.method, meta=dict(schedule.meta))
    cur = simulate(rel, sub, cost, contention=True, dp_sync=False, record=False).iteration_s
    ids = sorted(m.id for m in schedule.micro_batches)
    n_orig = len(rel_pl[0])
    if any(not p for p in rel_pl) or n_orig == 0 or len(ids) % n_orig:
        return None, cur, None
    pc = PlanConfig(n_stages=len(rel_pl), stage_sizes=[len(p) for p in rel_pl],
                    skip_ratio=schedule.skip_ratio, max_swaps=schedule.max_swaps, memory=schedule.memory,
                    mb_per_originator=len(ids) // n_orig, seed=cfg.runtime.plan_seed, contention=True,
                    dp_sync=False, placement=[list(p) for p in rel_pl], time_limit_s=time_limit_s,
                    max_evals=max_evals)
    try:
        new = plan(sub, cost, pc)
    except ScheduleError:              # e.g. credits that deadlock on every route: keep the current one
        return None, cur, None
    if len(new.micro_batches) != len(ids) or new.placement != rel_pl:
        return None, cur, None
    ns = simulate(new, sub, cost, contention=True, dp_sync=False, record=False).iteration_s
    if not ns < cur * (1 - min_gain):
        return None, cur, ns
    idmap = {m.id: ids[i] for i, m in enumerate(sorted(new.micro_batches, key=lambda m: m.id))}
    out = Schedule(placement=[list(p) for p in schedule.placement],
                   micro_batches=[MicroBatch(idmap[m.id], nodes[m.originator], [(s, nodes[n]) for s, n in m.route],
                                             m.start_s) for m in new.micro_batches],
                   memory=new.memory, skip_ratio=new.skip_ratio, max_swaps=new.max_swaps, policy=new.policy,
                   method=(schedule.method or "schedule") + "+routes",
                   meta={**schedule.meta, "takeover": {}, "planner": new.meta.get("planner")})
    return out, cur, ns


def broadcast_schedule(control, adopted):
    """Rank 0's re-planned ``adopted = (schedule, record)`` (or None) to every node of the control
    plane's group (:meth:`~skiptrain.runtime.node.control.ControlPlane.broadcast_json`); returns
    (schedule or None, record or None) everywhere."""
    from ..schedule.schedule import Schedule

    d = control.broadcast_json({"schedule": adopted[0].to_dict(), "last": adopted[1]} if adopted else None)
    return (Schedule.from_dict(d["schedule"]), d["last"]) if d else (None, None)
