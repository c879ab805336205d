"""Multi-process data-parallel training on one machine: the bench's and the tests' engine.

:func:`run_data_parallel` spawns ``world`` processes (multiprocessing *spawn*), joins them into
a gloo group on 127.0.0.1 (free port, short timeout ``dp.timeout_s``), and trains one full
:class:`~skiptrain.model.transformer.StagedLM` replica per process with the strategy named by
``cfg.dp``.  Each iteration consumes global samples ``[cursor, cursor + global_batch)`` of the
training split (:func:`~skiptrain.data.loader.shard_indices`: replica r takes every world-th
sample), runs them in micro-batches of ``train.micro_batch`` (gradients summed), and calls
``strategy.step(lr, n_micro_batches)``.  The learning rate follows linear warm-up then cosine
decay to ``train.min_lr_frac`` of the peak.

Validation (every ``train.eval_every`` steps and at the end) splits ``train.eval_batches`` fixed
micro-batches of the validation split over the replicas and sums over the group (measurement
traffic: not counted, not link-emulated).

Each rank writes its result (losses, step times, byte summary, parameter hashes) to a JSON file;
the parent returns rank 0's record plus every rank's final hashes.  Failures: if any rank raises,
its message is re-raised in the parent as :class:`HarnessError` (type name kept), the other
ranks are killed by PID after a short grace period, and no process is left behind.
``fault`` injects test faults on one rank: ``{"rank": r, "kind": "nan" | "index" | "header" |
"diverge", "step": s}``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

from ..errors import UserError


class HarnessError(RuntimeError):
    """A rank failed; the message starts with the failing exception's type name."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tamper_fn(kind: str, layout):
    def fn(buf: np.ndarray) -> np.ndarray:
        buf = buf.copy()
        spec = layout.specs[0]
        a, b, c = layout.blocks[spec.name]
        if kind == "nan":
            if layout.value_enc == "fp32":
                buf[b:b + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
            else:  # scale of a sign block, or the first bf16 value
                buf[b:b + 4] = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)
        elif kind == "index":
            buf[a:b] = 0xFF  # every index at its encoding's maximum: out of range or duplicated
        elif kind == "header":
            buf[20:24] ^= 0xFF  # layout hash
        return buf
    return fn


def _worker(rank: int, world: int, port: int, cfg_dicts: list[dict], data_path: str, out_dir: str,
            fault: dict | None) -> None:
    import torch
    import torch.distributed as dist

    from ..config import config_from_dict
    from ..data.dataset import TokenDataset

    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        cfgs = [config_from_dict(c) for c in cfg_dicts]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfgs[0].dp.timeout_s))
        ds = TokenDataset.open(data_path)
        for run_i, cfg in enumerate(cfgs):
            _train_one(rank, world, cfg, ds, out / f"rank{rank}_{run_i}.json", fault)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # report to the parent, then exit non-zero
        (out / f"rank{rank}.err").write_text(json.dumps(
            {"type": type(e).__name__, "msg": str(e), "user": isinstance(e, UserError),
             "tb": traceback.format_exc()}))
        raise SystemExit(1)


def _sum_over_group(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0])


def _train_one(rank, world, cfg, ds, out_file: Path, fault) -> None:
    import torch
    import torch.distributed as dist

    from ..data.loader import SampleSource, shard_indices
    from ..dp import make_strategy
    from ..dp.consistency import param_hashes
    from ..model.transformer import StagedLM
    from ..optim import build_optimizer, lr_at
    from .step import HostedStage, optimizer_step

    tr_src = SampleSource(ds.tokens("train"), cfg.model.seq_len, seed=cfg.train.seed)
    va_src = SampleSource(ds.tokens("val"), cfg.model.seq_len, seed=0, shuffle=False)
    model = StagedLM(cfg.model, seed=cfg.train.seed)
    strat = make_strategy(cfg.dp, model.named_parameters(), None, cfg.train)
    opt = build_optimizer(model.named_parameters(), cfg.train, strat.update_rule)
    if fault and fault.get("rank") == rank and fault["kind"] in ("nan", "index", "header"):
        strat.tamper = _tamper_fn(fault["kind"], strat.layout)
    gb = cfg.train.micro_batch * cfg.train.n_micro
    mb = cfg.train.micro_batch

    def evaluate() -> float:
        model.eval()
        tot = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for i in range(rank, cfg.train.eval_batches, world):
                x, y = va_src.batch(range(i * mb, (i + 1) * mb))
                tot[0] += float(model(x, y)[1])
                tot[1] += 1
        dist.all_reduce(tot)
        model.train()
        return float(tot[0] / tot[1])

    rec = {"rank": rank, "world": world, "losses": [], "step_s": [], "comm_s": [], "payload": [],
           "val": [], "n_params": model.num_parameters()}
    cursor = 0
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        idx = shard_indices(cursor, gb, rank, world)
        cursor += gb
        loss_sum, n = 0.0, 0
        for j in range(0, len(idx), mb):
            x, y = tr_src.batch(idx[j: j + mb])
            loss = model(x, y)[1]
            loss.backward()
            loss_sum += float(loss.detach())
            n += 1
        if fault and fault.get("rank") == rank and fault["kind"] == "diverge" and step == fault["step"]:
            with torch.no_grad():
                dict(model.named_parameters())[fault.get("tensor", "norm.weight")].add_(1e-3)
        st = optimizer_step([HostedStage(0, strat, n, world)], opt, lr_at(step, cfg.train), cfg.train.grad_clip,
                            sum_across=_sum_over_group).stats[0]
        rec["step_s"].append(time.perf_counter() - t0)
        rec["comm_s"].append(st.comm_s)
        rec["payload"].append(st.payload_bytes)
        rec["losses"].append(loss_sum / max(n, 1))
        last = step + 1 == cfg.train.steps
        if st.synced and (last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0)):
            rec["val"].append([step + 1, evaluate()])
    if cfg.dp.check_every and st.synced:
        strat.check_consistency()
    # average the training loss curve over replicas (measurement only)
    lt = torch.tensor(rec["losses"], dtype=torch.float64)
    dist.all_reduce(lt)
    rec["losses_mean"] = (lt / world).tolist()
    rec["summary"] = strat.summary()
    rec["emulated_s"] = strat.tr.emulated_s
    rec["hashes"] = param_hashes(strat.named).tolist()
    out_file.write_text(json.dumps(rec))


def run_data_parallel(cfg, world: int, data_path: str | Path, fault: dict | None = None,
                      timeout_s: float = 1800.0) -> dict:
    """Train ``cfg`` on ``world`` local processes; return rank 0's record (+ ``all_hashes``)."""
    return run_many([cfg], world, data_path, fault, timeout_s)[0]


def run_many(cfgs: list, world: int, data_path: str | Path, fault: dict | None = None,
             timeout_s: float = 3600.0) -> list[dict]:
    """Train each config in turn on the same ``world`` processes (one spawn, one gloo group);
    return one record per config (rank 0's, plus ``all_hashes`` of every rank)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="skiptrain-dp-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, port, [c.to_dict() for c in cfgs], str(data_path), tmp, fault),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.time() + timeout_s
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    # one rank failed: give the others a moment to fail on their own, then stop them
                    grace = time.time() + 10
                    while time.time() < grace and any(p.is_alive() for p in procs):
                        time.sleep(0.05)
                    break
                if time.time() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        errs = sorted(Path(tmp).glob("rank*.err"))
        if errs:
            infos = [json.loads(e.read_text()) for e in errs]
            info = next((i for i in infos if i["user"]), infos[0])
            raise HarnessError(f"{info['type']}: {info['msg']}\n--- rank traceback ---\n{info['tb']}")
        results = []
        for i in range(len(cfgs)):
            recs = []
            for r in range(world):
                f = Path(tmp) / f"rank{r}_{i}.json"
                if not f.is_file():
                    raise HarnessError(f"rank {r} produced no result for run {i} "
                                       f"(exit code {procs[r].exitcode}; timeout?)")
                recs.append(json.loads(f.read_text()))
            out = recs[0]
            out["all_hashes"] = [r["hashes"] for r in recs]
            results.append(out)
    return results
