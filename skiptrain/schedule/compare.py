"""Run the planner and every baseline on one problem and simulate them under one model.

Used by ``skiptrain simulate`` and ``bench/schedule_geo.py``.  Every method gets the same
topology, cost model, stage sizes, memory and global batch (``mb_per_originator`` x the number
of stage-0 nodes); the planner and the placements optimise for the same model (contention and
DP-sync flags) that the comparison simulates.  Each schedule is validated against the
constraints its method claims before it is simulated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..net.topology import Topology
from .baselines import full_pipeline, random_skip, swarm_greedy
from .cost import CostModel
from .placement import stage_sizes
from .planner import PlanConfig, plan
from .schedule import CONSTRAINTS, SKIP_CLAIMS, Schedule
from .simulator import SimResult, simulate

FULL_CLAIMS = tuple(c for c in CONSTRAINTS if c != "skip_count")
METHODS = ("full_pipeline", "full_pipeline_gpipe", "random_skip", "swarm_full", "swarm_skip",
           "planner_no_ca", "planner")
CLAIMS = {"full_pipeline": FULL_CLAIMS, "full_pipeline_gpipe": FULL_CLAIMS, "swarm_full": FULL_CLAIMS,
          "random_skip": SKIP_CLAIMS, "swarm_skip": SKIP_CLAIMS, "planner_no_ca": SKIP_CLAIMS,
          "planner": SKIP_CLAIMS}


@dataclass
class Comparison:
    schedules: dict[str, Schedule]
    results: dict[str, SimResult]
    planner_s: float
    contention: bool
    dp_sync: bool
    info: dict[str, Any] = field(default_factory=dict)

    def iteration_s(self) -> dict[str, float]:
        return {m: r.iteration_s for m, r in self.results.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"methods": {m: {**r.summary(), "method": self.schedules[m].method}
                            for m, r in self.results.items()},
                "planner_s": self.planner_s, "contention": self.contention, "dp_sync": self.dp_sync,
                **self.info}


def compare(topo: Topology, cost: CostModel, cfg: PlanConfig, contention: bool = True,
            dp_sync: bool = True, methods: tuple[str, ...] = METHODS, record: bool = False) -> Comparison:
    """Plan with every method in ``methods`` and simulate each; see module doc."""
    cfg.contention, cfg.dp_sync = contention, dp_sync
    t0 = time.perf_counter()
    planned = plan(topo, cost, cfg)
    planner_s = time.perf_counter() - t0
    pl = planned.placement
    sizes = [len(p) for p in pl]
    M = len(planned.micro_batches)
    full_sizes = cfg.stage_sizes or stage_sizes(topo.n, cfg.n_stages, 0.0, cost)
    scheds: dict[str, Schedule] = {}
    for m in methods:
        if m == "planner":
            scheds[m] = planned
        elif m == "planner_no_ca":
            c2 = PlanConfig(**{**cfg.__dict__, "collision_aware": False, "placement": pl})
            scheds[m] = plan(topo, cost, c2)
        elif m in ("full_pipeline", "full_pipeline_gpipe"):
            order = "gpipe" if m.endswith("gpipe") else "1f1b"
            lane_pl = scheds["full_pipeline"].placement if "full_pipeline" in scheds else None
            scheds[m] = full_pipeline(topo, cost, full_sizes, M, cfg.memory, order=order, dp_sync=dp_sync,
                                      seed=cfg.seed, placement=lane_pl)
        elif m == "random_skip":
            scheds[m] = random_skip(topo, cost, pl, cfg.mb_per_originator, cfg.skip_ratio, cfg.memory, cfg.seed)
        elif m == "swarm_skip":
            scheds[m] = swarm_greedy(topo, cost, pl, cfg.mb_per_originator, cfg.skip_ratio, cfg.memory,
                                     skip=True, seed=cfg.seed)
        elif m == "swarm_full":
            scheds[m] = swarm_greedy(topo, cost, pl, cfg.mb_per_originator, cfg.skip_ratio, cfg.memory,
                                     skip=False, seed=cfg.seed)
        else:
            raise ValueError(f"unknown method {m!r}; choose from {METHODS}")
    results = {}
    for m, s in scheds.items():
        s.validate(CLAIMS[m], n_nodes=topo.n)
        results[m] = simulate(s, topo, cost, contention=contention, dp_sync=dp_sync, record=record)
    return Comparison(scheds, results, planner_s, contention, dp_sync,
                      info={"stage_sizes": sizes, "micro_batches": M, "nodes": topo.n,
                            "topology": topo.name, "planner_meta": planned.meta.get("planner", {})})


def format_table(cols: dict[str, dict[str, float]], baseline: str = "full_pipeline") -> str:
    """A text table: one row per method, per column the iteration time and its ratio to
    ``baseline`` (``cols`` maps a column title to {method: iteration_s})."""
    methods = []
    for c in cols.values():
        for m in c:
            if m not in methods:
                methods.append(m)
    head = f"{'method':<22}" + "".join(f"{t:>14}{'x ' + baseline[:4]:>10}" for t in cols)
    lines = [head, "-" * len(head)]
    for m in methods:
        row = f"{m:<22}"
        for c in cols.values():
            v = c.get(m)
            b = c.get(baseline)
            row += f"{v:>14.1f}" if v is not None else f"{'-':>14}"
            row += f"{v / b:>10.3f}" if v is not None and b else f"{'-':>10}"
        lines.append(row)
    return "\n".join(lines)
