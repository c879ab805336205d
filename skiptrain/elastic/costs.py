"""What an elastic run's layouts cost, in the simulator: memory, iteration time, transitions.

The modelling side of the elastic benchmark (``bench/elastic.py``), so that the elastic run on
one machine and the same decisions at paper scale are costed by one library model:

* :class:`Scale`: per-sample costs (forward per layer, backward factor, head, cache read,
  optimizer) and a device-memory rule (:func:`sim_memory`, or AutoPipe's stage budget);
* :func:`iteration`: seconds of one iteration of a layout (stages x replicas x micro-batches,
  frozen depth, cache hit fraction), by the event simulator on 1F1B lanes with each stage's
  ring all-reduce of its active parameters;
* :func:`sweep`: every static layout of ``n_dev`` devices; :func:`elastic_times`: per-step
  seconds of an elastic run following a freeze schedule, with AutoPipe re-partitioning, AutoDP
  replicas and the transitions' wire time (:func:`transfer_seconds`, planned by the layout core);
* :func:`paper_scale` (PipeTransformer's testbed: 32 layers d=2048 on 16 GPUs) and
  :func:`small_scale` (a real run's model with costs measured on this machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..layout import Layout
from ..layout.transfer import transfer_plan
from ..model.partition import Partition, head_flops_per_token, layer_flops_per_token
from ..net.topology import from_spec
from ..schedule.baselines import full_pipeline
from ..schedule.cost import CostModel, layer_params
from ..schedule.simulator import simulate
from .repartition import autopipe, embedding_units, split, stage0_units, stage_memory

N_DEV = 16                      # devices of both scales (PipeTransformer's 2 machines x 8 GPUs)
MICROS = (1, 2, 4, 8, 16)       # micro-batch counts AutoPipe's profiling tries



@dataclass
class Scale:
    """Costs and memory of one half: per-sample seconds, device memory rule, global batch."""
    name: str
    model: ModelConfig
    global_batch: int
    fwd_s: float              # one layer's forward, per sample
    backward_factor: float    # backward / forward
    head_s: float             # norm + logits + loss, forward + backward, per sample
    read_s: float             # one cached row, per sample
    opt_s_per_param: float
    dtype_bytes: int
    start_stages: int = 0     # >0: memory budget = largest stage of this many all-active stages (AutoPipe units)
    dev_mem: float = 0.0      # else: bytes per device under sim_memory

    @property
    def units(self) -> tuple[float, float]:
        """Stage 0's extra (compute in forward-layer units from these costs, memory in layer units)."""
        return self.head_s / self.fwd_s, stage0_units(self.model)[1]

    def fits(self, counts, frozen, b, in_flight) -> bool:
        c0, m0 = self.units
        if self.start_stages:
            start = split(self.model.n_layers, 0, self.start_stages, False, c0, self.backward_factor) \
                if self.start_stages > 1 \
                else [self.model.n_layers]
            e0 = embedding_units(self.model)
            return (max(stage_memory(counts, frozen, m0, embedding_memory=e0))
                    <= max(stage_memory(start, 0, m0)) + 1e-9)
        return sim_memory(counts, frozen, b, in_flight, self.model) <= self.dev_mem


def sim_memory(counts, frozen, b, in_flight, m) -> float:
    """Peak bytes of the largest stage: 16 B/param for active layers (weights, grads, Adam), 1/6
    of that for frozen ones, activations ~ 16 floats/token/layer per micro-batch in flight."""
    P = layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim)
    act = b * m.seq_len * m.d_model * 4 * 16
    worst, start = 0.0, 0
    for s, c in enumerate(counts):
        nf = max(0, min(c, frozen - start))
        mem = nf * 16 * P / 6 + (c - nf) * (16 * P + act * in_flight)
        if s == 0:  # head (trains) + embedding (frozen with the first layer)
            emb = m.vocab_size * m.d_model * 16
            mem += emb + (emb / 6 if frozen else emb) + act * in_flight * 2
        worst = max(worst, mem)
        start += c
    return worst


def sim_topology():
    """PipeTransformer's testbed network: 2 machines x 8 GPUs, 25 Gbit/s between the machines."""
    spec = {"name": "2x8", "locations": ["m0", "m1"],
            "links": [{"a": "m0", "b": "m1", "latency_ms": 0.1, "bandwidth_GBps": 25 / 8 * 0.93}],
            "same_region": {"latency_ms": 0.01, "bandwidth_GBps": 10.0}}
    return from_spec(spec, node_locations=["m0"] * 8 + ["m1"] * 8)


def iteration(sc: Scale, counts, frozen, replicas, n_micro, hit, topo, check_mem=True) -> float | None:
    """Seconds of one iteration of a layout (None: fewer samples than micro-batches, or it does not fit).

    Per stage: active layers forward + backward, frozen layers forward only (a cached prefix
    instead reads one row per sample for the hit fraction), stage 0 the head; the event
    simulator runs the 1F1B lanes and the ring all-reduce of each stage's *active* parameters;
    the optimizer of the stage with the most active parameters ends the iteration."""
    m, S = sc.model, len(counts)
    if replicas * n_micro > sc.global_batch:
        return None
    b = math.ceil(sc.global_batch / (replicas * n_micro))  # uneven splits: the largest share sets the pace
    if check_mem and not sc.fits(counts, frozen, b, min(n_micro, S)):
        return None
    unit = sc.fwd_s * (1 + sc.backward_factor)
    P = layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim)
    eff, params, start = [], [], 0
    for s, c in enumerate(counts):
        nf = max(0, min(c, frozen - start))
        e = (c - nf) + nf * (1 - hit) * sc.fwd_s / unit
        if s == 0:
            e += sc.head_s / unit + (hit * sc.read_s / unit if frozen else 0.0)
        eff.append(e)
        params.append((c - nf) * P + (m.vocab_size * m.d_model * (1 if frozen else 2) if s == 0 else 0))
        start += c
    cost = CostModel(d_model=m.d_model, tokens_per_sample=m.seq_len, samples=b, dtype_bytes=sc.dtype_bytes,
                     layers_per_stage=eff, s_per_sample_per_layer=sc.fwd_s, backward_factor=sc.backward_factor,
                     loss_factor=0.0, hop_overhead_s=0.0, params_per_stage=params, grad_dtype_bytes=sc.dtype_bytes)
    placement = [[s * replicas + r for r in range(replicas)] for s in range(S)]
    sched = full_pipeline(topo, cost, [replicas] * S, n_micro * replicas, min(n_micro, S), placement=placement)
    return simulate(sched, topo, cost, record=False).iteration_s + sc.opt_s_per_param * max(params)


def start_counts(sc: Scale, S: int) -> list[int]:
    return split(sc.model.n_layers, 0, S, False, sc.units[0], sc.backward_factor) if S > 1 else [sc.model.n_layers]


def sweep(sc: Scale, topo) -> list[dict]:
    out = []
    for S in (1, 2, 4, 8, 16):
        if S - 1 > sc.model.n_layers:
            continue
        for M in MICROS:
            t = iteration(sc, start_counts(sc, S), 0, N_DEV // S, M, 0.0, topo)
            out.append({"stages": S, "replicas": N_DEV // S, "n_micro": M, "iteration_s": t})
    return out


def transfer_seconds(sc: Scale, old_counts, old_pl, new_counts, new_pl, frozen, topo) -> float:
    """Wire time of a transition: per receiver, its messages in sequence; receivers in parallel."""
    m = sc.model
    P = layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim) * 4
    sizes = {"tok_emb.weight": m.vocab_size * m.d_model * 4, "head.weight": m.vocab_size * m.d_model * 4}
    for l in range(m.n_layers):
        sizes[f"layers.{l}.w"] = P
        if l >= frozen:
            sizes[f"optim.exp_avg.layers.{l}.w"] = P
            sizes[f"optim.exp_avg_sq.layers.{l}.w"] = P
    per_dst: dict[int, float] = {}
    for tr in transfer_plan(sizes, Layout(Partition(tuple(old_counts)), old_pl),
                            Layout(Partition(tuple(new_counts)), new_pl)):
        per_dst[tr.dst] = per_dst.get(tr.dst, 0.0) + topo.transfer_s(tr.src, tr.dst, tr.nbytes)
    return max(per_dst.values(), default=0.0)


def elastic_times(sc: Scale, schedule, L_real: int, best: dict, topo, repartition=True, replicas=True,
                  cache=True, expected_hit: dict[int, float] | None = None,
                  prefix_cached: dict[int, bool] | None = None) -> dict:
    """Per-step seconds of the elastic run on ``sc``'s 16 nodes, following ``schedule`` (per step:
    the real run's frozen count, cache hit fraction and cache decision; the frozen count mapped
    by layer fraction), from the best static layout; plus the transitions' wire time.

    Without ``repartition`` the layout stays (frozen layers just skip their backward, wherever
    they live); without ``replicas`` freed nodes idle; without ``cache`` the prefix is recomputed.
    AutoPipe balances with the scale's costs (measured here for the small scale: AutoPipe's
    profiling) and, with the cache, the hit fraction the real run's trainer expected at that
    transition (``expected_hit``: step -> fraction; 1 when absent); at every transition the
    micro-batch count is re-picked by simulating.  Where the real run prefilled the cache
    (``prefix_cached``: step -> every window cached at the new depth) AutoPipe plans without the
    prefix in device memory; the prefill's own time is the caller's overhead."""
    L = sc.model.n_layers
    c0, m0 = sc.units
    S0, R0, M0 = best["stages"], best["replicas"], best["n_micro"]
    budget_stages = sc.start_stages or S0
    lay = {"frozen": 0, "counts": start_counts(sc, S0), "replicas": R0, "n_micro": M0,
           "placement": [[s * R0 + r for r in range(R0)] for s in range(S0)]}
    memo: dict = {}
    per_step, wire, history = [], 0.0, [dict(lay, step=0)]
    for i, (f_real, hit, cached) in enumerate(schedule):
        F = round(f_real / L_real * L)
        cached = cache and cached
        h = round(hit, 2) if cached else 0.0
        if F != lay["frozen"]:
            counts = lay["counts"]
            eh = (expected_hit or {}).get(i, 1.0) if cached else 0.0
            gone = bool(cached and (prefix_cached or {}).get(i, False))

            profiled: dict[tuple[int, ...], tuple[float, int]] = {}

            def fastest(cand, F=F, eh=eh, profiled=profiled):
                """(seconds, micro-batches) of the quickest M for ``cand`` (AutoPipe's profiling)."""
                if tuple(cand) not in profiled:
                    R = N_DEV // len(cand) if replicas else lay["replicas"]
                    runs = [(iteration(sc, cand, F, R, M, eh, topo, check_mem=False), M) for M in MICROS]
                    profiled[tuple(cand)] = min(((t, M) for t, M in runs if t is not None),
                                                default=(math.inf, lay["n_micro"]))
                return profiled[tuple(cand)]

            if repartition:
                counts, _ = autopipe(L, F, budget_stages, len(lay["counts"]), eh, c0, m0, sc.backward_factor,
                                     embedding_memory=embedding_units(sc.model), prefix_cached=gone,
                                     seconds=lambda cand: fastest(cand)[0])
            S = len(counts)
            R = N_DEV // S if replicas else lay["replicas"]
            new_pl = [[s * R + r for r in range(R)] for s in range(S)]
            best_m = fastest(counts)[1]
            w = transfer_seconds(sc, lay["counts"], lay["placement"], counts, new_pl, F, topo)
            wire += w
            lay = {"frozen": F, "counts": counts, "replicas": R, "n_micro": best_m, "placement": new_pl}
            history.append(dict(lay, step=i, wire_s=w))
        key = (F, tuple(lay["counts"]), lay["replicas"], lay["n_micro"], h)
        if key not in memo:
            memo[key] = iteration(sc, lay["counts"], F, lay["replicas"], lay["n_micro"], h, topo, check_mem=False)
        per_step.append(memo[key])
    return {"per_step": per_step, "wire_s": wire, "cache": cache,
            "history": [{k: v for k, v in h.items() if k != "placement"} for h in history]}


SIM_MODEL = ModelConfig(vocab_size=32000, d_model=2048, n_layers=32, n_heads=16, n_kv_heads=16, seq_len=1024,
                        n_stages=1)
DEV_FLOPS = 11.2e12 * 0.4  # Quadro RTX 5000 fp32 peak x 40% utilisation


def paper_scale() -> Scale:
    """32 layers d=2048 (1.6B parameters), global batch 128 x 1024 tokens, 24 GiB devices (at the
    testbed's 16 GiB no static layout fits this model under sim_memory; at 24 GiB pipelines fit,
    plain DP does not), cache rows read from host memory at 10 GB/s, AdamW at 300 GB/s."""
    m = SIM_MODEL
    return Scale("paper", m, 128, fwd_s=layer_flops_per_token(m) * m.seq_len / DEV_FLOPS, backward_factor=1.5,
                 head_s=2.5 * head_flops_per_token(m) * m.seq_len / DEV_FLOPS,
                 read_s=m.seq_len * m.d_model * 2 / 10e9, opt_s_per_param=16 * 3 / 300e9, dtype_bytes=2,
                 dev_mem=24 * 2**30)


def small_scale(real: dict) -> Scale:
    """The real runs' model and batch with the costs measured on this machine; device memory =
    the largest stage of the 4-stage start (so 4 stages is the fewest a static layout can use)."""
    c = real["costs"]
    return Scale("small", real["model"], 16, fwd_s=c["fwd_s"], backward_factor=c["backward_factor"],
                 head_s=c["head_s"], read_s=c["read_s"], opt_s_per_param=c["opt_s_per_param"], dtype_bytes=4,
                 start_stages=real["model"].n_stages)


def prefill_seconds(sc: Scale, real: dict, upto: int) -> float:
    """Time of the cache prefills up to step ``upto`` on ``sc``'s nodes: each prefill is forward
    only and data parallel, every node computing its 1/16 of the windows (the layers a window
    still lacked, the embedding negligible) and writing its rows.  The paper scale's data set has
    the same epochs at its global batch (x8 windows) and x4 layers per real layer."""
    L, L_real = sc.model.n_layers, real["model"].n_layers
    k = sc.global_batch / 16
    t = 0.0
    for tr in real["transitions"]:
        p = tr.get("prefill")
        if p and tr["step"] <= upto:
            # per row: the trainer's measured write (cache "auto"), else a read's cost
            write = tr.get("cache_measure", {}).get("write_s", sc.read_s) if sc.start_stages else sc.read_s
            t += (p["layer_rows"] * k * L / L_real * sc.fwd_s + p["rows"] * k * write) / N_DEV
    return t


#
