"""``skiptrain train | eval | generate | demo``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..errors import UserError
from ..signals import sigterm_as_interrupt
from ..train.generate import MAX_NEW_TOKENS
from .options import add_config_args, config_from_args, write_output


def cmd_train(args: argparse.Namespace) -> int:
    from ..train.rundir import claim_run_dir
    from ..train.trainer import Trainer

    cfg = config_from_args(args, **{"data.path": args.data, "train.steps": args.steps,
                                    "train.skip_ratio": args.skip_ratio, "train.seed": args.seed})
    resume, overwrite = getattr(args, "resume", None), getattr(args, "overwrite", False)
    if not overwrite:         # a run already there is refused at once; --overwrite replaces it once checked
        claim_run_dir(args.out, resume=resume is not None)
    if getattr(args, "nodes", None) is not None:
        cfg.runtime.nodes = args.nodes
    if cfg.elastic.enabled and cfg.runtime.nodes <= 1:
        one_node_swarm(cfg)
    if cfg.runtime.nodes > 1 or cfg.elastic.enabled:  # the skip-pipeline runtime (skiptrain.runtime)
        from .launch import train_swarm

        train_swarm(cfg, cfg.data.path, args.out, resume=resume, overwrite=overwrite)
        return 0
    if resume is not None:    # checked before the run directory is touched
        resume = resume_checkpoint(cfg, args.out, resume)
    if cfg.log.tensorboard:
        from ..watch.tensorboard_log import check_available
        check_available()
    check_fits_memory(cfg)
    if args.quiet:
        cfg.train.progress = False
    # the run directory is claimed (--overwrite deletes the old run) only once the trainer has
    # checked the data set and every other input and built the model
    claim = lambda: claim_run_dir(args.out, resume=resume is not None, overwrite=overwrite)  # noqa: E731
    trainer = Trainer(cfg, args.out, claim=claim)
    if resume is not None:
        src = trainer.resume(resume)
        print(f"skiptrain train: resumed from {src} at step {trainer.step}", flush=True)
    print(f"skiptrain train: {trainer.model.num_parameters() / 1e6:.2f}M parameters, "
          f"{cfg.model.n_stages} stages {trainer.model.partition.to_list()}, "
          f"{trainer.tokens_per_step} tokens/step, {cfg.train.steps} steps -> {args.out}", flush=True)
    start = trainer.step
    from .launch import tensorboard_log
    tb = tensorboard_log(cfg, Path(args.out))      # (None unless log.tensorboard)
    try:
        with sigterm_as_interrupt():  # SIGTERM stops like Ctrl-C: the weights so far are written
            s = trainer.fit()
        if tb is not None:
            tb.close()
    except KeyboardInterrupt:          # Ctrl-C or SIGTERM: fit() wrote the weights before stopping
        latest = trainer.ckpt.manager.latest() if trainer.ckpt is not None else None
        then = (f"--resume continues from {latest}" if latest else
                "no checkpoint was written yet, so nothing can be resumed: train again with --overwrite "
                "(--set checkpoint.every=N checkpoints every N steps)")
        print(f"skiptrain train: interrupted at step {trainer.step}: {args.out}/model.safetensors holds its "
              f"weights; {then}", file=sys.stderr)
        raise
    except FloatingPointError as e:   # the loss became inf/nan: the weights written are not usable
        raise UserError(f"training diverged: {e}; the last checkpoint (if any) is under {args.out}/checkpoints")
    if s["step"] > start and not math.isfinite(s["val_loss"]):  # (no step run: nothing was validated)
        raise UserError(f"training diverged: the final validation loss is {s['val_loss']}; retrain with a lower "
                        "train.lr (the run directory holds the diverged weights)")
    if s["step"] == start:
        print(f"done: no step to train (at step {s['step']} of --steps {cfg.train.steps}); run directory: {args.out}")
        return 0
    print(f"done: step {s['step']}, validation loss {s['val_loss']:.4f} "
          f"(unigram baseline {s['unigram_val_loss']:.4f}), {s['seconds']:.0f} s; run directory: {args.out}")
    return 0


def one_node_swarm(cfg) -> None:
    """Freezing on one process is the swarm's freezing on one node that serves every stage (its
    first transition makes the model one stage and moves nothing): ``cfg`` becomes that swarm,
    with the one-process run's micro-batches (``train.n_micro``, all started by that node).  A
    ``runtime.node_stages`` given places that many nodes instead."""
    from ..config import node_stage_lists

    rt = cfg.runtime
    if rt.node_stages.strip():
        rt.nodes = len(node_stage_lists(rt.node_stages))
    else:
        rt.nodes, rt.stage_sizes = 1, ""
        rt.node_stages = "+".join(str(s) for s in range(cfg.model.n_stages))
        rt.mb_per_originator = cfg.train.n_micro
    cfg.check()


def resume_checkpoint(cfg, out: str, resume: str) -> Path:
    """The checkpoint ``--resume`` (``"latest"``: the run's own newest) continues from; refused when
    it is already at ``train.steps`` (training on would run no step, and rewrite the run's weights
    and run.json from it)."""
    from ..checkpoint.reader import CheckpointReader
    from ..checkpoint.training import check_same_data
    from ..data.dataset import TokenDataset

    from .options import checkpoint_root

    root = checkpoint_root(cfg, out)
    reader = CheckpointReader(root if resume == "latest" else resume)
    st = reader.state
    check_same_data(st.get("data_fingerprint"), ((st.get("config") or {}).get("data") or {}).get("path"),
                    reader.path, TokenDataset.open(cfg.data.path))
    if reader.step >= cfg.train.steps:
        raise UserError(f"--resume: the checkpoint {reader.path} is at step {reader.step}, the run has "
                        f"{cfg.train.steps} steps; pass --steps N with N > {reader.step} to train further")
    return reader.path


def check_fits_memory(cfg) -> None:
    """Refuse, before the data set is even opened, a one-process run that cannot fit this
    machine: :func:`skiptrain.model.device.check_stages_fit` (the check the trainer makes against
    its device) with one micro-batch in flight, against the machine's memory."""
    from ..model.device import check_stages_fit

    t = cfg.train
    check_stages_fit(cfg.model, list(range(cfg.model.n_stages)), "cpu", t.micro_batch, 1, t.precision,
                     where="this machine")


def _route_from_args(args, n_stages: int):
    from ..schedule.routes import drop_route

    try:
        drop = [int(s) for s in args.drop_stages.split(",") if s.strip()] if args.drop_stages else []
    except ValueError:
        raise UserError(f"--drop-stages {args.drop_stages!r}: expected body-stage numbers separated by "
                        "commas, e.g. --drop-stages 2,4") from None
    if not drop and not args.drop_fraction:
        return None
    return drop_route(n_stages, drop, args.drop_fraction, args.seed)


def cmd_eval(args: argparse.Namespace) -> int:
    from ..data.dataset import TokenDataset
    from ..data.loader import SampleSource
    from ..train.evaluate import perplexity
    from ..runtime.evaluate import evaluate
    from ..train.rundir import load_run

    if args.batches < 1:
        raise UserError(f"--batches {args.batches}: evaluate at least 1 micro-batch (e.g. --batches 16)")
    cfg, model, _ = load_run(args.run_dir)
    ds = TokenDataset.open(args.data or cfg.data.path)
    if ds.vocab_size != cfg.model.vocab_size:
        raise UserError(f"data set {ds.path} has vocabulary {ds.vocab_size} but the run was trained with "
                        f"{cfg.model.vocab_size}; pass the --data the run was trained on")
    route = _route_from_args(args, cfg.model.n_stages)
    src = SampleSource(ds.tokens(args.split), cfg.model.seq_len, shuffle=False, name=ds.split_name(args.split))
    loss = evaluate(model, src, args.batches, cfg.train.micro_batch, route=route)
    if not math.isfinite(loss):
        raise UserError(f"{args.split} loss is {loss}: the model's weights diverged (too large to give a finite "
                        "loss); retrain with a lower train.lr")
    result = {"val_loss": loss, "perplexity": perplexity(loss), "split": args.split,
              "route": route if route is not None else list(range(1, cfg.model.n_stages)),
              "samples": min(args.batches * cfg.train.micro_batch, src.n)}
    print(f"{args.split} loss {loss:.4f}, perplexity {result['perplexity']:.2f}, body stages {result['route']}")
    if args.json:
        write_output("--json", args.json, json.dumps(result, indent=1))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from ..train.generate import check_request, sample_tokens, stream_text
    from ..train.rundir import load_run

    check_request(args.tokens, args.temperature, args.seed, args.prompt)
    cfg, model, tok = load_run(args.run_dir)
    route = _route_from_args(args, cfg.model.n_stages)
    ids = tok.encode(args.prompt) or [0]
    g = torch.Generator().manual_seed(args.seed)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    write(tok.decode(ids))
    stream_text(tok, sample_tokens(model, ids, args.tokens, temperature=args.temperature, route=route,
                                   generator=g), write)
    write("\n")
    return 0


#: The embedded default run: a local swarm of node processes with every idea on: 3 stage-0 nodes
#: and 3 body stages with 2 replicas each, skip routes (k=0.33) planned for geo12's links, int8
#: activations on its slow links, DeMo between replicas, elastic freezing, job checkpoints.
DEMO_SWARM = ["runtime.nodes=9", "runtime.stage_sizes=3,2,2,2", "runtime.mb_per_originator=2",
              "runtime.method=planner", "runtime.topology=geo12", "runtime.act_codec=int8",
              "train.skip_ratio=0.33", "train.steps=150", "train.warmup_steps=15", "runtime.timeout_s=60",
              "dp.strategy=demo", "dp.topk=8", "dp.values=sign1", "dp.indices=u12",
              "elastic.enabled=true", "elastic.cache=off", "elastic.check_every=10",
              "checkpoint.every=25"]


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded default: prepare the data if needed, train the `small` preset on a local swarm
    of node processes (``--nodes 1``: in one process), sample text."""
    from .data import cmd_prepare

    data = Path(args.data)
    if not (data / "manifest.json").is_file():
        print(f"[demo] preparing the default corpus into {data}", flush=True)
        cmd_prepare(argparse.Namespace(out=str(data), text=None, ood_text=None, tokenizer="bpe",
                                       vocab_size=4096, val_fraction=0.05))
    t0 = time.time()
    nodes = getattr(args, "nodes", None)
    overrides = list(args.overrides)
    if nodes is None or nodes > 1:  # the swarm, unless --nodes 1
        swarm = [o for o in DEMO_SWARM if nodes is None or not o.startswith(("runtime.nodes=", "runtime.stage_sizes="))]
        overrides = swarm + ([f"runtime.nodes={nodes}"] if nodes else []) + overrides
    train_args = argparse.Namespace(preset=args.preset, config=args.config, overrides=overrides,
                                    data=str(data), steps=args.steps, skip_ratio=None, seed=None,
                                    out=args.out, quiet=False, nodes=nodes, overwrite=True)
    cmd_train(train_args)
    if nodes is None or nodes > 1:
        print("\n[demo] what each idea did:\n" + "\n".join(demo_summary(Path(args.out))), flush=True)
    print("\n[demo] a sample from the trained model:\n", flush=True)
    cmd_generate(argparse.Namespace(run_dir=args.out, prompt="ROMEO.\n", tokens=120, temperature=0.8,
                                    seed=0, drop_stages=None, drop_fraction=0.0))
    print(f"\n[demo] finished in {time.time() - t0:.0f} s. Run directory: {args.out} "
          "(metrics.jsonl, loss.png, model.safetensors, config.toml)")
    return 0


def demo_summary(run: Path) -> list[str]:
    """One line per idea of a swarm run in ``run``: the routes, the bytes the compressions saved,
    the layers frozen, the checkpoints written."""
    import json

    from ..checkpoint import store as ckstore
    from ..config import build_config
    from ..runtime.job import build_cost, build_topology
    from ..schedule.schedule import Schedule
    from ..watch.ideas import activation_bytes, skip_savings

    cfg = build_config(toml_path=run / "config.toml")
    sched = Schedule.load(run / "schedule.json")
    skip = skip_savings(sched, 0)
    out = [f"  skip routes:   {skip['micro_batches']} micro-batches, each through {min(skip['route_lengths'])}-"
           f"{max(skip['route_lengths'])} of {skip['body_stages']} body stages (k={sched.skip_ratio}), planned by "
           f"{sched.method} for {cfg.runtime.topology}'s links"]
    topo, cost = build_topology(cfg, cfg.runtime.nodes), build_cost(cfg, s_per_sample_layer=1.0)
    act = activation_bytes(cfg, sched, topo, cost)   # activations forward, their gradients backward
    out.append(f"  activations:   {act['slow_hops']} of {act['hops']} hops per iteration on slow links carry "
               f"{act['codec']}: {act['sent_bytes'] / 2**20:.1f} MiB instead of {act['fp32_bytes'] / 2**20:.1f} MiB "
               f"(activations and gradients)")
    sync = [json.loads(f.read_text()).get("sync_summary") for f in (run / "phases" / "train").glob("node*.json")]
    sync = [x for x in sync if x]
    if sync:
        pay = sum(x["payload_bytes_per_step"] for x in sync)
        dense = sum(x["dense_fp32_payload_bytes"] for x in sync)
        out.append(f"  data parallel: {cfg.dp.strategy} sent {pay / 2**10:.1f} KiB per iteration over all replicas, "
                   f"a dense fp32 all-reduce {dense / 2**20:.1f} MiB ({dense / max(pay, 1):.0f}x fewer bytes)")
    log = run / "elastic.jsonl"
    trans = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    trans = [t for t in trans if t.get("action") == "transition"]
    out.append("  freezing:      " + ("; ".join(f"iteration {t['step']}: {t['frozen_before']} -> {t['frozen_after']} "
                                              f"layers frozen, stages {t['counts']}" for t in trans)
                                   or "no layer froze"))
    ckpts = ckstore.list_committed(run / "checkpoints")
    out.append(f"  checkpoints:   {len(ckpts)} kept under {run / 'checkpoints'} (iterations "
               f"{[s for s, _ in ckpts]}); resume with `skiptrain train --resume --out {run}`")
    return out


def _add_drop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drop-stages", metavar="S1,S2", help="body stages to remove, e.g. 2,4")
    p.add_argument("--drop-fraction", type=float, default=0.0, help="remove this fraction of body stages at random")
    p.add_argument("--seed", type=int, default=0, help="seed for --drop-fraction (and sampling)")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (single process)")
    add_config_args(p)
    p.add_argument("--data", help="prepared data directory (config data.path)")
    p.add_argument("--steps", type=int, help="optimizer steps (config train.steps)")
    p.add_argument("--skip-ratio", type=float, help="random skip training with ratio k (config train.skip_ratio)")
    p.add_argument("--seed", type=int, help="config train.seed")
    p.add_argument("--out", required=True, help="run directory to write (refused if it holds a run, unless "
                                                   "--resume or --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (its weights, metrics and checkpoints are deleted)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nodes", type=int, default=None,
                   help="train on N local node processes (skip-pipeline runtime, config runtime.nodes); 1 = single process")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the latest checkpoint under OUT/checkpoints (or the given checkpoint "
                        "directory or root): same loss curve as an uninterrupted run")
    p.set_defaults(func=cmd_train, written_paths=("--out",), writes_run_dir=True)

    p = sub.add_parser("eval", help="validation loss/perplexity of a trained run, optionally with stages removed")
    p.add_argument("run_dir")
    p.add_argument("--data", help="data directory (default: the one the run trained on)")
    p.add_argument("--split", default="val", choices=("val", "ood", "train"))
    p.add_argument("--batches", type=int, default=16, help="micro-batches to evaluate")
    p.add_argument("--json", metavar="PATH", help='write {"val_loss": ..., "perplexity": ...}')
    _add_drop_args(p)
    p.set_defaults(func=cmd_eval, written_paths=("--json",), output_files={"--json": ()})

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--tokens", type=int, default=200,
                   help=f"new tokens to sample, streamed as they come (at most {MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0 = most likely token)")
    _add_drop_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the embedded default: prepare Shakespeare, train the small model, sample")
    add_config_args(p)
    p.add_argument("--data", default="data/shakespeare")
    p.add_argument("--out", default="runs/demo", help="run directory (replaced if it holds a run)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--nodes", type=int, default=None,
                   help="node processes of the local swarm (default: 9 on a planned skip schedule; 1 = single process)")
    p.set_defaults(func=cmd_demo, written_paths=("--out",), writes_run_dir=True)
