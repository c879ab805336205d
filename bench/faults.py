"""Fault bench (issue 8): one scripted run of 12 node processes on emulated geo12 links with
kill -9, SIGSTOP, a whole body stage lost, a stage-0 node lost, a node joining and a wrong-secret
intruder; per event time to detect, time to recover, iterations lost, samples lost/repeated; the
final validation loss against the same run without events.

Set-up (2 CPU cores shared by 12+ processes, so everything is small and emulated):

* model: the ``tiny`` preset (d=64, 4 layers, 4 stages: stage 0 = embedding + 1 layer + head,
  three body stages of one layer), byte tokenizer on the test excerpts (Hamlet + Macbeth);
* 12 nodes, stage sizes 3/3/4/2, planner schedule with k = 0.33 (each micro-batch skips one of
  the three body stages), 2 micro-batches per originator (6 per iteration, 48 samples);
* geo12 links emulated in the transport (:mod:`skiptrain.runtime.wan`): latencies x ``tau``,
  bandwidths / ``tau`` (``tau`` = 1/24 here), 64 emulated bytes per real byte, 0.35 s x tau
  per hop; compute padded to SkipPipe's 0.22 s per sample per layer x tau (one task: 8 samples,
  0.07 s).  The topology has 13 nodes: node 12 is the slot of the joining node;
* recovery on: heartbeat every 0.25 s, hung-peer deadline 3 s; per-stage weights checkpoints
  every 2 iterations, used for a stage without replicas when at most 8 iterations old.

Script (full; ``--quick`` = the same events two iterations apart, 14 iterations):

1. iteration 3: kill -9 a stage-1 replica 0.3 s into the iteration;
2. iteration 6: SIGSTOP a stage-2 replica (found by the heartbeat deadline, then fenced);
3. iteration 9: kill -9 both stage-3 replicas at once (stage 3 is skipped from then on);
4. iteration 12: kill -9 a stage-0 originator (its micro-batches go to the other originators);
5. after iteration 13 ends: a new process runs ``python -m skiptrain.runtime.node --join HOST:PORT``
   with the run's secret; it is placed on the empty stage 3 and starts at an iteration boundary;
6. two iterations later: a process with a wrong secret tries to join (the job description it reads
   from the store does not verify with its secret: it stops before it says hello, never in a group).

Per event: ``detect_s`` (fault -> coordinator's decision; for a join: hello -> admitted; the
intruder's row has ``process_s``, its whole life from spawn to exit), ``recover_s`` (detection -> the last survivor back at work; for a
join: join generation published -> every node switched and the joiner holds its state),
``iterations_lost`` (iteration attempts abandoned), ``samples_lost`` / ``samples_repeated`` (over
the iterations the event touched).  ``final_loss_ratio``: validation loss of the final merged
model over the same launch without events (same schedule, same data order).

    .venv/bin/python bench/faults.py [--quick] [--json runs/bench/faults.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.dataset import TokenDataset  # noqa: E402
from skiptrain.net.topology import load_topology  # noqa: E402
from bench._events import spawn_joiner, steps_done, validation_loss  # noqa: E402
from bench._data import excerpt_data  # noqa: E402
from bench._workdir import work_dir  # noqa: E402
from skiptrain.runtime.faults import faulty_job  # noqa: E402
from skiptrain.runtime.job import Job, build_cost, build_schedule, phase_for, with_runtime  # noqa: E402
from skiptrain.runtime.join import EXIT_REFUSED  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402
from skiptrain.runtime.recovery import trained_samples  # noqa: E402
from skiptrain.runtime.wan import scale_topology  # noqa: E402
from skiptrain.schedule.simulator import simulate  # noqa: E402

PAPER_S_PER_SAMPLE_LAYER = 0.055 * 4   # as bench/runtime_geo.py
SIZES = "3,3,4,2"


def setup(args, data: Path):
    tau = args.time_scale
    cfg = build_config("tiny", overrides={
        "train": {"skip_ratio": 0.33, "max_swaps": 0, "micro_batch": 8, "seed": 1234, "grad_clip": 1.0,
                  "warmup_steps": 2, "steps": args.iterations, "eval_batches": 16},
        "runtime": {"nodes": 12, "stage_sizes": SIZES, "topology": "geo12", "wan": True, "emulate_compute": True,
                    "time_scale": tau, "bytes_scale": 64, "hop_overhead_s": 0.35 * tau,
                    "s_per_sample_layer": PAPER_S_PER_SAMPLE_LAYER * tau, "memory": 3, "mb_per_originator": 2,
                    "plan_seed": 0, "timeout_s": 20.0},
        "checkpoint": {"every": 2}})
    cfg.model.vocab_size = TokenDataset.open(data).vocab_size
    topo13 = scale_topology(load_topology("geo12", 13), tau)      # node 12: the joining node's slot
    topo12 = topo13.subset(list(range(12)))
    cost = build_cost(cfg)
    sched = build_schedule(cfg, "planner", topo12, cost, contention=True, dp_sync=False)
    sim = simulate(sched, topo13, cost, contention=True, dp_sync=False)
    return cfg, topo13, cost, sched, sim.iteration_s


def script(sched, quick: bool, iteration_s: float) -> tuple[list[dict], dict]:
    P = sched.placement
    gap = 2 if quick else 3
    its = [gap * (i + 1) for i in range(4)]
    events = [
        {"kind": "kill -9 body replica (mid-iteration)", "faults": [
            {"node": P[1][-1], "kind": "kill", "iteration": its[0], "delay_s": round(0.3 * iteration_s, 3)}]},
        {"kind": "SIGSTOP body replica", "faults": [{"node": P[2][-1], "kind": "hang", "iteration": its[1]}]},
        {"kind": "kill every replica of body stage 3", "faults": [
            {"node": n, "kind": "kill", "iteration": its[2]} for n in P[3]]},
        {"kind": "kill -9 stage-0 node", "faults": [{"node": P[0][-1], "kind": "kill", "iteration": its[3]}]},
    ]
    return events, {"join_after": its[3] + 1, "intruder_after": its[3] + 3}


def run_once(cfg, topo, cost, sched, data: Path, run: Path, iterations: int, faults: list[dict],
             joins: dict | None, deadline_s: float) -> dict:
    phase = phase_for(cfg, sched, topo, cost, "train", iterations, save_weights=True)
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=cfg.runtime.timeout_s, heartbeat_s=0.25, heartbeat_deadline_s=deadline_s, recover=True, ckpt_max_age=8),
              data_path=str(data), run_dir=str(run), phases=[phase], **faulty_job(faults) if faults else {})
    out: dict = {}

    def go():
        try:
            out["res"] = launch(job, timeout_s=900)
        except BaseException as e:  # noqa: BLE001
            out["err"] = e

    th = threading.Thread(target=go, daemon=True)
    t0 = time.time()
    th.start()
    spawned: dict[str, subprocess.Popen] = {}
    while th.is_alive():
        if joins:
            done = steps_done(run)
            if "joiner" not in spawned and done >= joins["join_after"] and (run / "join_secret").exists():
                spawned["joiner"] = spawn_joiner(run, (run / "join_secret").read_text(), "joiner")
                spawned["joiner"].t_spawn = time.time()
            if "intruder" not in spawned and done >= joins["intruder_after"] and (run / "join.json").exists():
                spawned["intruder"] = spawn_joiner(run, "a-wrong-secret", "intruder")
                spawned["intruder"].t_spawn = time.time()
        for p in spawned.values():
            if getattr(p, "t_exit", None) is None and p.poll() is not None:
                p.t_exit = time.time()
        th.join(timeout=0.1)
    for p in spawned.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    if "err" in out:
        raise out["err"]
    return {"res": out["res"], "wall_s": time.time() - t0,
            "spawned": {k: {"code": p.returncode, "s": getattr(p, "t_exit", time.time()) - p.t_spawn}
                        for k, p in spawned.items()}}


def analyse(run: Path, events: list[dict], gb: int, iterations: int, spawned: dict) -> list[dict]:
    rec = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
    nodes = {}
    for f in (run / "phases" / "train").glob("node*.json"):
        nodes[int(f.stem[4:])] = json.loads(f.read_text())
    per_it = trained_samples(run / "phases" / "train")

    def sample_check(its: set[int]) -> tuple[int, int]:
        lost = rep = 0
        for it in its:
            got = per_it.get(it, [])
            lost += len(set(range(it * gb, (it + 1) * gb)) - set(got))
            rep += len(got) - len(set(got))
        return lost, rep

    def node_recoveries(gens: set[int]) -> list[dict]:
        return [r for n in nodes.values() for r in n["recoveries"] if r["gen"] in gens]

    rows = []
    for ev in events:
        victims = {f["node"] for f in ev["faults"]}
        mine = [r for r in rec if r["node"] in victims and not r.get("join")]
        gens = {r["gen"] for r in mine}
        nr = node_recoveries(gens)
        its = {f["iteration"] for f in ev["faults"]} | {r["iteration"] for r in nr}
        lost, rep = sample_check(its)
        attempts = max((sum(1 for r in n["recoveries"] if r["gen"] in gens and not r["committed"])
                        for n in nodes.values()), default=0)
        rows.append({"kind": ev["kind"], "nodes": sorted(victims),
                     "detect_s": max((r["detect_s"] for r in mine if r["detect_s"] is not None), default=None),
                     "recover_s": max((r["recover_s"] for r in nr), default=None),
                     "iterations_lost": attempts, "samples_lost": lost, "samples_repeated": rep,
                     "generations": sorted(gens), "detected": len(mine) == len(victims),
                     "causes": [r["cause"][:120] for r in mine]})
    joined = [r for r in rec if r.get("join") and not r.get("refused")]
    if joined:
        j = joined[0]
        jn = nodes.get(j["node"], {})
        ji = jn.get("joined", {})
        its = {ji.get("iteration", -1)}
        lost, rep = sample_check(its)
        attempts = max((sum(1 for r in n["recoveries"] if r["gen"] == j["gen"] and not r["committed"])
                        for n in nodes.values()), default=0)
        rows.append({"kind": "new node joins", "nodes": [j["node"]], "detect_s": j["detect_s"],
                     "recover_s": j["recover_s"], "iterations_lost": attempts, "samples_lost": lost,
                     "samples_repeated": rep, "generations": [j["gen"]], "stage": j["choice"]["stage"],
                     "choice": j["choice"], "joined_at_iteration": ji.get("iteration"), "init": ji.get("init"),
                     "checkpoint": ji.get("checkpoint"), "checkpoint_age": ji.get("checkpoint_age"),
                     "trained_iterations": len(jn.get("iterations", []))})
    else:
        rows.append({"kind": "new node joins", "detect_s": None, "recover_s": None, "iterations_lost": None,
                     "samples_lost": None, "samples_repeated": None, "error": "no join recorded"})
    # the intruder stops itself: the job description it reads does not verify with its secret
    log = (run / "logs" / "intruder.log").read_text() if (run / "logs" / "intruder.log").exists() else ""
    intruder = spawned.get("intruder") or {}
    refused = intruder.get("code") == EXIT_REFUSED and "does not verify" in log
    rows.append({"kind": "wrong-secret join attempt", "nodes": [], "detect_s": None,
                 "recover_s": 0.0 if refused else None, "iterations_lost": 0 if refused else None,
                 "samples_lost": 0, "samples_repeated": 0, "refused": refused,
                 "process_s": round(intruder["s"], 3) if intruder else None,
                 "said_hello": any(r.get("join") and r.get("refused") for r in rec),
                 "entered_a_group": "generation" in log, "cause": log.strip().splitlines()[-1] if log.strip() else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="events two iterations apart, 14 iterations")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--time-scale", type=float, default=1 / 24)
    ap.add_argument("--deadline", type=float, default=3.0, help="heartbeat deadline (s) for hung peers")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = ap.parse_args()
    args.iterations = args.iterations or (14 if args.quick else 24)
    torch.set_num_threads(1)
    with work_dir(args.keep, "bench_faults_") as root:
        return run(args, root)


def run(args, root: Path) -> int:
    """The bench's two runs under ``root``, the table and the JSON."""
    data = excerpt_data(root)
    cfg, topo, cost, sched, sim_s = setup(args, data)
    events, joins = script(sched, args.quick, sim_s)
    if joins["intruder_after"] + 2 > args.iterations:
        raise SystemExit(f"--iterations {args.iterations} is too short for the script (needs > "
                         f"{joins['intruder_after'] + 2})")
    gb = len(sched.micro_batches) * cfg.train.micro_batch
    print(f"12 nodes, stages {[len(p) for p in sched.placement]} (placement {sched.placement}), "
          f"{len(sched.micro_batches)} micro-batches x {cfg.train.micro_batch}, simulated iteration {sim_s:.3f} s, "
          f"{args.iterations} iterations", flush=True)
    t = time.time()
    base = run_once(cfg, topo, cost, sched, data, root / "no_events", args.iterations, [], None, args.deadline)
    base_loss = validation_loss(cfg, data, root / "no_events")
    print(f"no events: {base['wall_s']:.0f} s, validation loss {base_loss:.4f}", flush=True)
    faults = [f for ev in events for f in ev["faults"]]
    fr = run_once(cfg, topo, cost, sched, data, root / "events", args.iterations, faults, joins, args.deadline)
    loss = validation_loss(cfg, data, root / "events")
    rows = analyse(root / "events", events, gb, args.iterations, fr["spawned"])
    done_base, done = base["res"].phase_iterations("train"), fr["res"].phase_iterations("train")
    its_base = [m["iteration_s"] for m in done_base]
    its_ev = [m["iteration_s"] for m in done]
    out = {"events": rows, "final_loss_ratio": loss / base_loss, "final_val_loss": loss,
           "final_val_loss_no_events": base_loss, "quick": args.quick, "iterations": args.iterations,
           "nodes": 12, "stage_sizes": [len(p) for p in sched.placement], "simulated_iteration_s": sim_s,
           "median_iteration_s_no_events": sorted(its_base)[len(its_base) // 2],
           "iteration_s_events": its_ev, "steps_completed": len(done),
           "nodes_per_iteration": [m.get("nodes") for m in done],
           "heartbeat_deadline_s": args.deadline, "time_scale": args.time_scale,
           "wall_s": round(time.time() - t, 1), "run_dir": str(args.keep) if args.keep else None}
    print(f"\n{'event':40s} {'detect s':>9s} {'recover s':>10s} {'iters lost':>10s} {'samples lost/rep':>16s}")
    for r in rows:
        d = "-" if r["detect_s"] is None else f"{r['detect_s']:.3f}"
        rc = "-" if r["recover_s"] is None else f"{r['recover_s']:.3f}"
        il = "-" if r["iterations_lost"] is None else str(r["iterations_lost"])
        sl = "-" if r["samples_lost"] is None else f"{r['samples_lost']}/{r['samples_repeated']}"
        print(f"{r['kind'][:40]:40s} {d:>9s} {rc:>10s} {il:>10s} {sl:>16s}")
    j = next(r for r in rows if r["kind"] == "new node joins")
    print(f"join: node {j.get('nodes')} -> stage {j.get('stage')} ({(j.get('choice') or {}).get('rule')}), "
          f"at iteration {j.get('joined_at_iteration')}, init: {j.get('init')}")
    w = next(r for r in rows if r["kind"] == "wrong-secret join attempt")
    print(f"wrong-secret node: refused {w['refused']} (exit status {EXIT_REFUSED}, {w['process_s']} s from spawn to "
          f"exit), said hello {w['said_hello']}, entered a group {w['entered_a_group']}")
    print(f"final validation loss {loss:.4f} vs {base_loss:.4f} without events: ratio {loss / base_loss:.4f} "
          f"(target within 2%); {len(done)}/{args.iterations} iterations; nodes per iteration "
          f"{out['nodes_per_iteration']}; median iteration {out['median_iteration_s_no_events']:.3f} s without "
          f"events (simulated {sim_s:.3f} s); wall {out['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
