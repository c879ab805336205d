"""``skiptrain launch`` (and ``skiptrain train --nodes N``): train on a local swarm of node processes.

The schedule is planned from the config's ``runtime`` section (method, topology, stage sizes,
memory, micro-batches per originator) and the model's cost model, then every iteration of the
run executes it on ``runtime.nodes`` processes (:mod:`skiptrain.runtime.launcher`).  The run
directory gets what a single-process run leaves (config.toml, metrics.jsonl, loss.png,
model.safetensors, run.json) plus ``schedule.json``, ``job.json``, the per-node timelines under
``phases/train/`` and ``gantt.png``: the measured timeline of the last iteration under the
simulator's prediction for the same schedule, on one time axis.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

from ..errors import UserError
from .options import write_output


def train_swarm(cfg, data: str, out: str, steps: int | None = None, echo: bool = True,
                restartable: bool = False, resume: str | None = None, overwrite: bool = False,
                hosts: dict | None = None) -> dict:
    """Plan, launch, collect: returns the run summary (also written to ``OUT/run.json``).

    ``resume`` (a checkpoint directory or root; ``"latest"``: the run's own) continues the job
    from that checkpoint under this config's layout, re-planned, with the exact data cursor.
    ``overwrite`` replaces a run already in ``out`` (:func:`claim_run_dir`), once the swarm is
    known to fit its nodes.  ``hosts`` (``skiptrain coordinator``): ``{"bind": (host, port),
    "secret": ...}``; no node process starts here, every node comes from its own host."""
    from ..train.rundir import claim_run_dir, prepare_run_dir
    from ..runtime.job import Job, build_cost, build_schedule, build_topology, phase_for
    from ..runtime.launcher import launch
    from ..runtime.preflight import check_swarm_memory

    rt = cfg.runtime
    start = _resume_point(cfg, out, resume, cfg.train.steps if steps is None else steps, data) if resume else None
    ds, steps = _checked_swarm_config(cfg, data, steps, start)
    check_swarm_memory(cfg)          # before the cost model profiles a layer of the model
    t0 = time.time()
    topo = build_topology(cfg, rt.nodes)
    cost = build_cost(cfg)
    dp_sync = False  # DP sync is not link-emulated: plan and simulate the pipeline with contention
    sched = build_schedule(cfg, rt.method, topo, cost, contention=True, dp_sync=dp_sync)
    sched.validate(("placement", "originators", "stage0_ends", "no_repeat", "memory"), n_nodes=topo.n)
    check_swarm_memory(cfg, sched.stages_of())    # each node's stages on its device, as planned
    claim_run_dir(out, resume=resume is not None, overwrite=overwrite)   # (refused runs delete nothing)
    outp = prepare_run_dir(out, cfg, ds.path)
    sched.save(outp / "schedule.json")
    mbs = len(sched.micro_batches)
    if echo:
        print(f"skiptrain launch: {rt.nodes} node processes, stages {[len(p) for p in sched.placement]} "
              f"(placement {sched.placement}), {mbs} micro-batches x {cfg.train.micro_batch} samples, "
              f"method {sched.method}, k={sched.skip_ratio}, m={sched.memory}, {steps} steps, "
              f"topology {topo.name}{' (emulated)' if rt.wan else ''} -> {out}", flush=True)
    rt.restartable = rt.recover and restartable
    every = _checkpoint_every(cfg, sched.placement, steps, echo)
    cfg.checkpoint.every = every
    job = Job(config=cfg.to_dict(), data_path=str(ds.path), run_dir=str(outp),
              phases=[phase_for(cfg, sched, topo, cost, "train", steps, save_weights=True)], resume=start,
              meta={"data_fingerprint": ds.fingerprint(), "run_id": secrets.token_hex(6)})
    if echo:
        _describe_checkpoints(cfg, outp, steps, start, "coordinator" if hosts else "launch")
    if rt.recover and echo and not hosts:
        print(f"recovery on: hung-peer deadline {rt.heartbeat_deadline_s or rt.timeout_s:g} s, {rt.strikes} "
              f"strike(s) for bad peers, takeover {'on' if rt.takeover else 'off'}; a stage left without replicas "
              f"starts from a checkpoint at most {rt.ckpt_max_age} iterations old, else CheckFree; nodes may join "
              f"with `skiptrain launch --join HOST:PORT` (address and secret file: {outp / 'join.json'})", flush=True)
    tb = tensorboard_log(cfg, outp)            # (None unless log.tensorboard)
    res = launch(job, timeout_s=max(3600.0, steps * 60.0), echo=echo, **(
        {"bind": hosts["bind"], "join_secret": hosts["secret"], "local": False} if hosts else {}))
    return finish_swarm_run(job, res, t0, echo, tb)


def adopt_swarm_run(run_dir: str, bind: tuple[str, int], secret: str, echo: bool = True) -> dict:
    """``skiptrain coordinator --resume`` while the run's store still serves at ``bind`` (its
    coordinator's process died, its host lives): take the live run over (the nodes trained on
    meanwhile), then end it as :func:`train_swarm` does; returns the run summary."""
    from ..runtime.job import Job
    from ..runtime.launcher import adopt

    job = Job.load(Path(run_dir) / "job.json")
    if echo:
        print(f"skiptrain coordinator: taking over the live run in {run_dir} from its store at "
              f"{bind[0]}:{bind[1]}", flush=True)
    t0 = time.time()
    from ..config import config_from_dict

    tb = tensorboard_log(config_from_dict(job.config), Path(run_dir))
    res = adopt(job, bind, secret, remote=True, timeout_s=max(3600.0, job.phases[0].iterations * 60.0), echo=echo)
    return finish_swarm_run(job, res, t0, echo, tb)


def finish_swarm_run(job, res, t0: float, echo: bool, tb=None) -> dict:
    """After the swarm of ``job`` ended (``res``: its launch result): the final validation, the loss
    plot, the measured timeline beside the simulated one, and the run summary (``run.json``)."""
    from ..config import config_from_dict
    from ..data.dataset import TokenDataset
    from ..data.loader import SampleSource
    from ..net.topology import Topology
    from ..runtime.evaluate import evaluate
    from ..runtime.event_log import membership_events
    from ..schedule.cost import CostModel
    from ..schedule.gantt import draw_side_by_side
    from ..schedule.schedule import Schedule
    from ..schedule.simulator import simulate
    from ..train.evaluate import unigram_loss
    from ..train.metrics import plot_loss
    from ..train.rundir import load_run, write_summary

    cfg, ph, start, outp = config_from_dict(job.config), job.phases[0], job.resume, Path(job.run_dir)
    rt, steps, ds = cfg.runtime, ph.iterations, TokenDataset.open(job.data_path)
    sched, topo, cost = Schedule.from_dict(ph.schedule), Topology.from_dict(ph.topology), CostModel.from_dict(ph.cost)
    mbs = len(sched.micro_batches)
    rows = [r for r in res.phase_metrics("train") if "loss" in r]   # (not the in-loop validation lines)
    if (outp / "lost_stages.json").is_file():
        for s, note in json.loads((outp / "lost_stages.json").read_text()).items():
            print(f"skiptrain launch: warning: stage {s}: {note}", file=sys.stderr, flush=True)
    baseline = unigram_loss(ds.tokens("train"), ds.tokens("val"), ds.vocab_size)
    _, model, _ = load_run(outp)
    done = max((r["step"] for r in rows), default=start["iteration"] if start else 0)
    if res.interrupted:                 # Ctrl-C / SIGTERM: every node checkpointed at a boundary
        _finish_interrupted(cfg, model, outp, done, steps, str(ds.path), t0)
    val = evaluate(model, SampleSource(ds.tokens("val"), cfg.model.seq_len, shuffle=False, name=ds.split_name("val")),
                   cfg.train.eval_batches, cfg.train.micro_batch)
    if not any("val_loss" in r and r["step"] == steps for r in res.phase_metrics("train")):
        with open(outp / "metrics.jsonl", "a") as f:       # (the loop validated at its last step otherwise)
            f.write(json.dumps({"step": steps, "time": round(time.time(), 3),
                                "tokens": steps * mbs * cfg.train.micro_batch * cfg.model.seq_len,
                                "val_loss": round(val, 5)}) + "\n")
    plot_loss(outp / "metrics.jsonl", outp / "loss.png",
              title=f"skiptrain swarm: {rt.nodes} nodes, {model.num_parameters() / 1e6:.1f}M params, "
                    f"k={cfg.train.skip_ratio}", baseline=baseline)
    rows = [r for r in rows if start is None or r["step"] > start["iteration"]]   # this launch's
    sim = simulate(sched, topo, cost, contention=True, dp_sync=False)
    # the nodes' records hold one entry per iteration of this launch (a row may lack its loss, or
    # be missing, after a recovery: counted by step, not by row)
    measured = res.timeline("train", rows[-1]["step"] - 1 - (start["iteration"] if start else 0))
    draw_side_by_side(sim.timeline, measured, outp / "gantt.png",
                      titles=(f"simulated: {sim.iteration_s:.3f} s/iteration",
                              f"measured, iteration {rows[-1]['step']}: {rows[-1]['iteration_s']:.3f} s"))
    it_s = [r["iteration_s"] for r in rows]
    summary = {"step": steps, "nodes": rt.nodes, "method": sched.method, "val_loss": val,
               "unigram_val_loss": baseline, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
               "params": model.num_parameters(), "placement": sched.placement,
               "median_iteration_s": sorted(it_s)[len(it_s) // 2], "simulated_iteration_s": sim.iteration_s,
               "seconds": round(time.time() - t0, 2), "launch_s": round(res.wall_s, 2), "data": str(ds.path),
               "membership": membership_events(outp)}
    write_summary(outp, summary)
    if tb is not None:
        tb.close()
    if echo:
        print_done(summary, str(outp))
    return summary


def print_done(summary: dict, out: str) -> None:
    """The run's last lines: its figures, and every membership event (failures, joins, refusals)."""
    s = summary
    print(f"done: {s['step']} steps on {s['nodes']} nodes, loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}, "
          f"validation loss {s['val_loss']:.4f} (unigram baseline {s['unigram_val_loss']:.4f}), median iteration "
          f"{s['median_iteration_s']:.3f} s (simulated {s['simulated_iteration_s']:.3f} s), "
          f"{s['seconds']:.0f} s; run directory: {out}", flush=True)
    if s["membership"]:
        print(f"membership: {len(s['membership'])} event(s) (run.json lists them):", flush=True)
        for e in s["membership"]:
            at = time.strftime("%H:%M:%S", time.localtime(e["time"])) if e["time"] is not None else "?"
            print(f"  {at:>8}  node {e['node']}: {e['kind']} (generation {e['gen']}): {e['cause']}", flush=True)


def tensorboard_log(cfg, outp: Path):
    """The run's TensorBoard writer, started (``log.tensorboard``), else None."""
    if not cfg.log.tensorboard:
        return None
    from ..watch.tensorboard_log import TensorBoardLog

    return TensorBoardLog(outp).start()


def _checkpoint_every(cfg, placement: list[list[int]], steps: int, echo: bool) -> int:
    """The swarm's checkpoint interval (:func:`ckpt_every_for`), said when it differs from the
    config's."""
    every = ckpt_every_for(cfg, placement, steps)
    if every != cfg.checkpoint.every and echo:
        print(f"body stage(s) {[s for s, n in enumerate(placement) if s and len(n) == 1]} have a single "
              f"node: checkpoints every {every} iterations, so a lost stage keeps its progress", flush=True)
    return every


def ckpt_every_for(cfg, placement: list[list[int]], steps: int) -> int:
    """A swarm's checkpoint interval: ``checkpoint.every``, at most ``max(1, min(10, steps // 10))``
    in recovery mode when a body stage is held by a single node (a lost stage then restarts from a
    recent checkpoint, not from CheckFree)."""
    every = cfg.checkpoint.every
    if not cfg.runtime.recover or not any(len(nodes) == 1 for nodes in placement[1:]):
        return every
    cap = max(1, min(10, steps // 10))
    return cap if not every or every > cap else every


def _resume_point(cfg, out: str, resume: str, steps: int, data: str) -> dict:
    """The checkpoint a resumed swarm starts from (``resume_point``), checked against ``steps``."""
    from ..checkpoint import store
    from ..checkpoint.training import check_same_data
    from ..data.dataset import TokenDataset
    from ..runtime.job_checkpoint import resume_point

    from .options import checkpoint_root

    root = checkpoint_root(cfg, out)
    src = root if resume == "latest" else Path(resume)
    if resume == "latest" and store.latest(root) is None:
        raise UserError(f"--resume: no committed checkpoint under {root}; train without --resume, or pass "
                        "--resume PATH to a checkpoint")
    start = resume_point(src)
    check_same_data(start["data_fingerprint"], start["data_path"], start["path"], TokenDataset.open(data))
    if start["iteration"] >= steps:
        raise UserError(f"--resume: the checkpoint {start['path']} is at iteration {start['iteration']}, the run "
                        f"has {steps} steps; pass --steps N with N > {start['iteration']} to train further")
    return start


def _describe_checkpoints(cfg, outp: Path, steps: int, start: dict | None, command: str) -> None:
    c = cfg.checkpoint
    root = c.dir or outp / "checkpoints"
    when = (f"every {c.every} iterations" if c.every and c.every < steps else "") + \
        (" and at the end" if c.final else "")
    print(f"checkpoints: {when.strip() or 'off'} in {root} (weights, optimizer and sync state of every stage; "
          f"`skiptrain {command} --resume --out {outp}` continues from the latest)"
          + (f"; resuming from {start['path']} at iteration {start['iteration']}" if start else ""), flush=True)


def _checked_swarm_config(cfg, data: str, steps: int | None, start: dict | None = None):
    """Refuse what a swarm does not run, and a checkpoint to resume (``start``) that does not fit
    its model; the data set, and the steps to train."""
    from ..data.dataset import TokenDataset
    from ..runtime.preflight import check_checkpoint_fits

    rt = cfg.runtime
    if rt.nodes < cfg.model.n_stages and not rt.node_stages.strip():
        raise UserError(f"runtime.nodes={rt.nodes} cannot serve {cfg.model.n_stages} stages; use --nodes >= "
                        f"{cfg.model.n_stages}, give a node several stages with runtime.node_stages (e.g. 0,1+2,3), "
                        "or train in one process with `skiptrain train` (no --nodes)")
    ds = TokenDataset.open(data)
    cfg.model.vocab_size = ds.vocab_size
    cfg.data.path = str(data)
    cfg.check()
    if start is not None:
        check_checkpoint_fits(start["path"], cfg.model)
    if cfg.log.tensorboard:
        from ..watch.tensorboard_log import check_available
        check_available()
    steps = cfg.train.steps if steps is None else steps
    if steps < 1:
        raise UserError(f"a swarm run needs at least one step (got {steps}); pass --steps N with N >= 1")
    cfg.train.steps = steps
    return ds, steps


def _finish_interrupted(cfg, model, outp: Path, done: int, steps: int, data: str, t0: float) -> None:
    """After a stop at an iteration boundary (the nodes checkpointed there): run.json, one line,
    and the interrupt goes on up (exit status 130)."""
    from ..runtime.event_log import membership_events
    from ..train.rundir import write_summary

    write_summary(outp, {"step": done, "nodes": cfg.runtime.nodes, "interrupted": True, "data": data,
                         "params": model.num_parameters(), "seconds": round(time.time() - t0, 2),
                         "membership": membership_events(outp)})
    print(f"skiptrain launch: interrupted after iteration {done} of {steps}: weights in "
          f"{outp / 'model.safetensors'}; `skiptrain launch --resume --out {outp}` continues from the checkpoint "
          f"of iteration {done}", file=sys.stderr, flush=True)
    raise KeyboardInterrupt


def cmd_join(target: str, secret_file: str | None) -> int:
    """``skiptrain launch --join HOST:PORT``: this process becomes a node of the running job."""

    from ..runtime.node import main as node_main

    if secret_file:
        from ..runtime.join import read_secret_file
        os.environ["SKIPTRAIN_JOIN_SECRET"] = read_secret_file(secret_file)
    if not os.environ.get("SKIPTRAIN_JOIN_SECRET"):
        raise UserError("joining needs the run's secret: --join-secret-file RUN_DIR/join_secret, or "
                        "SKIPTRAIN_JOIN_SECRET in the environment")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return node_main(["--join", target])


def cmd_launch(args: argparse.Namespace) -> int:
    from ..train.rundir import claim_run_dir
    from .options import config_from_args

    if args.join:
        return cmd_join(args.join, args.join_secret_file)
    if args.join_secret_file:
        raise UserError("--join-secret-file is the secret of a run to --join HOST:PORT; a launch makes its own "
                        "(RUN_DIR/join_secret): drop the flag, or add --join")
    if args.out is None:
        raise UserError("skiptrain launch needs --out RUN_DIR (or --join HOST:PORT to join a running job)")
    cfg = config_from_args(args, **{"data.path": args.data, "train.steps": args.steps,
                                    "train.skip_ratio": args.skip_ratio, "train.seed": args.seed,
                                    "runtime.nodes": args.nodes, "runtime.method": args.method,
                                    "runtime.topology": args.topology})
    if args.wan:
        cfg.runtime.wan = cfg.runtime.emulate_compute = True
    for flag, key in (("recover", "recover"), ("takeover", "takeover")):
        if getattr(args, flag):
            setattr(cfg.runtime, key, True)
    for flag, key in (("heartbeat_deadline", "heartbeat_deadline_s"), ("strikes", "strikes"),
                      ("ckpt_max_age", "ckpt_max_age"), ("drift_threshold", "drift_threshold")):
        if getattr(args, flag) is not None:
            setattr(cfg.runtime, key, getattr(args, flag))
    if args.ckpt_every is not None:
        cfg.checkpoint.every = args.ckpt_every
    cfg.check()  # the flags above are checked like --set values
    if not args.overwrite:   # a run already there is refused at once (--overwrite: train_swarm replaces it)
        claim_run_dir(args.out, resume=args.resume is not None)
    if cfg.runtime.takeover and not cfg.runtime.recover:
        raise UserError("--takeover needs --recover (a stage is only taken over by a run that survives failures)")
    if args.restartable and not cfg.runtime.recover:
        raise UserError("--restartable needs --recover (only a recovering run has a coordinator to restart)")
    summary = train_swarm(cfg, cfg.data.path, args.out, echo=True, restartable=args.restartable, resume=args.resume,
                          overwrite=args.overwrite)
    if args.json:
        write_output("--json", args.json, json.dumps(summary, indent=1))
    return 0


def register(sub) -> None:
    from ..config import MAX_STRIKES
    from .options import add_config_args

    p = sub.add_parser("launch", help="train on N local node processes (skip-pipeline runtime)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, default_preset="tiny")
    p.add_argument("--nodes", type=int, default=None, help="node processes (config runtime.nodes)")
    p.add_argument("--method", choices=("planner", "full_pipeline", "random_skip"), default=None,
                   help="route construction (config runtime.method)")
    p.add_argument("--topology", default=None, help="network to plan for (config runtime.topology)")
    p.add_argument("--wan", action="store_true", help="emulate the topology's links and pad compute to the cost model")
    p.add_argument("--data", default=None, help="prepared data directory (config data.path)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--skip-ratio", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="run directory (refused if it holds a run, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue the run in --out from its latest checkpoint (or CHECKPOINT), under this launch's "
                        "layout: node count, stage count and sizes may differ; its config.toml is the base config")
    g = p.add_argument_group("failures (docs/failures.md)")
    g.add_argument("--recover", action="store_true",
                   help="survive killed, hung and bad nodes (config runtime.recover); nodes may join")
    g.add_argument("--heartbeat-deadline", type=float, default=None, metavar="S",
                   help="hung-peer deadline in seconds (config runtime.heartbeat_deadline_s)")
    g.add_argument("--strikes", type=int, default=None,
                   help=f"bad payloads before a node is banned (config runtime.strikes, at most {MAX_STRIKES})")
    g.add_argument("--takeover", action="store_true", help="a replica moves into a body stage left empty")
    g.add_argument("--ckpt-every", type=int, default=None, metavar="N",
                   help="checkpoint the whole job every N iterations (config checkpoint.every)")
    g.add_argument("--ckpt-max-age", type=int, default=None, metavar="N",
                   help="a stage left without replicas starts from the job's checkpoint up to N iterations old, "
                        "else CheckFree")
    g.add_argument("--drift-threshold", type=float, default=None, metavar="F",
                   help="re-plan routes on measured times when the iteration is F (e.g. 0.3) slower than planned")
    g.add_argument("--restartable", action="store_true",
                   help="the store process and the nodes outlive this launcher: if it dies, `python -m "
                        "skiptrain.runtime.coordinator_restart --run OUT` takes over (docs/failures.md)")
    g.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="join a running --recover job as a new node (address in RUN_DIR/join.json)")
    g.add_argument("--join-secret-file", default=None, metavar="PATH",
                   help="with --join: the run's secret (RUN_DIR/join_secret), else SKIPTRAIN_JOIN_SECRET")
    p.add_argument("--json", default=None, help="write the run summary here")
    p.set_defaults(func=cmd_launch, written_paths=("--out", "--json"), output_files={"--json": ()}, writes_run_dir=True)
