"""Elastic pipelining by freezing (issue 9): real single-process runs + the simulator at 16 devices.

Real half (this machine, real text, data/shakespeare):
  three trainers built from one config, stepped *interleaved* in one process (baseline step,
  freeze-only step, elastic step, ...) so the shared, noisy CPU slows them alike:
  (1) baseline: the plain trainer (every static pipeline/DP configuration computes exactly this
      in one process); (2) freeze only (elastic, cache off); (3) elastic (freeze + cache "auto").
  Validation loss every ``eval_every`` steps (not timed).  The training split is capped to
  ``--windows`` samples so the run spans several epochs (the regime where caching pays:
  PipeTransformer fine-tunes for many epochs).
Simulated half (paper scale): a 32-layer d=2048 LM on 16 devices (2 machines x 8), the event
  simulator of skiptrain.schedule with frozen layers costing no backward and cached prefixes
  no forward (the hit rate measured per step in the real elastic run), replicas adding DP width.
  Static configurations: a sweep of stages x replicas x micro-batches under a device-memory
  limit; the elastic run starts from the best one and follows the real run's freeze schedule,
  mapped by fraction of layers.  Steps to the target loss come from the real runs.

    .venv/bin/python bench/elastic.py --json runs/bench_elastic.json
    .venv/bin/python bench/elastic.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skiptrain.config import ModelConfig, build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.elastic.repartition import autopipe, stage0_units  # noqa: E402
from skiptrain.elastic.replicas import transfer_plan  # noqa: E402
from skiptrain.elastic.trainer import ElasticTrainer  # noqa: E402
from skiptrain.model.partition import Partition, layer_flops_per_token  # noqa: E402
from skiptrain.net.topology import from_spec  # noqa: E402
from skiptrain.schedule.baselines import full_pipeline  # noqa: E402
from skiptrain.schedule.cost import CostModel, layer_params  # noqa: E402
from skiptrain.schedule.simulator import simulate  # noqa: E402
from skiptrain.train.trainer import Trainer  # noqa: E402

# ---------------------------------------------------------------------------------------------
# real half


def capped(path: str, windows: int, seq_len: int) -> TokenDataset:
    ds = TokenDataset.open(path)
    full = ds.tokens
    n = windows * seq_len + 1
    ds.tokens = lambda split: full(split)[:n] if split == "train" else full(split)  # type: ignore[method-assign]
    return ds


def real_runs(args) -> dict:
    torch.set_num_threads(1)
    steps = args.steps
    base = {"data": {"path": args.data},
            "model": {"d_model": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64,
                      "n_stages": 4, "stage0_layers": -1},
            "train": {"steps": steps, "micro_batch": 4, "n_micro": 4, "lr": 3e-3, "warmup_steps": 20,
                      "eval_every": 0, "eval_batches": 8, "progress": False, "seed": 1234},
            "checkpoint": {"every": 0, "final": False}}
    el = {"enabled": True, "alpha": args.alpha, "check_every": args.check_every, "tol": args.tol,
          "min_active": 2, "start_window": 2, "guard": True, "guard_tol": 0.01, "guard_batches": 4,
          "nodes": 16}
    tmp = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    trainers = {}
    for name, over in [("baseline", {}), ("freeze_only", {"elastic": {**el, "cache": "off"}}),
                       ("elastic", {"elastic": {**el, "cache": "auto", "cache_dir": str(tmp / "cache")}})]:
        cfg = build_config(overrides={**base, **over})
        ds = capped(args.data, args.windows, cfg.model.seq_len)
        cls = ElasticTrainer if over else Trainer
        trainers[name] = cls(cfg, tmp / name, dataset=ds)
    first = trainers["baseline"]
    spent = {n: 0.0 for n in trainers}      # CPU seconds of the training thread (headline)
    wall = {n: 0.0 for n in trainers}       # wall seconds (inflated by the other jobs on the CPU)
    curves = {n: [] for n in trainers}
    losses = {n: [] for n in trainers}
    step_s = {n: [] for n in trainers}
    hits = []  # per step of the elastic run: (frozen, cached fraction of the prefix)
    el_tr = trainers["elastic"]
    prev = (0, 0, 0)
    for step in range(1, steps + 1):
        for n, tr in trainers.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            r = tr.train_step()
            dt = time.thread_time() - c0
            wall[n] += time.perf_counter() - t0
            spent[n] += dt
            step_s[n].append(dt)
            losses[n].append(r.loss)
        c = el_tr.cache.stats() if el_tr.cache is not None else {"hits": 0, "misses": 0, "extended": 0}
        cur = (c["hits"], c["misses"], c["extended"])
        d = [a - b for a, b in zip(cur, prev)]
        prev = cur
        frac = d[0] / sum(d) if sum(d) else 0.0
        hits.append((el_tr.frozen, frac))
        if step % args.eval_every == 0 or step == steps:
            for n, tr in trainers.items():
                curves[n].append({"step": step, "train_s": round(spent[n], 3), "val_loss": round(tr.validate(), 5)})
        if step % 50 == 0:
            print(f"  step {step}/{steps}: " + ", ".join(f"{n} {curves[n][-1]['val_loss'] if curves[n] else 0:.3f}"
                                                         f" {spent[n]:.1f}s" for n in trainers), flush=True)
    out = {"steps": steps, "windows": first.train_src.n, "epochs": round(steps * 16 / first.train_src.n, 2), "wall_s": {n: round(v, 3) for n, v in wall.items()},
           "params": first.model.num_parameters(), "curves": curves, "train_s": {n: round(v, 3) for n, v in spent.items()},
           "bit_identical_freeze_vs_cache": losses["freeze_only"] == losses["elastic"],
           "layouts": [l.to_dict() for l in el_tr.layouts], "transitions": el_tr.transitions,
           "decisions": el_tr.rule.history, "guard_s": round(el_tr.guard_s, 4),
           "transition_s": round(sum(t["seconds"] for t in el_tr.transitions), 4),
           "cache": el_tr.cache.stats() if el_tr.cache else None, "prefix_hits": hits,
           "step_s": {n: v for n, v in step_s.items()}}
    return out


def time_to(curve: list[dict], target: float) -> tuple[int | None, float | None]:
    for p in curve:
        if p["val_loss"] <= target:
            return p["step"], p["train_s"]
    return None, None


# ---------------------------------------------------------------------------------------------
# simulated half


SIM_MODEL = ModelConfig(vocab_size=32000, d_model=2048, n_layers=32, n_heads=16, n_kv_heads=16, seq_len=1024,
                        n_stages=1)
# PipeTransformer's testbed: 2 machines x 8 Quadro RTX 5000 (16 GB, 11.2 TFLOPS fp32), 25 Gbit/s between
# Device memory: the testbed's 16 GB holds no static layout of this 1.6B-parameter model under the
# memory model below (the best, 4 stages x 16 micro-batches, needs 16.2 GiB), so the simulation
# uses 24 GiB devices: pipelines fit, plain data parallelism (60 GiB per replica) does not.
N_DEV, GLOBAL_BATCH, DEV_MEM = 16, 128, 24 * 2**30
DEV_FLOPS = 11.2e12 * 0.4  # fp32 peak x 40% utilisation


def sim_topology():
    spec = {"name": "2x8", "locations": ["m0", "m1"],
            "links": [{"a": "m0", "b": "m1", "latency_ms": 0.1, "bandwidth_GBps": 25 / 8 * 0.93}],
            "same_region": {"latency_ms": 0.01, "bandwidth_GBps": 10.0}}
    return from_spec(spec, node_locations=["m0"] * 8 + ["m1"] * 8)


def sim_memory(counts, frozen, b, in_flight, m=SIM_MODEL) -> float:
    """Peak bytes of the largest stage: 16 B/param for active layers (weights, grads, Adam), 1/6
    of that for frozen ones, activations ~ 16 floats/token/layer per micro-batch in flight."""
    P = layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim)
    act = b * m.seq_len * m.d_model * 4 * 16
    worst, start = 0.0, 0
    for s, c in enumerate(counts):
        nf = max(0, min(c, frozen - start))
        mem = nf * 16 * P / 6 + (c - nf) * (16 * P + act * in_flight)
        if s == 0:
            mem += 2 * m.vocab_size * m.d_model * 16 + act * in_flight * 2
        worst = max(worst, mem)
        start += c
    return worst


def sim_iteration(counts, frozen, replicas, n_micro, hit=0.0, m=SIM_MODEL, topo=None) -> float | None:
    """Simulated seconds of one iteration, or None when the layout does not fit in memory."""
    S = len(counts)
    if GLOBAL_BATCH % (replicas * n_micro):
        return None
    b = GLOBAL_BATCH // (replicas * n_micro)
    if sim_memory(counts, frozen, b, min(n_micro, S)) > DEV_MEM:
        return None
    topo = topo or sim_topology()
    bf = 1.5
    eff, P, start = [], layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim), 0
    params = []
    for s, c in enumerate(counts):
        nf = max(0, min(c, frozen - start))
        eff.append((c - nf) + nf * (1 - hit) / (1 + bf))  # frozen: forward only, none when cached
        params.append((c - nf) * P + (m.vocab_size * m.d_model * (1 if frozen else 2) if s == 0 else 0))
        start += c
    spl = layer_flops_per_token(m) * m.seq_len / DEV_FLOPS
    cost = CostModel(d_model=m.d_model, tokens_per_sample=m.seq_len, samples=b, dtype_bytes=2,
                     layers_per_stage=eff, s_per_sample_per_layer=spl, hop_overhead_s=0.0,
                     params_per_stage=params, grad_dtype_bytes=2)
    placement = [[s * replicas + r for r in range(replicas)] for s in range(S)]
    sched = full_pipeline(topo, cost, [replicas] * S, n_micro * replicas, min(n_micro, S), placement=placement)
    return simulate(sched, topo, cost, record=False).iteration_s


def sim_sweep(topo) -> list[dict]:
    out = []
    for S in (1, 2, 4, 8, 16):
        counts = autopipe(SIM_MODEL.n_layers, 0, S, S, False, *stage0_units(SIM_MODEL))[0] if S > 1 else [32]
        for M in (1, 2, 4, 8, 16):
            t = sim_iteration(counts, 0, N_DEV // S, M, topo=topo)
            out.append({"stages": S, "replicas": N_DEV // S, "n_micro": M, "iteration_s": t})
    return out


def transfer_seconds(old_counts, old_pl, new_counts, new_pl, frozen, topo, m=SIM_MODEL) -> float:
    """Wire time of a transition: per receiver, its messages in sequence; receivers in parallel."""
    P = layer_params(m.d_model, m.hidden, m.kv_heads * m.head_dim) * 4
    sizes = {"tok_emb.weight": m.vocab_size * m.d_model * 4, "head.weight": m.vocab_size * m.d_model * 4}
    for l in range(m.n_layers):
        sizes[f"layers.{l}.w"] = P
        if l >= frozen:
            sizes[f"optim.exp_avg.layers.{l}.w"] = P
            sizes[f"optim.exp_avg_sq.layers.{l}.w"] = P
    per_dst: dict[int, float] = {}
    for tr in transfer_plan(sizes, Partition(tuple(old_counts)), old_pl, Partition(tuple(new_counts)), new_pl):
        per_dst[tr.dst] = per_dst.get(tr.dst, 0.0) + topo.transfer_s(tr.src, tr.dst, tr.nbytes)
    return max(per_dst.values(), default=0.0)


def sim_elastic(real: dict, best: dict, topo, repartition=True, replicas=True, cache=True) -> dict:
    """Seconds per step of the elastic run at paper scale, following the real run's freeze
    schedule and cache hit rate step by step; plus transition wire time."""
    L_real = 8
    c0, m0 = stage0_units(SIM_MODEL)
    S0, R0, M0 = best["stages"], best["replicas"], best["n_micro"]
    counts = autopipe(SIM_MODEL.n_layers, 0, S0, S0, False, c0, m0)[0] if S0 > 1 else [SIM_MODEL.n_layers]
    pl = [[s * R0 + r for r in range(R0)] for s in range(S0)]
    layout = {"frozen": 0, "counts": counts, "replicas": R0, "n_micro": M0, "placement": pl}
    memo: dict = {}
    per_step, trans_s, history = [], 0.0, [dict(layout, step=0)]
    for i, (f_real, hit) in enumerate(real["prefix_hits"]):
        F = round(f_real / L_real * SIM_MODEL.n_layers)
        h = hit if cache else 0.0
        if F != layout["frozen"]:
            if repartition:
                counts, _ = autopipe(SIM_MODEL.n_layers, F, S0, len(layout["counts"]), cache, c0, m0)
            else:
                counts = layout["counts"]
                if counts[0] < F:  # frozen layers live on stage 0: move the cut up
                    counts = list(counts)
                    moved = F - counts[0]
                    counts[0] = F
                    j = 1
                    while moved and j < len(counts):
                        take = min(moved, counts[j] - 1)
                        counts[j] -= take
                        moved -= take
                        j += 1
            S = len(counts)
            R = N_DEV // S if replicas else layout["replicas"]
            new_pl = [[s * R + r for r in range(R)] for s in range(S)]
            best_m, best_t = layout["n_micro"], math.inf
            for M in (1, 2, 4, 8, 16):  # re-pick micro-batches by simulating
                t = sim_iteration(counts, F, R, M, 1.0 if cache else 0.0, topo=topo)
                if t is not None and t < best_t:
                    best_m, best_t = M, t
            trans_s += transfer_seconds(layout["counts"], layout["placement"], counts, new_pl, F, topo)
            layout = {"frozen": F, "counts": counts, "replicas": R, "n_micro": best_m, "placement": new_pl}
            history.append(dict(layout, step=i))
        key = (F, tuple(layout["counts"]), layout["replicas"], layout["n_micro"], round(h, 2))
        if key not in memo:
            memo[key] = sim_iteration(layout["counts"], F, layout["replicas"], layout["n_micro"], round(h, 2), topo=topo)
        per_step.append(memo[key])
    return {"per_step": per_step, "transition_s": trans_s,
            "history": [{k: v for k, v in h.items() if k != "placement"} for h in history]}


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default=str(ROOT / "data" / "shakespeare"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--windows", type=int, default=1024, help="training samples kept (multi-epoch regime)")
    ap.add_argument("--alpha", type=float, default=1 / 3)
    ap.add_argument("--tol", type=float, default=0.2)
    ap.add_argument("--check-every", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    args = ap.parse_args(argv)
    args.steps = args.steps or (120 if args.quick else 320)
    args.check_every = args.check_every or (10 if args.quick else 20)
    args.eval_every = args.eval_every or (10 if args.quick else 20)
    t_start = time.time()
    print(f"real runs: {args.steps} steps, {args.windows} samples of 64 tokens, interleaved", flush=True)
    real = real_runs(args)
    c = real["curves"]
    final = {n: c[n][-1]["val_loss"] for n in c}
    target = round(final["baseline"] * 1.01, 5)
    tt = {n: time_to(c[n], target) for n in c}
    print(f"\nREAL (2-core CPU container, 1 thread, interleaved, CPU seconds of the training thread; target val loss {target} = baseline final x 1.01)")
    print(f"{'run':<12} {'final val':>9} {'train s':>8} {'steps→tgt':>9} {'s→tgt':>7} {'speed-up':>8}")
    b_s = tt["baseline"][1]
    for n in c:
        st, s = tt[n]
        sp = (b_s / s) if (s and b_s) else None
        print(f"{n:<12} {final[n]:>9.4f} {real['train_s'][n]:>8.1f} {str(st):>9} "
              f"{(f'{s:.1f}' if s else '-'):>7} {(f'{sp:.2f}x' if sp else '-'):>8}")
    total_el = real["train_s"]["elastic"]
    print(f"freeze schedule (step: frozen/stages x replicas): "
          + ", ".join(f"{l['step']}: {l['frozen']}/{len(l['counts'])}x{l['replicas']}" for l in real["layouts"]))
    print(f"transitions {real['transition_s']:.3f}s + guard validation {real['guard_s']:.3f}s of {total_el:.1f}s "
          f"elastic train time; cache {real['cache']}; freeze-only == elastic losses bit-identical: "
          f"{real['bit_identical_freeze_vs_cache']}")

    # ---- simulated -----------------------------------------------------------------------
    topo = sim_topology()
    sweep = sim_sweep(topo)
    feasible = [r for r in sweep if r["iteration_s"] is not None]
    if not feasible:
        raise SystemExit(f"simulation: no static configuration fits in {DEV_MEM / 2**30:.0f} GiB per device; "
                         "raise DEV_MEM or shrink SIM_MODEL in bench/elastic.py")
    best = min(feasible, key=lambda r: r["iteration_s"])
    dp = next((r for r in sorted(feasible, key=lambda r: r["iteration_s"]) if r["stages"] == 1), None)
    print(f"\nSIMULATED (32 layers d=2048, 16 devices = 2 machines x 8, {DEV_MEM / 2**30:.0f} GiB each, "
          f"global batch {GLOBAL_BATCH} x 1024 tokens)")
    print("static sweep (s/iteration; - = does not fit in memory):")
    for S in (1, 2, 4, 8, 16):
        row = [r for r in sweep if r["stages"] == S]
        print(f"  S={S:<2} R={N_DEV // S:<2} " + "  ".join(
            f"M={r['n_micro']}: {r['iteration_s']:.2f}" if r["iteration_s"] else f"M={r['n_micro']}: -" for r in row))
    steps_b = tt["baseline"][0]
    steps_e = tt["elastic"][0]
    n_steps = real["steps"]
    static_t = best["iteration_s"]
    variants = {"freeze_only": dict(repartition=False, replicas=False, cache=False),
                "+autopipe": dict(repartition=True, replicas=False, cache=False),
                "+autopipe+autocache": dict(repartition=True, replicas=False, cache=True),
                "+autopipe+autodp": dict(repartition=True, replicas=True, cache=False),
                "all": dict(repartition=True, replicas=True, cache=True)}
    sims = {k: sim_elastic(real, best, topo, **v) for k, v in variants.items()}

    def t_to(per_step, n, trans):
        return sum(per_step[:n]) + trans if n else None

    sim_static_tt = static_t * steps_b if steps_b else None
    sim_dp_tt = dp["iteration_s"] * steps_b if (dp and steps_b) else None
    ablation = {}
    for k, s in sims.items():
        t = t_to(s["per_step"], steps_e, s["transition_s"])
        ablation[k] = round(sim_static_tt / t, 3) if (t and sim_static_tt) else None
    el = sims["all"]
    el_tt = t_to(el["per_step"], steps_e, el["transition_s"])
    el_total = sum(el["per_step"]) + el["transition_s"]
    print(f"best static: S={best['stages']} R={best['replicas']} M={best['n_micro']}: {static_t:.2f} s/it; "
          "plain DP (S=1): " + ("does not fit" if dp is None else f"{dp['iteration_s']:.2f} s/it"))
    print("elastic layouts (step: frozen layers, stages, replicas, micro-batches): " + ", ".join(
        f"{h['step']}: {h['frozen']}, {len(h['counts'])}, {h['replicas']}, {h['n_micro']}" for h in el["history"]))
    print(f"{'config':<22} {'time to target':>14} {'vs best static':>14}")
    print(f"{'best static':<22} {sim_static_tt or float('nan'):>13.0f}s {1.0:>13.2f}x")
    if dp:
        print(f"{'plain DP':<22} {sim_dp_tt:>13.0f}s {sim_static_tt / sim_dp_tt:>13.2f}x")
    else:
        print(f"{'plain DP':<22} {'n/a (OOM)':>14}")
    for k, s in sims.items():
        t = t_to(s["per_step"], steps_e, s["transition_s"])
        print(f"{'elastic ' + k:<22} {t or float('nan'):>13.0f}s {ablation[k] or float('nan'):>13.2f}x")
    # overlap check: the simulator on ONE device with the real run's schedule vs the real ratio
    real_ratio = real["train_s"]["baseline"] / real["train_s"]["elastic"]
    speedup = ablation["all"]
    result = {
        "speedup_vs_best_static": speedup,
        "final_loss_ratio": round(final["elastic"] / final["baseline"], 5),
        "transition_fraction": round(el["transition_s"] / el_total, 6),
        "transition_fraction_real": round((real["transition_s"]) / real["train_s"]["elastic"], 6),
        "guard_fraction_real": round(real["guard_s"] / real["train_s"]["elastic"], 6),
        "ablation": ablation,
        "real": {"target_val_loss": target, "final_val_loss": final, "train_cpu_s": real["train_s"], "wall_s": real["wall_s"],
                 "steps_to_target": {n: tt[n][0] for n in tt}, "seconds_to_target": {n: tt[n][1] for n in tt},
                 "speedup_to_target": {n: (round(b_s / tt[n][1], 3) if tt[n][1] and b_s else None) for n in tt},
                 "whole_run_speedup_elastic": round(real_ratio, 3),
                 "whole_run_speedup_freeze_only": round(real["train_s"]["baseline"] / real["train_s"]["freeze_only"], 3),
                 "bit_identical_freeze_vs_cache": real["bit_identical_freeze_vs_cache"],
                 "layouts": real["layouts"], "decisions": real["decisions"], "transitions": real["transitions"],
                 "cache": real["cache"], "curves": c, "windows": real["windows"], "epochs": real["epochs"],
                 "params": real["params"]},
        "sim": {"best_static": best, "plain_dp": dp, "sweep": sweep, "elastic_history": el["history"],
                "time_to_target_s": {"best_static": sim_static_tt, "plain_dp": sim_dp_tt, "elastic": el_tt},
                "transition_s": el["transition_s"]},
        "quick": args.quick, "bench_seconds": round(time.time() - t_start, 1),
    }
    print(f"\nspeedup_vs_best_static {speedup} (sim, steps from the real runs), final_loss_ratio "
          f"{result['final_loss_ratio']} (real), transition_fraction {result['transition_fraction']} (sim) / "
          f"{result['transition_fraction_real']} (real)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
