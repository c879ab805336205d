"""Bench: the flagship run -- every idea of skiptrain at once on an emulated planet-wide network,
with failures, against the best plain setup on the same network.

One swarm of node processes on this machine (default 16, one per geo12 node in reference
order; one more geo12 slot for the node that joins), the ``small`` preset on the prepared
Shakespeare text (``data/shakespeare``), geo12 links emulated in the transport
(:mod:`skiptrain.runtime.wan`: per directed link a FIFO with geo12's latency and bandwidth, all
scaled by ``--time-scale``; ``bytes_scale`` emulated bytes per real byte so a hop carries
SkipPipe's 32 MiB), compute padded to the cost model (a stage's forward of a micro-batch takes
SkipPipe's 1.76 s x time scale), and every replica group's data-parallel collectives delayed
as a ring over its geo12 links for the bytes they really move (``EmulationSpec.sync``).

* **flagship**: the planner's skip routes (k = 0.33, <= 2 swaps), DeMo (top-8 of 64x64 DCT
  chunks, 1-bit signs, 12-bit indices), int8 activations and gradients on links slower than
  1 GB/s, elastic freezing (the freeze rule, its validation guard, AutoPipe + AutoDP transitions;
  activation cache off), a job checkpoint every ``--ckpt-every`` iterations, recovery on.
  Events: kill -9 of a body replica mid-iteration; SIGSTOP of another (found by the heartbeat
  deadline); a new node joins (``python -m skiptrain.runtime.node --join``); then the whole job
  (launcher, every node, the joiner) is SIGKILLed and resumed from its newest checkpoint
  (``Job.resume``: ``launch --resume``).  It trains ``--extra`` times the baseline's iterations.
* **baseline**: the full pipeline (1F1B on fixed lanes, the same global batch), AdamW on a dense
  fp32 ring all-reduce, fp32 activations, no freezing, no checkpoints, no events.

Figures: wall-clock seconds (from the launch, every start-up, recovery, transition and the
restart included) to the baseline's final validation loss -- the flagship's loss is measured on
each of its checkpoints -- and the speedup; the flagship's validation loss at the baseline's
token count over the baseline's; samples lost and repeated over the whole job (the sample logs
of every committed iteration); the events; ``--png``: both loss curves against wall seconds with
the events marked; ``--gantt``: one iteration of the flagship after the resume, measured next to
the simulator's timeline of the layout in force.  ``--quick``: 8 nodes, a narrow model, a few
minutes on 2 cores, the same path.

    .venv/bin/python bench/flagship.py --json runs/bench/flagship.json --png docs/img/flagship_loss.png \\
        --gantt docs/img/flagship_gantt.png
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._events import kill_job, launch_process, spawn_joiner, steps_done, validation_loss  # noqa: E402
from bench._workdir import work_dir  # noqa: E402
from skiptrain.checkpoint import store as ckstore  # noqa: E402
from skiptrain.checkpoint.training import truncate_metrics  # noqa: E402
from skiptrain.checkpoint.reader import CheckpointReader  # noqa: E402
from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.net.topology import load_topology  # noqa: E402
from skiptrain.runtime.faults import faulty_job  # noqa: E402
from skiptrain.runtime.job import Job, build_cost, build_schedule, phase_for  # noqa: E402
from skiptrain.runtime.job_checkpoint import checkpoint_root, is_weight_name, resume_point  # noqa: E402
from skiptrain.runtime.recovery import trained_samples  # noqa: E402
from skiptrain.runtime.wan import scale_topology  # noqa: E402

STAGE_FWD_S = 1.76        # SkipPipe: a stage's forward of one micro-batch (4 layers x 8 samples x 0.055 s)
HOP_BYTES = 32 * 2 ** 20  # SkipPipe: one hop's activations
DEMO = {"strategy": "demo", "topk": 8, "chunk": 64, "values": "sign1", "indices": "u12"}


def settings(args) -> dict:
    """Model, swarm and schedule sizes of the run (``--quick``: the same path, smaller)."""
    if args.quick:
        return {"nodes": 8, "model": {"d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64,
                                      "n_stages": 4, "stage0_layers": 1},
                "iterations": args.iterations or 12, "ckpt_every": args.ckpt_every or 2, "check_every": 2,
                "mb_per_originator": 2, "time_scale": args.time_scale or 1 / 16}
    # (the `small` model's real compute, 16 processes on a few cores, must stay under the padding)
    return {"nodes": args.nodes or 16, "model": {"n_stages": 4},
            "iterations": args.iterations or 40, "ckpt_every": args.ckpt_every or 5, "check_every": 5,
            "mb_per_originator": 2, "time_scale": args.time_scale or 1 / 6}


def configs(args, s: dict, vocab: int):
    """(baseline config, flagship config) over the same emulated network and data."""
    tau = s["time_scale"]
    m = s["model"]
    probe = build_config(args.preset, overrides={"model": {**m, "vocab_size": vocab}})
    act = probe.train.micro_batch * probe.model.seq_len * probe.model.d_model * 4
    layers_per_stage = probe.model.n_layers / probe.model.n_stages
    common = {
        "model": {**m, "vocab_size": vocab},
        "train": {"skip_ratio": 0.0, "max_swaps": 2, "seed": 1234, "grad_clip": 1.0, "eval_every": 0,
                  "warmup_steps": max(2, s["iterations"] // 10), "eval_batches": 16},
        "runtime": {"nodes": s["nodes"], "topology": "geo12", "wan": True, "emulate_compute": True,
                    "time_scale": tau, "bytes_scale": max(1, round(HOP_BYTES / act)),
                    "hop_overhead_s": 0.35 * tau,
                    "s_per_sample_layer": STAGE_FWD_S * tau / (probe.train.micro_batch * layers_per_stage),
                    "memory": 3, "mb_per_originator": s["mb_per_originator"], "plan_seed": 0,
                    "timeout_s": 30.0, "heartbeat_s": 0.25},
        "checkpoint": {"every": 0, "final": False}}
    base = build_config(args.preset, overrides={**common, "train": {**common["train"], "steps": s["iterations"]},
                                                "dp": {"strategy": "allreduce"}})
    iters_f = math.ceil(s["iterations"] * args.extra / s["ckpt_every"]) * s["ckpt_every"]
    flag = build_config(args.preset, overrides={
        **common, "train": {**common["train"], "steps": iters_f, "skip_ratio": 0.33}, "dp": DEMO,
        "runtime": {**common["runtime"], "act_codec": "int8", "act_fast_GBps": 1.0 / tau, "recover": True,
                    "heartbeat_deadline_s": 3.0, "ckpt_max_age": 2 * s["ckpt_every"]},
        "elastic": {"enabled": True, "check_every": s["check_every"], "cache": "off", "start_window": 2,
                    "guard_batches": 4, "min_active": 2},
        "checkpoint": {"every": s["ckpt_every"], "keep": 1000, "final": True}})
    return base, flag


def network(cfg, nodes: int):
    """geo12 for ``nodes`` + 1 nodes (the last: the joining node's slot), time-scaled."""
    return scale_topology(load_topology("geo12", nodes + 1), cfg.runtime.time_scale)


class Clock:
    """Wall seconds of each training iteration's metrics line (polled; one clock for every run)."""

    def __init__(self, run: Path, t0: float):
        self.run, self.t0, self.seen, self.times = run, t0, 0, {}

    def poll(self) -> None:
        try:
            lines = (self.run / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return
        now = time.time() - self.t0
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "loss" in row:
                self.times[int(row["step"])] = now if row["step"] not in self.times else self.times[row["step"]]

    def restart(self, from_step: int) -> None:
        """A resumed launch redoes the iterations after its checkpoint: forget their times."""
        self.times = {k: v for k, v in self.times.items() if k <= from_step}

    def follow(self, proc, what: str, logs: str) -> None:
        """Sample this run's clock until the launch ``proc`` ends; a failed launch ends the bench
        with one line naming ``what`` failed and where its ``logs`` are."""
        while proc.poll() is None:
            self.poll()
            time.sleep(0.05)
        self.poll()
        if proc.returncode != 0:
            raise SystemExit(f"{what} failed (exit {proc.returncode}); see {logs}")


def run_baseline(cfg, topo, data: Path, run: Path) -> dict:
    cost = build_cost(cfg)
    sched = build_schedule(cfg, "full_pipeline", topo.subset(range(cfg.runtime.nodes)), cost, contention=True,
                           dp_sync=True)
    phase = phase_for(cfg, sched, topo, cost, "train", cfg.train.steps, emulate_sync=True, save_weights=True)
    job = Job(config=cfg.to_dict(), data_path=str(data), run_dir=str(run), phases=[phase])
    t0 = time.time()
    clock = Clock(run, t0)
    log = run.parent / "baseline-launch.log"
    clock.follow(launch_process(job.save(run.parent / "baseline-job.json"), log), "baseline launch", str(log))
    return {"wall_s": time.time() - t0, "times": clock.times, "metrics": read_metrics(run),
            "val_loss": validation_loss(cfg, data, run), "schedule": sched}


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def event_script(cfg, sched, ckpt_every: int) -> tuple[list[dict], dict]:
    """Faults by node and iteration; when the node joins and the whole job is killed."""
    T, P = cfg.train.steps, sched.placement
    kill_it, stop_it = max(2, round(0.15 * T)), max(3, round(0.25 * T))
    join_after = max(stop_it + 2, round(0.35 * T))
    whole_after = max(join_after + 2, round(0.55 * T))
    faults = [{"node": P[1][-1], "kind": "kill", "iteration": kill_it, "delay_s": 0.3},
              {"node": P[2][-1], "kind": "hang", "iteration": stop_it}]
    return faults, {"join_after": join_after, "whole_kill_after": whole_after, "ckpt_every": ckpt_every}


def run_flagship(cfg, topo, data: Path, run: Path, quick: bool) -> dict:
    cost = build_cost(cfg, dp_mode="compressed")
    n = cfg.runtime.nodes
    sched = build_schedule(cfg, "planner", topo.subset(range(n)), cost, contention=True, dp_sync=False)
    phase = phase_for(cfg, sched, topo, cost, "train", cfg.train.steps, emulate_sync=True, save_weights=True)
    faults, plan = event_script(cfg, sched, cfg.checkpoint.every)
    job = Job(config=cfg.to_dict(), data_path=str(data), run_dir=str(run), phases=[phase], **faulty_job(faults))
    events = [{"kind": "kill -9 body replica", "node": faults[0]["node"], "iteration": faults[0]["iteration"]},
              {"kind": "SIGSTOP body replica", "node": faults[1]["node"], "iteration": faults[1]["iteration"]}]
    t0 = time.time()
    clock = Clock(run, t0)
    proc = launch_process(job.save(run.parent / "flagship-job.json"), run.parent / "flagship-launch1.log")
    joiner = None
    root = checkpoint_root(job, "train")
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"flagship launch ended before the whole-job kill (exit {proc.returncode}); "
                             f"see {run.parent / 'flagship-launch1.log'} and {run / 'logs'}")
        clock.poll()
        done = steps_done(run)
        if joiner is None and done >= plan["join_after"] and (run / "join_secret").exists():
            joiner = spawn_joiner(run, (run / "join_secret").read_text(), "joiner")
            events.append({"kind": "new node joins", "after_iteration": done, "t": time.time() - t0})
        latest = ckstore.latest(root, warn=False)
        if joiner is not None and done >= plan["whole_kill_after"] and latest is not None \
                and CheckpointReader(latest).step >= plan["join_after"]:
            break
        time.sleep(0.05)
    t_kill = time.time() - t0
    kill_job(proc, run, [joiner])
    shutil.copytree(run, run.parent / "flagship-before-kill", ignore=shutil.ignore_patterns("checkpoints"))
    rp = resume_point(root)
    events.append({"kind": "whole job SIGKILLed", "after_iteration": done, "t": t_kill,
                   "resumed_from_iteration": rp["iteration"], "iterations_redone": done - rp["iteration"]})
    truncate_metrics(run / "metrics.jsonl", rp["iteration"])   # (as the resumed launch will: no stale times)
    clock.restart(rp["iteration"])
    job.resume, job.node_module, job.meta = rp, "skiptrain.runtime.node", {}
    log = run.parent / "flagship-launch2.log"
    clock.follow(launch_process(job.save(run.parent / "flagship-job-resume.json"), log), "resumed flagship launch",
                 f"{log} and {run / 'logs'}")
    first = clock.times.get(rp["iteration"] + 1)
    events[-1]["back_to_work_s"] = round(first - t_kill, 2) if first is not None else None
    return {"wall_s": time.time() - t0, "times": clock.times, "metrics": read_metrics(run), "events": events,
            "schedule": sched, "cost": cost, "resume": rp, "root": root, "faults": faults}


def checkpoint_curve(cfg, data: Path, root: Path) -> list[tuple[int, float]]:
    """(iteration, validation loss) of every committed checkpoint of the flagship."""
    out = []
    for step, path in ckstore.list_committed(root):
        r = CheckpointReader(path)
        out.append((step, validation_loss(cfg, data, r.read_many(n for n in r.names() if is_weight_name(n)))))
    return sorted(out)


def sample_check(run: Path, iterations: int, gb: int) -> tuple[int, int]:
    """(samples lost, samples repeated) over every committed iteration of the job."""
    per_it = trained_samples(run / "phases" / "train")
    flat = [i for it in range(iterations) for i in per_it.get(it, [])]
    return len(set(range(iterations * gb)) - set(flat)), len(flat) - len(set(flat))


def event_details(run: Path, events: list[dict], faults: list[dict]) -> list[dict]:
    """Each event with the coordinator's record of it (detection, recovery) from the first launch."""
    before = run.parent / "flagship-before-kill"
    rec = [json.loads(x) for x in (before / "recoveries.jsonl").read_text().splitlines()] \
        if (before / "recoveries.jsonl").exists() else []
    out = []
    for ev in events:
        row = dict(ev)
        if "node" in ev:
            mine = [r for r in rec if r.get("node") == ev["node"] and not r.get("join")]
            row.update(detected=bool(mine), detect_s=mine[0].get("detect_s") if mine else None,
                       recover_s=mine[0].get("recover_s") if mine else None)
        elif ev["kind"] == "new node joins":
            j = [r for r in rec if r.get("join") and not r.get("refused")]
            row.update(admitted=bool(j), node=j[0]["node"] if j else None,
                       stage=(j[0].get("choice") or {}).get("stage") if j else None,
                       detect_s=j[0].get("detect_s") if j else None, recover_s=j[0].get("recover_s") if j else None,
                       refused=[r.get("cause") for r in rec if r.get("join") and r.get("refused")])
        out.append(row)
    return out


def time_to(target: float, curve: list[tuple[int, float]], times: dict) -> tuple[int | None, float | None]:
    """The first checkpoint at or below ``target``: (iteration, wall seconds of that iteration)."""
    for it, v in curve:
        if v <= target and it in times:
            return it, times[it]
    return None, None


def plot(path: Path, base: dict, flag: dict, curve, events: list[dict], target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r, c in (("baseline: full pipeline, fp32 all-reduce", base, "tab:gray"),
                       ("flagship: every idea on, with events", flag, "tab:blue")):
        rows = [m for m in r["metrics"] if "loss" in m and m["step"] in r["times"]]
        ax.plot([r["times"][m["step"]] for m in rows], [m["loss"] for m in rows], color=c, alpha=0.35, lw=1)
    ax.plot([base["times"][max(base["times"])]], [base["val_loss"]], "s", color="tab:gray",
            label=f"baseline final validation loss {base['val_loss']:.3f}")
    pts = [(flag["times"][i], v) for i, v in curve if i in flag["times"]]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:blue", label="flagship validation loss (checkpoints)")
    ax.axhline(target, color="tab:gray", ls=":", lw=1)
    for ev in events:
        t = ev.get("t") if ev.get("t") is not None else flag["times"].get(ev.get("iteration"))
        if t is not None:
            ax.axvline(t, color="tab:red", ls="--", lw=0.8)
            ax.text(t, ax.get_ylim()[1], " " + ev["kind"], rotation=90, va="top", fontsize=7, color="tab:red")
    ax.set_xlabel("wall-clock seconds (emulated geo12 links)")
    ax.set_ylabel("loss (thin: training, markers: validation)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def gantt(path: Path, cfg, flag: dict, topo, run: Path) -> dict:
    """The first iteration after the resume, measured, next to the simulator's timeline of the
    layout in force then (DeMo's sync at the measured payload, as a ring over geo12 links)."""
    import dataclasses

    from skiptrain.runtime.outputs import load_phase_timeline
    from skiptrain.runtime.transition import layout_cost
    from skiptrain.schedule.gantt import draw_side_by_side
    from skiptrain.schedule.schedule import Schedule
    from skiptrain.schedule.simulator import simulate

    saved = CheckpointReader(flag["resume"]["path"]).state.get("elastic") or {}
    sched, cost = flag["schedule"], flag["cost"]
    if saved.get("frozen"):
        sched = Schedule.from_dict(saved["schedule"])
        cost = layout_cost(cost, cfg.model, saved["counts"], saved["frozen"])
    after = [m for m in flag["metrics"] if "loss" in m and m["step"] > flag["resume"]["iteration"]]
    payload = statistics.median(m["payload_bytes"] for m in after) if after else 0
    cost = dataclasses.replace(cost, compressed_payload_bytes=int(payload * cfg.runtime.bytes_scale))
    sim = simulate(sched, topo, cost, contention=True, dp_sync=True)
    measured = load_phase_timeline(run, "train", 0)
    meas_s = after[0]["iteration_s"] if after else float("nan")
    draw_side_by_side(sim.timeline, measured, path,
                      titles=(f"simulated (frozen {saved.get('frozen', 0)}, stages {[len(p) for p in sched.placement]}): "
                              f"{sim.iteration_s:.2f} s",
                              f"measured, iteration {flag['resume']['iteration']} after the resume: {meas_s:.2f} s"),
                      dpi=70)
    return {"iteration": flag["resume"]["iteration"], "simulated_s": round(sim.iteration_s, 3),
            "measured_s": meas_s, "frozen": saved.get("frozen", 0)}


def summarize(args, cfg_b, cfg_f, base: dict, flag: dict, curve, run: Path) -> dict:
    """The figures of the run (see the module doc)."""
    T_b = cfg_b.train.steps
    target = base["val_loss"]
    hit_it, hit_s = time_to(target, curve, flag["times"])
    base_s = base["times"][T_b]
    at_equal = dict(curve).get(T_b)
    gb = len(flag["schedule"].micro_batches) * cfg_f.train.micro_batch
    lost, rep = sample_check(run, cfg_f.train.steps, gb)
    elastic = [json.loads(x) for x in (run / "elastic.jsonl").read_text().splitlines()] \
        if (run / "elastic.jsonl").exists() else []
    pay = lambda r: statistics.fmean(m["payload_bytes"] for m in r["metrics"] if "loss" in m)  # noqa: E731
    return {
        "speedup_to_baseline_loss": round(base_s / hit_s, 3) if hit_s else None,
        "final_loss_ratio": round(at_equal / target, 4) if at_equal else None,
        "samples_lost": lost, "samples_repeated": rep,
        "events": event_details(run, flag["events"], flag["faults"]),
        "baseline_val_loss": round(target, 4), "baseline_iterations": T_b, "baseline_s_to_final": round(base_s, 1),
        "flagship_iterations": cfg_f.train.steps, "flagship_s_to_baseline_loss": round(hit_s, 1) if hit_s else None,
        "flagship_iteration_at_baseline_loss": hit_it, "flagship_val_at_equal_tokens": at_equal,
        "flagship_val_curve": curve, "flagship_final_val_loss": curve[-1][1] if curve else None,
        "wall_s": {"baseline": round(base["wall_s"], 1), "flagship": round(flag["wall_s"], 1)},
        "median_iteration_s": {k: statistics.median(m["iteration_s"] for m in r["metrics"] if "loss" in m)
                               for k, r in (("baseline", base), ("flagship", flag))},
        "dp_payload_bytes_per_iteration": {"baseline": round(pay(base)), "flagship": round(pay(flag))},
        "transitions": [{k: t.get(k) for k in ("step", "frozen_before", "frozen_after", "counts", "placement")}
                        for t in elastic if t.get("action") == "transition"],
        "checkpoints": [it for it, _ in curve], "resume": flag["resume"]["iteration"],
        "stage_sizes": {"baseline": [len(p) for p in base["schedule"].placement],
                        "flagship": [len(p) for p in flag["schedule"].placement]},
        "times": {"baseline": base["times"], "flagship": flag["times"]},
        "quick": args.quick, "nodes": cfg_f.runtime.nodes, "time_scale": cfg_f.runtime.time_scale,
    }


def print_table(out: dict) -> None:
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    print(f"\n{'figure':<52}{'value':>14}{'target':>12}")
    print("-" * 78)
    for name, v, tgt in (
            ("wall-clock to the baseline's final val loss (x)", fmt(out["speedup_to_baseline_loss"], "{:.2f}x"), ">= 3x"),
            ("val loss at equal tokens (flagship / baseline)", fmt(out["final_loss_ratio"], "{:.4f}"), "<= 1.03"),
            ("samples lost", str(out["samples_lost"]), "0"), ("samples repeated", str(out["samples_repeated"]), "0"),
            ("baseline: s to its final val loss", fmt(out["baseline_s_to_final"], "{:.1f}"), ""),
            ("flagship: s to that loss (iteration)", f"{fmt(out['flagship_s_to_baseline_loss'], '{:.1f}')} "
             f"({out['flagship_iteration_at_baseline_loss']})", ""),
            ("median iteration s baseline / flagship", f"{out['median_iteration_s']['baseline']:.2f}/"
             f"{out['median_iteration_s']['flagship']:.2f}", ""),
            ("DP payload B/iteration baseline / flagship", f"{out['dp_payload_bytes_per_iteration']['baseline']}/"
             f"{out['dp_payload_bytes_per_iteration']['flagship']}", "")):
        print(f"{name:<52}{v:>14}{tgt:>12}")
    print("\nevents:")
    for ev in out["events"]:
        extra = {k: ev[k] for k in ("node", "iteration", "after_iteration", "detect_s", "recover_s", "stage",
                                    "resumed_from_iteration", "iterations_redone", "back_to_work_s", "admitted")
                 if ev.get(k) is not None}
        print(f"  {ev['kind']:<24} {extra}")
    print(f"freeze transitions: {[(t['step'], t['frozen_after'], t['counts']) for t in out['transitions']]}")
    print(f"checkpoints (val loss): {[(i, round(v, 3)) for i, v in out['flagship_val_curve']]}")


def run_both(args, s: dict, cfg_b, cfg_f, topo, data: Path, work: Path) -> dict:
    """The baseline and the flagship under ``work``, the flagship's checkpoint curve, the figures
    and the pictures."""
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; {s['nodes']} node processes (+1 "
          f"joining), model {cfg_b.model.d_model}x{cfg_b.model.n_layers} in {cfg_b.model.n_stages} stages, "
          f"baseline {cfg_b.train.steps} / flagship {cfg_f.train.steps} iterations; runs in "
          f"{work}", flush=True)
    base = run_baseline(cfg_b, topo, data, work / "baseline")
    print(f"baseline: {base['wall_s']:.0f} s, validation loss {base['val_loss']:.4f}", flush=True)
    flag = run_flagship(cfg_f, topo, data, work / "flagship", args.quick)
    curve = checkpoint_curve(cfg_f, data, flag["root"])
    out = summarize(args, cfg_b, cfg_f, base, flag, curve, work / "flagship")
    if args.gantt:
        out["gantt"] = gantt(Path(args.gantt), cfg_f, flag, topo, work / "flagship")
    if args.png:
        plot(Path(args.png), base, flag, curve, out["events"], base["val_loss"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="8 nodes, a narrow model: the same path in minutes")
    ap.add_argument("--png", default=None, help="both loss curves against wall seconds, events marked")
    ap.add_argument("--gantt", default=None, help="one flagship iteration: simulated vs measured")
    ap.add_argument("--data", default=str(ROOT / "data" / "shakespeare"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=None, help="the baseline's iterations")
    ap.add_argument("--extra", type=float, default=2.0, help="flagship iterations / baseline iterations")
    ap.add_argument("--ckpt-every", type=int, default=None)
    ap.add_argument("--time-scale", type=float, default=None, help="emulated / geo12 seconds (1/16 quick, 1/6 full)")
    ap.add_argument("--keep", default=None, help="keep the run directories here")
    args = ap.parse_args(argv)
    t_all = time.time()
    s = settings(args)
    if s["iterations"] % s["ckpt_every"]:
        raise SystemExit(f"--iterations {s['iterations']} must be a multiple of --ckpt-every {s['ckpt_every']} "
                         "(the flagship's loss at equal tokens is read from its checkpoint there)")
    data = Path(args.data)
    if not (data / "manifest.json").is_file():
        raise SystemExit(f"no prepared data set at {data}: run `skiptrain prepare` (or `make demo`) first")
    cfg_b, cfg_f = configs(args, s, TokenDataset.open(data).vocab_size)
    topo = network(cfg_b, s["nodes"])
    with work_dir(args.keep, "skiptrain-flagship-") as work:
        out = run_both(args, s, cfg_b, cfg_f, topo, data, work)
    print_table(out)
    out["bench_s"] = round(time.time() - t_all, 1)
    print(f"total {out['bench_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
