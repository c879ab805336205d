"""Checkpoint stall and throughput: skiptrain vs synchronous torch.save vs DCP async_save.

For each model (the `small` preset, and unless --quick a model with about 1 GiB of parameter +
AdamW state) with the same state in one run:

* stall: seconds the training loop is blocked per save.  skiptrain (the trainer's default,
  ``overlap=True``): the ``save_training`` call plus any wait at the next ``optimizer.step()``
  while the snapshot copy runs beside a real forward/backward of the same model; skiptrain
  blocking: ``save_training(overlap=False)``, which returns after the copy into reused host
  buffers; torch.save: the whole synchronous save; DCP: the ``async_save`` call.  In all cases
  the previous save has finished (as with any save interval longer than the write).
  skiptrain's first save (buffers allocated and paged in) is reported separately.
* save_GBps: state bytes / (save call until committed: written, fsynced, renamed, LATEST
  durable; deleting the older checkpoint for keep-last-k happens after and is not counted).
* load_GBps: state bytes / restore into a fresh model + optimizer with checksums verified, the
  files evicted from the page cache first (posix_fadvise DONTNEED after fsync), so it reads disk.
* disk_write_GBps: the disk's own bandwidth in the same run: one file of the same size written
  in 16 MiB writes then fsynced (median of measurements before and after the saves).
* loop_slowdown: training-step time of the small model while a skiptrain save of the largest
  state is being written in the background, divided by the idle step time (the cost of doing the
  I/O on a thread of the training process).

Swarm figures (``bench/_swarm_checkpoint.py``): the per-iteration slowdown of a 9-node swarm that
checkpoints the whole job every iteration against the same swarm not saving, and a crash loop of
whole-job SIGKILLs during saves, each resumed from ``LATEST`` (which must load and verify).

Everything is written to a temporary directory that is deleted at the end.

    python bench/checkpoint.py [--quick] [--json PATH] [--reps N] [--dir DIR] [--trials N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skiptrain.checkpoint.manager import CheckpointManager  # noqa: E402
from skiptrain.config import build_config  # noqa: E402
from skiptrain.model.transformer import StagedLM  # noqa: E402
from skiptrain.optim import build_adamw  # noqa: E402

GiB = 1 << 30


def make_state(kind: str):
    if kind == "small":
        cfg = build_config("small", overrides={"model": {"seq_len": 32}})
    else:  # ~92M parameters: 4 bytes x (param + exp_avg + exp_avg_sq) = ~1.03 GiB
        cfg = build_config("small", overrides={"model": {"vocab_size": 8192, "d_model": 1024, "n_layers": 6,
                                                         "n_heads": 16, "n_kv_heads": 16, "seq_len": 16,
                                                         "n_stages": 4}})
    model = StagedLM(cfg.model, seed=0)
    opt = build_adamw(model.named_parameters(), cfg.train)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()  # materialise the AdamW state
    opt.zero_grad(set_to_none=True)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    return cfg, model, opt, x, nbytes


def evict(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_write(dirpath: Path, nbytes: int) -> float:
    buf = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
    mv = memoryview(buf)
    path = dirpath / "disk-test.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, mv[: min(left, len(mv))])
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes / dt / 1e9


def bench_model(kind: str, reps: int, work: Path) -> dict:
    cfg, model, opt, x, nbytes = make_state(kind)
    res: dict = {"model": kind, "params": model.num_parameters(), "state_GiB": nbytes / GiB}
    disk = [disk_write(work, nbytes)]

    # synchronous torch.save of the same state
    ts = []
    for i in range(reps):
        p = work / f"torch-{i}.pt"
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, p)
        ts.append(time.perf_counter() - t0)
        p.unlink()
    res["torch_save_s"] = statistics.median(ts)

    # torch.distributed.checkpoint async_save
    import torch.distributed.checkpoint as dcp
    ds = []
    for i in range(reps):
        d = work / f"dcp-{i}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            fut = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(d))
            ds.append(time.perf_counter() - t0)
            fut.result()
        shutil.rmtree(d)
    res["dcp_async_s"] = statistics.median(ds)

    # skiptrain, blocking snapshot: save() returns once the copy into reused buffers is done
    root = work / "skiptrain"
    mgr = CheckpointManager(root, keep=1)
    stalls, totals = [], []
    step = 0
    for i in range(reps + 1):
        step += 1
        t0 = time.perf_counter()
        stall = mgr.save_training(step, model, opt, {"step": step})
        mgr.wait()
        total = mgr.last_timings["committed"] - t0  # pruning the older checkpoint comes after
        if i == 0:
            res["skiptrain_first_stall_s"] = stall
        else:
            stalls.append(stall)
            totals.append(total)
    res["skiptrain_blocking_stall_s"] = statistics.median(stalls)
    res["save_GBps"] = nbytes / statistics.median(totals) / 1e9

    path = mgr.latest()
    loads = []
    for _ in range(reps):
        evict(path)
        m2 = StagedLM(cfg.model, seed=1)
        o2 = build_adamw(m2.named_parameters(), cfg.train)
        t0 = time.perf_counter()
        CheckpointManager.restore(path, m2, o2)
        loads.append(time.perf_counter() - t0)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
        del m2, o2
    res["load_GBps"] = nbytes / statistics.median(loads) / 1e9

    # skiptrain, overlapped snapshot (the trainer's default): a real training step follows the
    # save; the loop is blocked for the save() call plus any wait at the next optimizer.step()
    blocked, fwdbwd = [], []
    for i in range(reps):
        step += 1
        t0 = time.perf_counter()
        mgr.save_training(step, model, opt, {"step": step}, overlap=True)
        call = time.perf_counter() - t0
        t1 = time.perf_counter()
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        fwdbwd.append(time.perf_counter() - t1)
        w0 = mgr.snapshot_wait_s
        opt.step()
        blocked.append(call + mgr.snapshot_wait_s - w0)
        opt.zero_grad(set_to_none=True)
        mgr.wait()
    res["skiptrain_stall_s"] = statistics.median(blocked)
    res["fwd_bwd_s"] = statistics.median(fwdbwd)
    disk.append(disk_write(work, nbytes))
    res["disk_write_GBps"] = statistics.median(disk)
    res["disk_write_samples"] = disk
    res["_keep"] = (mgr, model, opt)
    return res


def loop_slowdown(big: dict, work: Path) -> float:
    """Small-model step time while a save of ``big`` is written in the background / idle."""
    cfg, model, opt, x, _ = make_state("small")

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / n

    steps(3)
    idle = steps(10)
    mgr, bmodel, bopt = big["_keep"]
    mgr.save_training(10_000, bmodel, bopt, {})
    n = 0
    busy_times = []
    while mgr.writer.busy:
        busy_times.append(steps(1))
        n += 1
    mgr.wait()
    return statistics.median(busy_times) / idle if busy_times else float("nan")


def swarm_figures(args, work: Path) -> dict:
    """The swarm's stall and crash-loop figures (``bench/_swarm_checkpoint.py``)."""
    from _swarm_checkpoint import crash_loop, swarm_stall

    from skiptrain.data.corpus import read_documents
    from skiptrain.data.dataset import write_dataset

    texts = Path(__file__).resolve().parents[1] / "tests" / "data"
    data = work / "data"
    write_dataset(data, read_documents([str(texts / "hamlet_excerpt.txt"), str(texts / "macbeth_excerpt.txt")]),
                  read_documents([str(texts / "milton_excerpt.txt")]), tokenizer="byte", val_fraction=0.1,
                  source="test excerpts")
    iters = args.swarm_iterations or (10 if args.quick else 30)
    print("[bench] swarm stall ...", flush=True)
    out = swarm_stall(data, work, iters, 1 if args.quick else 3)
    trials = args.trials if args.trials is not None else (3 if args.quick else 30)
    print("[bench] crash loop ...", flush=True)
    out.update(crash_loop(data, work, trials))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small model only")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--reps", type=int, default=3, help="saves per method (median reported)")
    ap.add_argument("--dir", default=None, help="parent of the temporary directory (default: system temp)")
    ap.add_argument("--trials", type=int, default=None, help="whole-job kills in the crash loop (default 30; quick 3)")
    ap.add_argument("--part", choices=("all", "process", "swarm"), default="all",
                    help="only the single-process figures, or only the swarm's (default: both)")
    ap.add_argument("--swarm-iterations", type=int, default=None, help="iterations per stall run (default 30; quick 10)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="skiptrain-ckpt-bench-", dir=args.dir))
    results, out = [], {}
    try:
        if args.part != "swarm":
            kinds = ["small"] if args.quick else ["small", "1GiB"]
            for kind in kinds:
                print(f"[bench] {kind} ...", flush=True)
                results.append(bench_model(kind, args.reps, work))
            slow = loop_slowdown(results[-1], work)
        if args.part != "process":
            swarm = swarm_figures(args, work)
    finally:
        for r in results:
            r.pop("_keep", None)
        shutil.rmtree(work, ignore_errors=True)
    if args.part != "swarm":
        out.update(report_process(results, slow, args.reps))
    if args.part != "process":
        out.update(report_swarm(swarm))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def report_process(results: list[dict], slow: float, reps: int) -> dict:
    """Print the single-process table; the JSON of it."""
    print(f"\ncheckpoint bench: {torch.get_num_threads()} torch threads, python {sys.version.split()[0]}, "
          f"torch {torch.__version__}; stall = seconds the training loop is blocked per save (median of {reps})")
    hdr = (f"{'model':>6} {'params':>8} {'state':>8} | {'skiptrain':>9} {'blocking':>8} {'(1st)':>6} "
           f"{'torch.save':>10} {'DCP async':>9} | {'save GB/s':>9} {'load GB/s':>9} {'disk GB/s':>9} "
           f"{'save/disk':>9} | {'fwd+bwd':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['model']:>6} {r['params'] / 1e6:7.1f}M {r['state_GiB']:7.3f}G | {r['skiptrain_stall_s']:9.4f} "
              f"{r['skiptrain_blocking_stall_s']:8.4f} {r['skiptrain_first_stall_s']:6.2f} {r['torch_save_s']:10.3f} "
              f"{r['dcp_async_s']:9.3f} | {r['save_GBps']:9.3f} {r['load_GBps']:9.3f} {r['disk_write_GBps']:9.3f} "
              f"{r['save_GBps'] / r['disk_write_GBps']:9.0%} | {r['fwd_bwd_s']:7.3f}")
    print("skiptrain = overlapped snapshot (trainer default: copy runs during the next forward/backward, the loop "
          "waits only at optimizer.step); blocking = save() returns after the copy; (1st) = first save, buffers "
          "allocated and paged in")
    m = results[-1]
    print(f"\n{m['model']}: blocking-snapshot stall = {m['skiptrain_blocking_stall_s'] / m['torch_save_s']:.1%} of "
          f"torch.save, {m['skiptrain_blocking_stall_s'] / m['dcp_async_s']:.2f}x DCP async_save")
    print(f"{m['model']}: stall = {m['skiptrain_stall_s'] / m['torch_save_s']:.1%} of torch.save "
          f"(target <= 10%), {m['skiptrain_stall_s'] / m['dcp_async_s']:.2f}x DCP async_save "
          f"(target <= 1); save = {m['save_GBps'] / m['disk_write_GBps']:.0%} of disk (target >= 80%); "
          f"small-model step time while the background writer runs: {slow:.2f}x idle")
    return {"stall_s": {"skiptrain": m["skiptrain_stall_s"], "torch_save": m["torch_save_s"],
                        "dcp_async": m["dcp_async_s"], "skiptrain_blocking_snapshot": m["skiptrain_blocking_stall_s"],
                        "skiptrain_first_save": m["skiptrain_first_stall_s"]},
            "save_GBps": m["save_GBps"], "load_GBps": m["load_GBps"], "disk_write_GBps": m["disk_write_GBps"],
            "model": m["model"], "loop_slowdown_during_write": slow, "per_model": results, "reps": reps}


def report_swarm(swarm: dict) -> dict:
    """Print the swarm's figures; the JSON of them."""
    print(f"\nswarm ({swarm['nodes']} nodes, checkpoint every iteration vs none, {swarm['reps']} run(s) each of "
          f"{swarm['iterations']} iterations): period {swarm['period_save_s']:.4f} s vs {swarm['period_none_s']:.4f} s "
          f"= {swarm['swarm_stall_fraction']:+.1%} per iteration (target <= +5%)")
    print(f"crash loop: {swarm['crash_resumes_ok']}/{swarm['crash_trials']} whole-job SIGKILLs resumed from a LATEST "
          f"that loads and verifies ({swarm['killed_during_save']} killed while a save was being written); after the "
          f"last resume the job ran to iteration {swarm['final_iteration']}: {swarm['samples_lost']} samples lost, "
          f"{swarm['samples_repeated']} repeated")
    return {"swarm_stall_fraction": swarm["swarm_stall_fraction"], "crash_trials": swarm["crash_trials"],
            "crash_resumes_ok": swarm["crash_resumes_ok"], "swarm": swarm}


if __name__ == "__main__":
    sys.exit(main())
