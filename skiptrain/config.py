"""Typed configuration: dataclass sections, TOML files, named presets, CLI overrides.

A run's configuration is one :class:`Config` made of sections (``model``, ``data``, ``train``,
...).  Every field can be set three ways, later ones winning:

1. a named preset (``tiny`` for tests, ``small`` for the default run),
2. a TOML file (``[model]\\nd_model = 256``),
3. ``--set section.field=value`` on the command line.

Every value is checked: an unknown section or key, a value of the wrong type, or one outside its
allowed range is a :class:`ConfigError` whose message names the key and what is allowed.

Fields declare their constraints through ``field(metadata=...)``: ``min``, ``max``, ``choices``
and ``help``.  Every float must be finite (``nan`` and ``inf`` are refused, whatever the source).  Other subsystems add their own section dataclass and a field on :class:`Config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the key and how to fix it."""


def _f(default: Any, help: str = "", **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


#: The longest timeout a run takes, in seconds (about 11 days; the process groups' timedelta
#: overflows near 1e14 s).
MAX_TIMEOUT_S = 1e6


@dataclass
class ModelConfig:
    vocab_size: int = _f(4096, "tokenizer vocabulary size (set by the data set's manifest)", min=2, max=2**24)
    d_model: int = _f(256, "width of the residual stream", min=8, max=65536)
    n_layers: int = _f(8, "number of transformer layers in total", min=1, max=1024)
    n_heads: int = _f(8, "attention heads", min=1, max=1024)
    n_kv_heads: int = _f(0, "key/value heads for grouped-query attention (0 = n_heads)", min=0, max=1024)
    ffn_hidden: int = _f(0, "SwiGLU hidden width (0 = 8/3 * d_model rounded up to 32)", min=0, max=2**20)
    seq_len: int = _f(256, "tokens per sample", min=2, max=2**20)
    n_stages: int = _f(4, "pipeline stages: stage 0 (embedding, first layers, head, loss) + body stages", min=1,
                       max=1024)
    stage0_layers: int = _f(-1, "layers held by stage 0 (-1 = chosen by the cost-model partitioner)", min=-1)
    rope_theta: float = _f(10000.0, "rotary embedding base", min=1.0)
    norm_eps: float = _f(1e-5, "RMSNorm epsilon", min=0.0)
    init_std: float = _f(0.02, "standard deviation of the weight initialisation", min=0.0)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        h = int(8 * self.d_model / 3)
        return (h + 31) // 32 * 32

    def check(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "choose n_heads that divides d_model")
        if self.head_dim % 2:
            raise ConfigError(f"model.d_model={self.d_model} / model.n_heads={self.n_heads} is a head dimension of "
                              f"{self.head_dim}, which must be even for rotary embeddings; choose d_model and n_heads "
                              "whose quotient is even")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.kv_heads}")
        if self.n_stages > self.n_layers + 1:
            raise ConfigError(
                f"model.n_stages={self.n_stages} needs at least {self.n_stages - 1} layers for the body "
                f"stages, but model.n_layers={self.n_layers}; lower n_stages or raise n_layers")
        if self.stage0_layers >= 0 and self.n_layers - self.stage0_layers < self.n_stages - 1:
            raise ConfigError(
                f"model.stage0_layers={self.stage0_layers} leaves too few layers for "
                f"{self.n_stages - 1} body stages")


@dataclass
class DataConfig:
    path: str = _f("data/shakespeare", "prepared data directory (from `skiptrain prepare`)")
    tokenizer: str = _f("auto", "`auto` (the data set's tokenizer) or `byte` (256 byte values, no files)",
                        choices=("auto", "byte"))


@dataclass
class TrainConfig:
    steps: int = _f(300, "optimizer steps (iterations)", min=0)
    micro_batch: int = _f(8, "samples per micro-batch", min=1, max=2**20)
    n_micro: int = _f(4, "micro-batches per iteration (global batch = micro_batch * n_micro)", min=1, max=2**20)
    lr: float = _f(3e-3, "peak learning rate", min=0.0)
    min_lr_frac: float = _f(0.1, "final learning rate as a fraction of the peak", min=0.0, max=1.0)
    warmup_steps: int = _f(30, "linear warm-up steps", min=0)
    weight_decay: float = _f(0.1, "decoupled weight decay (matrices only)", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = _f(0.95, "AdamW beta2", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "global gradient-norm clip (0 = off)", min=0.0)
    skip_ratio: float = _f(0.0, "SkipPipe skip ratio k: each micro-batch skips round(k * n_stages) body stages",
                           min=0.0, max=1.0)
    max_swaps: int = _f(0, "adjacent-stage swaps allowed per route (SkipPipe allows up to 2)", min=0, max=2)
    eval_every: int = _f(50, "validate every N steps (0 = only at the end)", min=0)
    eval_batches: int = _f(8, "micro-batches per validation", min=1)
    log_every: int = _f(1, "write a metrics line every N steps", min=1)
    seed: int = _f(1234, "seed for initialisation, data order and routes", min=0, max=2**32 - 1)
    threads: int = _f(0, "torch intra-op threads (0 = leave torch's default)", min=0)
    progress: bool = _f(True, "show a progress bar")
    precision: str = _f("fp32", "compute precision: fp32, or bf16 (autocast for forward and backward; "
                        "master weights, gradients and optimizer state stay fp32)", choices=("fp32", "bf16"))
    device: str = _f("auto", "device of the model and batches: auto (cuda when available, else cpu), cpu "
                     "or cuda", choices=("auto", "cpu", "cuda"))
    init_from: str = _f("", "a local Hugging Face LLaMA directory (config.json + safetensors) whose shapes and "
                        "weights start the run (empty = random initialisation)")


@dataclass
class DPConfig:
    """Data-parallel sync (skiptrain.dp): which strategy and its switches."""
    strategy: str = _f("allreduce", "sync strategy of a replica group",
                       choices=("allreduce", "allreduce_bf16", "powersgd", "diloco", "demo", "sparseloco"))
    chunk: int = _f(64, "DeMo, SparseLoCo: chunk edge (2-D chunks are chunk x chunk; 1-D chunks chunk elements)", min=1)
    topk: int = _f(32, "DeMo, SparseLoCo: coefficients kept per chunk", min=1)
    beta: float = _f(0.999, "DeMo momentum decay", min=0.0, max=1.0)
    dct: bool = _f(True, "DeMo: DCT the chunks (false = top-k in parameter space)")
    step_rule: str = _f("sign", "DeMo update from the decoded momentum: sign (DeMo: p -= lr sign(d)), rms "
                        "(p -= lr d / rms(d) per tensor: same RMS step, keeps relative magnitudes) or clip "
                        "(p -= lr clamp(d / rms(d), -1, 1): sign for large entries, less for small ones) or adam "
                        "(Adam with train.beta1/beta2 on d / lr, the decoded update read as a gradient)",
                        choices=("sign", "rms", "clip", "adam"))
    update_momentum: float = _f(0.0, "DeMo: momentum on the decoded (replica-identical) update, u = mu u + d, "
                                "stepped on instead of d; no extra bytes (0 = off, DeMo)", min=0.0, max=0.999)
    values: str = _f("fp32", "DeMo, SparseLoCo: value encoding (sign2: 2 bits; sign1c: 1-bit signs, one bf16 scale per chunk)",
                     choices=("fp32", "bf16", "sign1", "sign2", "sign1c"))
    indices: str = _f("int64", "DeMo, SparseLoCo: index encoding", choices=("int64", "u16", "u12"))
    sync_every: int = _f(1, "H: iterations per sync (DeMo: momentum accumulation; DiLoCo, SparseLoCo: local steps)",
                         min=1)
    ef_decay: float = _f(0.95, "SparseLoCo: decay of the error-feedback accumulator of pseudo-gradients", min=0.0,
                         max=1.0)
    powersgd_rank: int = _f(4, "PowerSGD rank", min=1)
    outer_lr: float = _f(0.7, "DiLoCo / SparseLoCo outer Nesterov learning rate", min=0.0)
    outer_momentum: float = _f(0.9, "DiLoCo / SparseLoCo outer Nesterov momentum", min=0.0, max=1.0)
    check_every: int = _f(50, "compare parameter hashes across replicas every K steps (0 = never)", min=0)
    backend: str = _f("gloo", "process-group backend of a swarm's replica sync: gloo (any device, any network) "
                      "or nccl (replicas on CUDA devices, e.g. inside one datacenter)", choices=("gloo", "nccl"))
    timeout_s: float = _f(60.0, "process-group timeout in seconds", min=1.0, max=MAX_TIMEOUT_S)
    link: str = _f("", "emulated link preset per node (skiptrain.dp.link.LINK_PRESETS): consumer = 10 Mbit/s up, "
                   "100 Mbit/s down, 25 ms; empty = the link_up_mbps / link_down_mbps / link_latency_ms fields",
                   choices=("", "consumer"))
    link_up_mbps: float = _f(0.0, "emulated upload per node, Mbit/s (0 = unlimited)", min=0.0)
    link_down_mbps: float = _f(0.0, "emulated download per node, Mbit/s (0 = unlimited)", min=0.0)
    link_latency_ms: float = _f(0.0, "emulated one-way latency per message, ms", min=0.0)

    def check(self) -> None:
        if self.link and (self.link_up_mbps or self.link_down_mbps or self.link_latency_ms):
            raise ConfigError(f"dp.link={self.link!r} is a preset; leave dp.link_up_mbps, dp.link_down_mbps and "
                              "dp.link_latency_ms at 0, or set dp.link='' to give the links by those fields")
        limit = {"int64": 2**63, "u16": 2**16, "u12": 2**12}[self.indices]
        if self.chunk * self.chunk > limit:
            raise ConfigError(f"dp.chunk={self.chunk} gives {self.chunk ** 2}-element chunks, too many for "
                              f"dp.indices={self.indices!r} (at most {limit}); lower dp.chunk or use wider indices")


@dataclass
class CheckpointConfig:
    """Periodic asynchronous checkpoints (skiptrain.checkpoint) of the trainer and of a swarm;
    resume with `train --resume` / `launch --resume`."""
    every: int = _f(100, "save a checkpoint every N steps (0 = never)", min=0)
    keep: int = _f(3, "committed checkpoints kept; older ones are deleted", min=1)
    dir: str = _f("", "checkpoint root (empty = RUN_DIR/checkpoints)")
    final: bool = _f(True, "also save when training finishes its steps")
    overlap: bool = _f(True, "copy the snapshot while the next forward/backward runs; "
                       "the loop blocks only if it reaches optimizer.step() before the copy is done")


@dataclass
class ElasticConfig:
    """Elastic pipelining by freezing (skiptrain.elastic); off unless ``enabled``."""
    enabled: bool = _f(False, "freeze converged bottom layers, repartition, cache the frozen prefix")
    alpha: float = _f(1 / 3, "geometric bound: frozen <= F + ceil(alpha * (freezable - F)) per window",
                      min=0.0, max=1.0)
    check_every: int = _f(25, "steps per freeze window (gradient norms averaged over a window)", min=1)
    tol: float = _f(0.1, "a layer counts as converged when its mean gradient norm changed by at most "
                    "this fraction between two windows", min=0.0)
    min_active: int = _f(2, "layers that never freeze (the top of the stack keeps training)", min=1)
    start_window: int = _f(2, "first window (1-based) at which freezing may happen", min=1)
    guard: bool = _f(True, "validation-loss guard: undo a freeze that made validation loss worse")
    guard_tol: float = _f(0.01, "undo the latest freeze when validation loss is this fraction above the "
                          "loss projected without freezing (cumulative over all freezes)", min=0.0)
    guard_delay: int = _f(2, "windows without freezing after an undo", min=0)
    guard_ref: int = _f(4, "unfrozen validation points fitted (a + b ln of the summed learning rate) for the "
                        "guard's projection", min=2)
    guard_min_ref: int = _f(2, "unfrozen validation points (after the learning-rate warm-up) needed before "
                            "anything freezes", min=2)
    guard_confirm: int = _f(1, "consecutive windows above the projection before the guard undoes a freeze "
                            "(each such window delays freezing)", min=1)
    stable_windows: int = _f(2, "consecutive windows a layer's gradient-norm change must stay <= tol", min=1)
    guard_batches: int = _f(4, "validation micro-batches per guard check", min=1)
    cache: str = _f("auto", "frozen-prefix activation cache: on, off, or auto (a run recomputes: a measurement "
                    "would differ between nodes; the elastic bench's one-process harness measures it)",
                    choices=("auto", "on", "off"))
    cache_mb: float = _f(1024.0, "activation cache size bound in MiB", min=0.0)
    prefill: bool = _f(True, "at a freeze, fill the cache for every training window at once when it fits "
                       "(forward only, data parallel; the prefix then leaves the training pipeline)")
    prefill_after_undo: int = _f(4, "windows after a guard undo in which a freeze fills the cache lazily instead "
                                 "(an undo discards a prefill: do not repeat it while freezing is unsettled)", min=0)
    prefill_hold: int = _f(1, "in a swarm: windows a new frozen depth must hold before its cache is prefilled "
                           "(the layout is then planned again with the prefix cached, when prefill_min_gain lets "
                           "it); until then the prefix is recomputed, so a freeze soon deepened or undone costs no "
                           "prefill (0 = prefill at the freeze)", min=0)
    cache_dir: str = _f("", "activation cache directory (empty = RUN_DIR/elastic_cache or a temp dir)")
    prefill_min_gain: float = _f(1.0, "in a swarm: a layout starts prefilled only when the iteration time the "
                                 "cached prefix is modelled to save until the end of the phase is at least this "
                                 "many times the prefill's (0 = whenever the cache is on and fits)", min=0.0)
    cache_share: str = _f("node", "in a swarm: one activation cache per node, or one per topology location "
                          "shared by its originators (they must share a file system: the location is a "
                          "machine), each window prefilled once per location", choices=("node", "location"))


#: The most node processes a run has (``runtime.nodes``).
MAX_NODES = 1024
#: The most nodes a topology is built for (the planner and the simulator; its matrices are n x n).
MAX_TOPOLOGY_NODES = 4096
#: The most micro-batches a stage-0 node starts per iteration (``runtime.mb_per_originator``): the
#: planner's time grows with them (about 7 s for 4,000 on the tiny preset).
MAX_MB_PER_ORIGINATOR = 4096
#: The most memory credits a node has (``runtime.memory``), as many as an originator may start per iteration:
#: each credit keeps one micro-batch's activations on the node, and 4096 of the tiny preset's already take
#: about 11 GiB a stage.
MAX_MEMORY_CREDITS = MAX_MB_PER_ORIGINATOR
#: The most emulated bytes per real byte (``runtime.bytes_scale``): a tiny model's 128 KiB hop as 8 GiB.
MAX_BYTES_SCALE = 2**16
#: The most emulated seconds per topology second (``runtime.time_scale``): a 100 ms link as 100 s.
MAX_TIME_SCALE = 1e3
#: The largest per-sample-per-layer or per-message time a cost model takes, in seconds.
MAX_TASK_S = 1e6
#: Per-task overhead (forward incl. loss, backward) the runtime shows on this machine, real seconds:
#: what ``bench/runtime_geo.py`` fitted from its measured timelines on 2026-11-28 (16 processes, time
#: scale 1/16; docs/benchmarks/runtime_geo.md), the default of ``runtime.task_fwd_s`` and
#: ``runtime.task_bwd_s``; ``skiptrain.schedule.cost.DEFAULT_TASK_S`` scales it to SkipPipe's units.
RUNTIME_TASK_S = (0.0044, 0.0)
#: The most strikes before a bad peer is banned (``runtime.strikes``): each strike re-runs the iteration with
#: the same nodes, so a node that keeps sending bad payloads holds the run on one iteration for up to this
#: many re-runs (a count it never reaches, such as 2**63, keeps it re-running until the launch's time limit).
MAX_STRIKES = 100


@dataclass
class RuntimeConfig:
    """Multi-process skip-pipeline runtime (skiptrain.runtime); used when ``nodes > 1`` or a run freezes."""
    nodes: int = _f(0, "node processes on this machine (0 or 1 = the single-process trainer; a run that freezes: "
                    "one node serving every stage)", min=0, max=MAX_NODES)
    stage_sizes: str = _f("", "nodes per stage, comma-separated, e.g. 3,2,2,2 (empty = by work)")
    node_stages: str = _f("", "the stages of each node, comma-separated, one entry per node, '+' joining the "
                          "stages of a node that serves several (one large device), e.g. 0,0,1+2,1+2,3 "
                          "(empty = placed by the planner or by stage_sizes)")
    method: str = _f("planner", "how routes are made", choices=("planner", "full_pipeline", "random_skip"))
    memory: int = _f(3, "micro-batches in flight per node (memory credits); at most 4096, as many as an "
                     "originator may start per iteration: each keeps a micro-batch's activations on the node "
                     "(4096 of the tiny preset's take about 11 GiB a stage)", min=1, max=MAX_MEMORY_CREDITS)
    mb_per_originator: int = _f(2, "micro-batches per stage-0 node per iteration", min=1, max=MAX_MB_PER_ORIGINATOR)
    topology: str = _f("cluster", "network the schedule is planned for (and emulated with wan=true)")
    wan: bool = _f(False, "emulate the topology's links (per-link FIFO, latency, bandwidth) in the transport")
    time_scale: float = _f(1.0, "emulated seconds per topology second (latency x, bandwidth /)", min=1e-6,
                           max=MAX_TIME_SCALE)
    bytes_scale: int = _f(1, "emulated bytes per real byte on emulated links and in the cost model", min=1,
                          max=MAX_BYTES_SCALE)
    hop_overhead_s: float = _f(0.0, "fixed emulated seconds per message (after time scaling)", min=0.0,
                               max=MAX_TASK_S)
    task_fwd_s: float = _f(RUNTIME_TASK_S[0], "cost model: fixed seconds per forward task and per loss (start, "
                           "header, dispatch; the runtime pays its own, it is not emulated)", min=0.0, max=MAX_TASK_S)
    task_bwd_s: float = _f(RUNTIME_TASK_S[1], "cost model: fixed seconds per backward task", min=0.0,
                           max=MAX_TASK_S)
    emulate_compute: bool = _f(False, "pad every forward/backward/loss to the cost model's compute")
    s_per_sample_layer: float = _f(0.0, "cost model: forward seconds per sample per layer (0 = profile)", min=0.0,
                                   max=MAX_TASK_S)
    timeout_s: float = _f(30.0, "peer / message / group timeout in seconds", min=0.5, max=MAX_TIMEOUT_S)
    heartbeat_s: float = _f(0.5, "heartbeat interval in seconds", min=0.05)
    plan_seed: int = _f(0, "seed of the planner and the random baselines")
    recover: bool = _f(False, "survive failed nodes: fence, re-plan, go on; nodes may join (--join)")
    heartbeat_deadline_s: float = _f(0.0, "recover: a node without heartbeat this long is hung (0 = timeout_s)",
                                     min=0.0, max=MAX_TIMEOUT_S)
    lease_max_s: float = _f(60.0, "recover: the longest a node's lease may grow to on slow links (its floor is "
                            "heartbeat_deadline_s); a node that cannot renew stops its own work within its lease",
                            min=0.0, max=MAX_TIMEOUT_S)
    strikes: int = _f(1, "recover: rejected payloads (bad shape/dtype/non-finite) from a node before it is banned; "
                      f"at most {MAX_STRIKES}: each one re-runs the iteration with the same nodes, so a node that "
                      "keeps sending bad payloads holds the run on one iteration this many times", min=1,
                      max=MAX_STRIKES)
    takeover: bool = _f(False, "recover: a replica of the most replicated body stage takes over a stage left empty")
    min_nodes: int = _f(0, "recover: below this many live nodes training pauses at an iteration boundary until "
                        "joining nodes bring the swarm back to it (0 = never pause)", min=0, max=MAX_NODES)
    ckpt_max_age: int = _f(10, "recover: the job's checkpoint, when at most this many iterations old, "
                           "initialises a stage left without replicas (older: CheckFree from the neighbours)", min=0)
    act_codec: str = _f("fp32", "encoding of activations and their gradients on slow links: fp32, bf16, int8 or "
                        "int4 (one scale per row); other links carry the compute precision's (fp32, or bf16 "
                        "under train.precision=bf16), as does every link when this is fp32; the one-process "
                        "trainer applies it to every hop", choices=("fp32", "bf16", "int8", "int4"))
    act_fast_GBps: float = _f(1.0, "links at least this fast (GiB/s, in the emulated topology) carry the compute "
                              "precision's encoding (fp32 or bf16)", min=0.0)
    dp_topology: str = _f("auto", "shape of the dense DP sum over a stage's replicas, in the cost model and the "
                          "emulated runtime: flat (one ring), hierarchical (rings in each region of the topology, "
                          "one ring per shard across regions, rings in each region) or auto (the faster per stage)",
                          choices=("flat", "hierarchical", "auto"))
    restartable: bool = _f(False, "recover: the store process (its own in every recover run) and the nodes "
                           "outlive the launcher, so a dead coordinator can be replaced "
                           "(`python -m skiptrain.runtime.coordinator_restart --run RUN_DIR`)")
    coordinator_wait_s: float = _f(300.0, "recover, store in a process of its own (runs across hosts, --restartable): "
                                   "how long the nodes train on without a coordinator; past it, they stop at an "
                                   "iteration boundary and the run resumes from its last committed checkpoint "
                                   "(0 = wait for ever)", min=0.0, max=MAX_TIMEOUT_S)
    drift_alpha: float = _f(0.3, "moving-average weight of the drift measurements", min=0.0, max=1.0)
    drift_threshold: float = _f(0.0, "re-plan the routes on measured compute/link times when the measured "
                                "iteration time exceeds the planned one by this fraction (0 = off)", min=0.0)
    devices: str = _f("", "device of each node, comma-separated, one per node (cpu, cuda, cuda:N, auto), e.g. "
                      "cuda:0,cuda:0,cuda:1,cpu; empty = train.device, with cuda meaning cuda:LOCAL_RANK modulo "
                      "the GPUs a node sees")

    def check(self) -> None:
        if 0 < self.coordinator_wait_s < 4 * self.heartbeat_s:
            raise ConfigError(f"runtime.coordinator_wait_s={self.coordinator_wait_s:g} is shorter than 4 heartbeats "
                              f"(runtime.heartbeat_s={self.heartbeat_s:g}): a coordinator that is only busy would be "
                              f"taken for gone; give 0 (wait for ever) or at least {4 * self.heartbeat_s:g}")
        if self.nodes and self.min_nodes > self.nodes:
            raise ConfigError(f"runtime.min_nodes={self.min_nodes} is more than runtime.nodes={self.nodes}: the "
                              "run could never start training; give at most the nodes it is planned for")
        devs = node_devices(self.devices)
        if devs and self.nodes and len(devs) != self.nodes:
            raise ConfigError(f"runtime.devices lists {len(devs)} device(s) for runtime.nodes={self.nodes}; "
                              "list one device per node, or leave it empty to use train.device")


def node_stage_lists(text: str) -> list[list[int]]:
    """``runtime.node_stages`` as the stages of each node (empty: not given); syntax only."""
    out = []
    for entry in (e.strip() for e in text.split(",")) if text.strip() else ():
        try:
            stages = [int(x) for x in entry.split("+")]
        except ValueError:
            raise ConfigError(f"runtime.node_stages entry {entry!r} is not a stage or '+'-joined stages; write "
                              "one entry per node, e.g. 0,0,1+2,1+2,3") from None
        if len(set(stages)) != len(stages) or min(stages) < 0:
            raise ConfigError(f"runtime.node_stages entry {entry!r} lists a stage twice or a negative stage; "
                              "list each stage of a node once, e.g. 1+2")
        out.append(sorted(stages))
    return out


def node_stage_placement(text: str, n_stages: int) -> list[list[int]] | None:
    """The placement ``runtime.node_stages`` gives (node ids of each stage, ascending; None when
    not given), checked: every stage exists and has a node, a node serving several stages serves
    consecutive ones (so micro-batches never wait on each other for its memory credits:
    ``schedule.keep_on_node``), and the nodes listed before it are the same in each of them, so it
    holds the same replica position (its checkpoint slot) in each, also after any node fails."""
    per_node = node_stage_lists(text)
    if not per_node:
        return None
    for ss in per_node:
        if ss != list(range(ss[0], ss[-1] + 1)):
            raise ConfigError(f"runtime.node_stages entry {'+'.join(map(str, ss))!r}: a node serves consecutive "
                              f"stages (e.g. {ss[0]}+{ss[0] + 1}), so that micro-batches never wait on each other "
                              "for its memory; list other stages on other nodes")
    bad = sorted({s for ss in per_node for s in ss if s >= n_stages})
    if bad:
        raise ConfigError(f"runtime.node_stages names stage(s) {bad}, but model.n_stages={n_stages}; use stages "
                          f"0..{n_stages - 1}")
    placement = [[n for n, ss in enumerate(per_node) if s in ss] for s in range(n_stages)]
    empty = [s for s, p in enumerate(placement) if not p]
    if empty:
        raise ConfigError(f"runtime.node_stages gives stage(s) {empty} no node; list each stage on at least one node")
    for n, ss in enumerate(per_node):
        before = {frozenset(placement[s][:placement[s].index(n)]) for s in ss}
        if len(before) > 1:
            slots = sorted({placement[s].index(n) for s in ss})
            raise ConfigError(f"runtime.node_stages: node {n} comes after different nodes in its stages {ss} "
                              f"(replica {slots}); a node serving several stages must hold the same position "
                              "among each stage's nodes, also when others fail: list the nodes that serve "
                              "several stages first, in the same order, e.g. 0,0,1+2,1+2,1,2 (two such nodes that "
                              "share a stage serve the same stages: not 1+2 beside 2+3)")
    return placement


def node_devices(text: str) -> list[str]:
    """``runtime.devices`` as a list (empty: none given); each entry auto, cpu, cuda or cuda:N."""
    devs = [d.strip() for d in text.split(",")] if text.strip() else []
    for d in devs:
        if d not in ("auto", "cpu", "cuda") and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise ConfigError(f"runtime.devices entry {d!r} is not a device; use auto, cpu, cuda or cuda:N "
                              "(e.g. cuda:0,cuda:1)")
    return devs


def skip_count(skip_ratio: float, n_stages: int) -> int:
    """Body stages each micro-batch skips for skip ratio ``k`` and ``n_stages`` stages in total."""
    if not 0.0 <= skip_ratio <= 1.0:
        raise ConfigError(f"skip ratio {skip_ratio} must lie in [0, 1]")
    n = int(skip_ratio * n_stages + 0.5)
    body = n_stages - 1
    if n and body == 0:
        raise ConfigError(f"skip ratio {skip_ratio} with {n_stages} stage: there is no body stage to skip; "
                         "use skip ratio 0 or more stages")
    if n and n >= body:
        # round(k * S) <= body - 1  <=>  k * S + 0.5 < body  <=>  k < (body - 0.5) / S
        raise ConfigError(
            f"skip ratio {skip_ratio} with {n_stages} stages skips {n} of the {body} body stages, leaving "
            f"routes that train no body stage; use a skip ratio below {(body - 0.5) / n_stages:.4g}")
    return n



@dataclass
class LogConfig:
    """What a run writes for watching it, besides metrics.jsonl (docs/dashboard.md)."""
    tensorboard: bool = _f(False, "write TensorBoard event files to RUN_DIR/tensorboard while the run goes on "
                           "(needs the tensorboard extra: pip install 'skiptrain[tensorboard]')")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def check(self) -> "Config":
        for sec in dataclasses.fields(self):
            section = getattr(self, sec.name)
            for f in dataclasses.fields(section):
                _check_value(f"{sec.name}.{f.name}", f, getattr(section, f.name))
            if hasattr(section, "check"):
                section.check()
        self._check_skip_ratio()
        self._check_node_stages()
        return self

    def _check_node_stages(self) -> None:
        """``runtime.node_stages`` against the other settings (one-line refusals naming the fix)."""
        rt = self.runtime
        placement = node_stage_placement(rt.node_stages, self.model.n_stages)
        if placement is None:
            return
        n = len(node_stage_lists(rt.node_stages))
        if rt.nodes and n != rt.nodes:
            raise ConfigError(f"runtime.node_stages lists {n} node(s) for runtime.nodes={rt.nodes}; give one entry "
                              "per node")
        if rt.stage_sizes.strip():
            raise ConfigError("runtime.node_stages and runtime.stage_sizes both place the nodes; set only one")

    def _check_skip_ratio(self) -> None:
        """Every route must visit at least one body stage (:func:`skip_count`)."""
        try:
            skip_count(self.train.skip_ratio, self.model.n_stages)
        except ConfigError as e:
            raise ConfigError(f"train.skip_ratio={self.train.skip_ratio} with model.n_stages="
                              f"{self.model.n_stages}: {e}") from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# presets

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # For tests: a few seconds of CPU, byte tokenizer friendly.
    "tiny": {
        "model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                  "seq_len": 64, "n_stages": 4, "stage0_layers": 1},
        "train": {"steps": 40, "micro_batch": 8, "n_micro": 2, "lr": 3e-3, "warmup_steps": 5,
                  "eval_every": 20, "eval_batches": 4},
    },
    # The embedded default run: about 10 minutes on a 2-core CPU.
    "small": {
        "model": {"vocab_size": 4096, "d_model": 256, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4,
                  "seq_len": 128, "n_stages": 4},
        "train": {"steps": 300, "micro_batch": 8, "n_micro": 4, "lr": 2e-3, "warmup_steps": 30,
                  "eval_every": 100, "eval_batches": 16},
    },
    # Real sizes in LLaMA shapes (32k vocabulary, untied head, SwiGLU, RoPE), for GPUs:
    # 134M parameters (GPT-3 Small / OPT-125m width and depth).
    "125m": {
        "model": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12,
                  "ffn_hidden": 2048, "seq_len": 2048, "n_stages": 4},
        "train": {"steps": 5000, "micro_batch": 8, "n_micro": 8, "lr": 6e-4, "warmup_steps": 200,
                  "eval_every": 500, "eval_batches": 16, "precision": "bf16"},
    },
    # 372M parameters (GPT-3 Medium width and depth, LLaMA FFN).
    "350m": {
        "model": {"vocab_size": 32000, "d_model": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 16,
                  "ffn_hidden": 2816, "seq_len": 2048, "n_stages": 6},
        "train": {"steps": 5000, "micro_batch": 4, "n_micro": 16, "lr": 3e-4, "warmup_steps": 300,
                  "eval_every": 500, "eval_batches": 16, "precision": "bf16"},
    },
    # 1.10B parameters (LLaMA 3.2 1B layer shapes: 16 layers, 32 heads, 8 key/value heads).
    "1b": {
        "model": {"vocab_size": 32000, "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                  "ffn_hidden": 8192, "seq_len": 2048, "n_stages": 8},
        "train": {"steps": 5000, "micro_batch": 2, "n_micro": 32, "lr": 2e-4, "warmup_steps": 500,
                  "eval_every": 500, "eval_batches": 16, "precision": "bf16"},
    },
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


# --------------------------------------------------------------------------------------------
# building and checking


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (from TOML or a CLI string) to field type ``tp`` or raise ConfigError."""
    if isinstance(tp, str):  # postponed annotations
        tp = {"int": int, "float": float, "str": str, "bool": bool}.get(tp, tp)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (elem,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(key, elem, v) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def _check_value(key: str, f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} is not a finite number; give a finite value "
                          f"(default {f.default!r})")
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {allowed}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{key}={value!r} is below its minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{key}={value!r} is above its maximum {meta['max']}")


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; allowed: {', '.join(options)}"


#: Keys a config no longer has: (the value they had by default, what to do instead).  A saved
#: config (a run's, a checkpoint's, a job's) still holds them and loads with them ignored, as
#: does any config with the old default; another value is refused in one line.
RETIRED_KEYS = {"elastic.nodes": (0, "a run freezes on its real nodes (one process: a swarm of one node); "
                                     "remove it")}


def apply_dict(cfg: Config, values: dict[str, Any], source: str = "config") -> Config:
    """Merge a ``{section: {key: value}}`` mapping into ``cfg`` in place, checking every key
    (:data:`RETIRED_KEYS` are skipped or refused)."""
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for sec_name, sec_values in values.items():
        if sec_name not in sections:
            raise ConfigError(f"{source}: unknown section [{sec_name}]" + _suggest(sec_name, list(sections)))
        if not isinstance(sec_values, dict):
            raise ConfigError(f"{source}: [{sec_name}] must be a table of key = value lines")
        section = getattr(cfg, sec_name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        for key, value in sec_values.items():
            full = f"{sec_name}.{key}"
            if full in RETIRED_KEYS and key not in fields:
                default, fix = RETIRED_KEYS[full]
                if source != "saved config" and str(value) != str(default):
                    raise ConfigError(f"{source}: {full} is retired: {fix}")
                continue
            if key not in fields:
                raise ConfigError(f"{source}: unknown key {full!r}" + _suggest(key, list(fields)))
            f = fields[key]
            v = _coerce(full, f.type, value)
            _check_value(full, f, v)
            setattr(section, key, v)
    return cfg


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["model.d_model=128", ...]`` into a nested mapping (values stay strings)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set model.d_model=128")
        key, value = item.split("=", 1)
        sec, name = key.strip().split(".", 1)
        out.setdefault(sec, {})[name] = value.strip()
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass a TOML file (e.g. RUN_DIR/config.toml)")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing TOML file")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8 TOML") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None


def build_config(preset: str | None = None, toml_path: str | Path | None = None,
                 overrides: list[str] | dict[str, dict[str, Any]] | None = None) -> Config:
    """Preset, then TOML file, then overrides; the result is fully checked."""
    cfg = Config()
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}" + _suggest(preset, preset_names()))
        apply_dict(cfg, PRESETS[preset], source=f"preset {preset!r}")
    if toml_path is not None:
        apply_dict(cfg, load_toml(toml_path), source=str(toml_path))
    if overrides:
        if isinstance(overrides, list):
            overrides = parse_overrides(overrides)
        apply_dict(cfg, overrides, source="--set")
    return cfg.check()


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a config saved with :meth:`Config.to_dict` (e.g. from a run directory)."""
    return apply_dict(Config(), values, source="saved config").check()


def save_toml(cfg: Config, path: str | Path) -> None:
    import tomli_w

    Path(path).write_text(tomli_w.dumps(cfg.to_dict()))
