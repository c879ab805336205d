"""What a multi-process run executes: a :class:`Job` of one or more :class:`Phase` s.

A job is plain JSON (written by the launcher next to the run, read by every node), so the same
file drives a local swarm and a multi-host ``torchrun`` run.  Each phase is an independent
experiment on the same processes: it has its own schedule (placement + routes; node ids are
ranks), cost model, optional WAN emulation and number of iterations; every node rebuilds its
stage's parameters from the run seed and restarts the data cursor at 0.  (The bench runs the
full pipeline, random skipping and the planner as three phases of one launch.)

Data.  Micro-batch ``id`` ``i`` (ids ranked 0..M-1) of an iteration takes the global samples
``cursor + i * micro_batch ... + micro_batch - 1`` of the training split
(:class:`~skiptrain.data.loader.SampleSource` seeded by ``train.seed``); the cursor advances by
``M * micro_batch`` per iteration.  That is exactly the order in which the single-process
:class:`~skiptrain.train.trainer.Trainer` slices its global batch, so with the same routes both
compute the same thing.

:func:`build_cost` and :func:`build_schedule` turn a :class:`~skiptrain.config.Config` (its
``runtime`` section) into the cost model and schedule of a phase.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, RuntimeConfig, config_from_dict, node_stage_lists, node_stage_placement
from ..net.topology import Topology, load_topology
from ..schedule.actcodec import plain_codec
from ..schedule.baselines import data_parallel, full_pipeline, random_skip
from ..schedule.cost import CostModel, layer_params, profile_s_per_sample_per_layer
from ..schedule.placement import stage_sizes as sizes_by_work
from ..schedule.planner import PlanConfig, plan
from ..schedule.schedule import Schedule
from .wan import scale_topology


@dataclass
class EmulationSpec:
    """What a phase emulates on one machine (:mod:`skiptrain.runtime.emulation` carries it out)."""
    links: bool = False          # the pipeline's messages on ``topology``'s links (per-link FIFOs)
    compute: bool = False        # every task padded to the cost model's duration at the node's speed
    sync: bool = False           # replica groups' collectives delayed as rings on ``topology``'s links
    bytes_scale: float = 1.0     # emulated bytes per real byte


@dataclass
class Phase:
    name: str
    schedule: dict[str, Any]
    iterations: int = 1
    cost: dict[str, Any] | None = None        # CostModel.to_dict(): emulated durations, sync bytes
    topology: dict[str, Any] | None = None    # Topology.to_dict() of the (time-scaled) network
    emulation: EmulationSpec | None = None    # None: nothing emulated (a real deployment)
    dump: bool = False                        # write parameters and pre-sync gradients (tests)
    save_weights: bool = False                # first replica of each stage writes its tensors
    config: dict[str, Any] | None = None      # {section: {key: value}} over the job's config for this phase


#: a phase's emulation settings as job files before ``EmulationSpec`` named them
LEGACY_EMULATION = {"wan": "links", "emulate_compute": "compute", "emulate_sync": "sync", "bytes_scale": "bytes_scale"}


def phase_from_dict(p: dict[str, Any]) -> Phase:
    """A :class:`Phase` from its JSON (a job file written before ``EmulationSpec`` too)."""
    p = dict(p)
    legacy = {new: p.pop(old) for old, new in LEGACY_EMULATION.items() if old in p}
    spec = p.pop("emulation", None) or (legacy or None)
    return Phase(**p, emulation=EmulationSpec(**spec) if spec else None)


@dataclass
class Job:
    config: dict[str, Any]
    data_path: str
    run_dir: str
    phases: list[Phase]
    node_module: str = "skiptrain.runtime.node"   # what the launcher runs per node (tests: a fault-injecting wrapper)
    meta: dict[str, Any] = field(default_factory=dict)
    # continue from a checkpoint: runtime.job_checkpoint.resume_point() {path, phase, iteration, cursor}
    resume: dict[str, Any] | None = None

    @functools.cached_property
    def rt(self) -> RuntimeConfig:
        """The job's runtime settings: the ``runtime`` section of its config, the one place they
        live (timeouts, heartbeats, recovery, stage checkpoints, drift re-planning, ...)."""
        return config_from_dict(self.config).runtime

    @property
    def run_id(self) -> str:
        """The run's id (a run resumed from a checkpoint gets a new one; a coordinator taking a live
        run over keeps it): uploads to the coordinator are signed for it."""
        return str(self.meta.get("run_id", "run"))

    @property
    def world(self) -> int:
        return max(max(Schedule.from_dict(p.schedule).nodes(), default=-1) + 1 for p in self.phases)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        d = dict(d)
        d["phases"] = [phase_from_dict(p) for p in d["phases"]]
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict()))
        return p

    @classmethod
    def load(cls, path: str | Path) -> "Job":
        return cls.from_dict(json.loads(Path(path).read_text()))


def with_runtime(config: dict[str, Any], **runtime: Any) -> dict[str, Any]:
    """A copy of the config dict ``config`` with ``runtime`` fields replaced (checked by name)."""
    out = {k: dict(v) for k, v in config.items()}
    known = {f.name for f in dataclasses.fields(RuntimeConfig)}
    bad = sorted(set(runtime) - known)
    if bad:
        raise ConfigError(f"unknown runtime setting(s) {bad}; see skiptrain.config.RuntimeConfig")
    out.setdefault("runtime", {}).update(runtime)
    return out


def parse_sizes(text: str) -> list[int] | None:
    if not text.strip():
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"runtime.stage_sizes={text!r}: expected comma-separated integers, e.g. 3,2,2,2") from None


def build_cost(cfg: Config, s_per_sample_layer: float | None = None, dp_mode: str = "dense") -> CostModel:
    """The cost model of ``cfg.model`` with the real layer partition, in emulated units:
    ``bytes_scale`` emulated bytes per real byte (activations and gradients), forward seconds
    per sample per layer from ``runtime.s_per_sample_layer`` (or measured here when 0)."""
    from ..model.partition import partition_layers

    m, rt = cfg.model, cfg.runtime
    part = partition_layers(m)
    layers = list(part.counts)
    per_layer = layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim)
    params = [n * per_layer for n in layers]
    params[0] += 2 * m.vocab_size * m.d_model + m.d_model
    spl = s_per_sample_layer if s_per_sample_layer is not None else rt.s_per_sample_layer
    if not spl:
        spl = profile_s_per_sample_per_layer(m.d_model, m.seq_len, m.n_heads, m.hidden)
    return CostModel(d_model=m.d_model, tokens_per_sample=m.seq_len, samples=cfg.train.micro_batch,
                     dtype_bytes=4 * rt.bytes_scale, layers_per_stage=layers, s_per_sample_per_layer=spl,
                     hop_overhead_s=rt.hop_overhead_s, params_per_stage=params,
                     fwd_task_s=rt.task_fwd_s, bwd_task_s=rt.task_bwd_s,
                     grad_dtype_bytes=4 * rt.bytes_scale, dp_mode=dp_mode, act_codec=rt.act_codec,
                     act_fast_GBps=rt.act_fast_GBps, byte_scale=float(rt.bytes_scale), dp_topology=rt.dp_topology,
                     act_plain=plain_codec(cfg.train.precision))


def build_topology(cfg: Config, n_nodes: int) -> Topology:
    """``runtime.topology`` with ``n_nodes`` nodes, time-scaled by ``runtime.time_scale``."""
    return scale_topology(load_topology(cfg.runtime.topology, n_nodes, seed=cfg.runtime.plan_seed),
                          cfg.runtime.time_scale)


def build_schedule(cfg: Config, method: str, topo: Topology, cost: CostModel,
                   contention: bool = True, dp_sync: bool = True,
                   placement: list[list[int]] | None = None) -> Schedule:
    """One iteration's schedule for ``method`` (planner, full_pipeline, random_skip) on ``topo``.

    The skip methods use ``train.skip_ratio`` and ``train.max_swaps``; random skipping reuses
    ``placement`` (normally the planner's) when given.  ``runtime.node_stages``, when set, is the
    placement of every method.  The full pipeline processes the same
    global batch (``mb_per_originator`` x the skip placement's stage-0 nodes) on fixed lanes."""
    rt, S = cfg.runtime, cfg.model.n_stages
    fixed = node_stage_placement(rt.node_stages, S)      # the user's placement, when given
    if fixed is not None:
        n = len(node_stage_lists(rt.node_stages))
        if n != topo.n:
            raise ConfigError(f"runtime.node_stages lists {n} node(s) for {topo.n} node(s); give one entry per node")
        placement = fixed
    sizes = parse_sizes(rt.stage_sizes)
    if sizes is not None and (len(sizes) != S or sum(sizes) != topo.n):
        raise ConfigError(f"runtime.stage_sizes={rt.stage_sizes!r} must list {S} stage sizes summing to "
                          f"runtime.nodes={topo.n}")
    k = cfg.train.skip_ratio
    pc = PlanConfig(n_stages=S, stage_sizes=sizes, skip_ratio=k, max_swaps=cfg.train.max_swaps,
                    memory=rt.memory, mb_per_originator=rt.mb_per_originator, seed=rt.plan_seed,
                    contention=contention, dp_sync=dp_sync, placement=placement)
    if method == "planner":
        return plan(topo, cost, pc)
    skip_sizes = [len(p) for p in fixed] if fixed else sizes or sizes_by_work(topo.n, S, k, cost)
    n_micro = skip_sizes[0] * rt.mb_per_originator
    if method == "full_pipeline":
        full_sizes = skip_sizes if fixed else sizes or sizes_by_work(topo.n, S, 0.0, cost)
        return full_pipeline(topo, cost, full_sizes, n_micro, rt.memory, dp_sync=dp_sync, seed=rt.plan_seed,
                             placement=fixed)
    if method == "random_skip":
        if placement is None:
            placement = plan(topo, cost, PlanConfig(**{**pc.__dict__, "max_evals": 0, "constructions": 0})).placement
        return random_skip(topo, cost, placement, rt.mb_per_originator, k, rt.memory, seed=rt.plan_seed)
    raise ConfigError(f"unknown runtime.method {method!r}; choose planner, full_pipeline or random_skip")


def phase_for(cfg: Config, schedule: Schedule, topo: Topology, cost: CostModel, name: str,
              iterations: int, **kw: Any) -> Phase:
    """A phase running ``schedule``; what it emulates from ``cfg.runtime`` (``wan``,
    ``emulate_compute``, ``bytes_scale``) unless given (``wan``, ``emulate_compute``,
    ``emulate_sync`` keywords)."""
    rt = cfg.runtime
    emulation = EmulationSpec(links=kw.pop("wan", rt.wan), compute=kw.pop("emulate_compute", rt.emulate_compute),
                              sync=kw.pop("emulate_sync", False), bytes_scale=float(rt.bytes_scale))
    return Phase(name=name, schedule=schedule.to_dict(), iterations=iterations, cost=cost.to_dict(),
                 topology=topo.to_dict(), emulation=emulation, **kw)


def data_parallel_phase(cfg: Config, name: str, nodes: int, **kw: Any) -> Phase:
    """A phase of plain data parallelism under its own config: ``nodes`` replicas of the whole
    model (``model.n_stages`` must be 1), ``train.n_micro`` micro-batches per iteration dealt over
    them, ``train.steps`` iterations, the sync strategy of ``cfg.dp``."""
    if cfg.model.n_stages != 1:
        raise ConfigError(f"data parallelism alone trains one stage holding the whole model; got "
                          f"model.n_stages={cfg.model.n_stages}: set model.n_stages=1")
    return Phase(name=name, schedule=data_parallel(nodes, cfg.train.n_micro).to_dict(), iterations=cfg.train.steps,
                 config=cfg.to_dict(), **kw)
