"""Run the planner and every baseline on one problem and simulate them under one model.

Used by ``skiptrain simulate`` and ``bench/schedule_geo.py``.  Every method gets the same
topology, cost model, stage sizes, memory and global batch (``mb_per_originator`` x the number
of stage-0 nodes); the planner and the placements optimise for the same model (contention and
DP-sync flags) that the comparison simulates.  On geo12 with 20 nodes SkipPipe's published
schedules (:data:`PUBLISHED_METHODS`, their own placement and paths) can be simulated beside them.  Each schedule is validated against the
constraints its method claims before it is simulated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..net.topology import Topology
from . import published
from .baselines import full_pipeline, random_skip, swarm_greedy
from .cost import CostModel
from .placement import stage_sizes
from .planner import PlanConfig, plan
from .schedule import CONSTRAINTS, SKIP_CLAIMS, Schedule
from .simulator import SimResult, simulate

FULL_CLAIMS = tuple(c for c in CONSTRAINTS if c != "skip_count")
METHODS = ("full_pipeline", "full_pipeline_gpipe", "random_skip", "swarm_full", "swarm_skip",
           "planner_no_ca", "planner")
#: SkipPipe's published schedules (:mod:`.published`): only for geo12 with 20 nodes, 6 stages
PUBLISHED_METHODS = ("skippipe_lanes", "skippipe_published_random", "skippipe_published_no_ca",
                     "skippipe_published")
CLAIMS = {"full_pipeline": FULL_CLAIMS, "full_pipeline_gpipe": FULL_CLAIMS, "swarm_full": FULL_CLAIMS,
          "random_skip": SKIP_CLAIMS, "swarm_skip": SKIP_CLAIMS, "planner_no_ca": SKIP_CLAIMS,
          "planner": SKIP_CLAIMS, "skippipe_lanes": FULL_CLAIMS, "skippipe_published_random": SKIP_CLAIMS,
          "skippipe_published_no_ca": SKIP_CLAIMS, "skippipe_published": SKIP_CLAIMS}


@dataclass
class Comparison:
    """Schedules and simulated results per method; ``random_skip_s`` holds the random
    baseline's iteration time per seed (its mean is reported as ``random_skip_mean``)."""
    schedules: dict[str, Schedule]
    results: dict[str, SimResult]
    planner_s: float
    contention: bool
    dp_sync: bool
    info: dict[str, Any] = field(default_factory=dict)
    random_skip_s: list[float] = field(default_factory=list)

    def iteration_s(self) -> dict[str, float]:
        out = {m: r.iteration_s for m, r in self.results.items()}
        if self.random_skip_s:
            out["random_skip_mean"] = sum(self.random_skip_s) / len(self.random_skip_s)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"methods": {m: {**r.summary(), "method": self.schedules[m].method}
                            for m, r in self.results.items()},
                "planner_s": self.planner_s, "contention": self.contention, "dp_sync": self.dp_sync,
                "random_skip_by_seed": self.random_skip_s, **self.info}


def _baseline(m: str, topo: Topology, cost: CostModel, cfg: PlanConfig, pl: list[list[int]], M: int,
              full_sizes: list[int], scheds: dict[str, Schedule]) -> Schedule:
    """The schedule of baseline method ``m`` (see :data:`METHODS`, :data:`PUBLISHED_METHODS`)."""
    if m == "planner_no_ca":
        return plan(topo, cost, PlanConfig(**{**cfg.__dict__, "collision_aware": False, "placement": pl}))
    if m in ("full_pipeline", "full_pipeline_gpipe"):
        order = "gpipe" if m.endswith("gpipe") else "1f1b"
        lane_pl = scheds["full_pipeline"].placement if "full_pipeline" in scheds else None
        return full_pipeline(topo, cost, full_sizes, M, cfg.memory, order=order, dp_sync=cfg.dp_sync,
                             seed=cfg.seed, placement=lane_pl)
    if m == "random_skip":
        return random_skip(topo, cost, pl, cfg.mb_per_originator, cfg.skip_ratio, cfg.memory, cfg.seed)
    if m in ("swarm_skip", "swarm_full"):
        return swarm_greedy(topo, cost, pl, cfg.mb_per_originator, cfg.skip_ratio, cfg.memory,
                            skip=m == "swarm_skip", seed=cfg.seed)
    if m in PUBLISHED_METHODS:
        if topo.n != published.N_NODES or cfg.n_stages != 6 or not topo.name.startswith("geo12"):
            raise ValueError(f"{m} is SkipPipe's published schedule for geo12 with 20 nodes and 6 stages")
        if m == "skippipe_lanes":
            return published.skippipe_lanes()
        if m == "skippipe_published":
            return published.skippipe_ca(cfg.skip_ratio)
        kind = "non-ca-paths" if m == "skippipe_published_no_ca" else "random-paths"
        return published.skippipe_paths(kind, cost, cfg.skip_ratio)
    raise ValueError(f"unknown method {m!r}; choose from {METHODS + PUBLISHED_METHODS}")


def compare(topo: Topology, cost: CostModel, cfg: PlanConfig, contention: bool = True,
            dp_sync: bool = True, methods: tuple[str, ...] = METHODS, record: bool = False,
            random_seeds: int = 1) -> Comparison:
    """Plan with every method in ``methods`` and simulate each; see module doc.  With
    ``random_seeds > 1`` the random baseline is also drawn with seeds ``cfg.seed + 1, ...``;
    ``results["random_skip"]`` stays the draw with ``cfg.seed``."""
    cfg.contention, cfg.dp_sync = contention, dp_sync
    t0 = time.perf_counter()
    planned = plan(topo, cost, cfg)
    planner_s = time.perf_counter() - t0
    pl = planned.placement
    M = len(planned.micro_batches)
    full_sizes = cfg.stage_sizes or stage_sizes(topo.n, cfg.n_stages, 0.0, cost)
    scheds: dict[str, Schedule] = {}
    for m in methods:
        scheds[m] = planned if m == "planner" else _baseline(m, topo, cost, cfg, pl, M, full_sizes, scheds)
    results = {}
    for m, s in scheds.items():
        s.validate(CLAIMS[m], n_nodes=topo.n)
        results[m] = simulate(s, topo, cost, contention=contention, dp_sync=dp_sync, record=record)
    rand = []
    if "random_skip" in methods and random_seeds > 1:
        rand = [results["random_skip"].iteration_s]
        for sd in range(cfg.seed + 1, cfg.seed + random_seeds):
            r = random_skip(topo, cost, pl, cfg.mb_per_originator, cfg.skip_ratio, cfg.memory, sd)
            r.validate(CLAIMS["random_skip"], n_nodes=topo.n)
            rand.append(simulate(r, topo, cost, contention=contention, dp_sync=dp_sync, record=False).iteration_s)
    return Comparison(scheds, results, planner_s, contention, dp_sync,
                      info={"stage_sizes": [len(p) for p in pl], "micro_batches": M, "nodes": topo.n,
                            "topology": topo.name, "planner_meta": planned.meta.get("planner", {})},
                      random_skip_s=rand)


def format_table(cols: dict[str, dict[str, float]], baseline: str = "full_pipeline") -> str:
    """A text table: one row per method, per column the iteration time and its ratio to
    ``baseline`` (``cols`` maps a column title to {method: iteration_s})."""
    methods = []
    for c in cols.values():
        for m in c:
            if m not in methods:
                methods.append(m)
    w = max([22] + [len(m) + 2 for m in methods])
    head = f"{'method':<{w}}" + "".join(f"{t:>14}{'x ' + baseline[:4]:>10}" for t in cols)
    lines = [head, "-" * len(head)]
    for m in methods:
        row = f"{m:<{w}}"
        for c in cols.values():
            v = c.get(m)
            b = c.get(baseline)
            row += f"{v:>14.1f}" if v is not None else f"{'-':>14}"
            row += f"{v / b:>10.3f}" if v is not None and b else f"{'-':>10}"
        lines.append(row)
    return "\n".join(lines)
