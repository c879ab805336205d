"""The node process: ``python -m skiptrain.runtime.node --job JOB.json``.

Joins the run through the standard torch.distributed environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), so the same entry point serves the local launcher
(:mod:`skiptrain.runtime.launcher`, which hosts the rendezvous store itself and sets
``SKIPTRAIN_STORE_HOSTED=1``) and ``torchrun`` on one or several hosts (rank 0, or torchrun's
agent when ``TORCHELASTIC_USE_AGENT_STORE=True``, hosts the store).  Rank ``r`` is node ``r`` of
every schedule.

Per phase of the job (:mod:`skiptrain.runtime.job`): build only this node's stage
(:class:`~skiptrain.model.transformer.StagedLM` with ``stages=[s]``), a gloo group per stage for
the data-parallel sync (strategy from ``cfg.dp`` via :func:`skiptrain.dp.strategy.make_strategy`),
then per iteration: a common start time, the executor (:mod:`.executor`), one sync + optimizer
step weighted by the micro-batches this node processed, and the timeline.  Rank 0 appends the
iteration's loss and measured time to ``RUN_DIR/metrics.jsonl``.

Outputs under ``RUN_DIR``: ``phases/<name>/node<r>.json`` (timeline events per iteration,
stats), ``parts/stage<s>.safetensors`` (``save_weights``), ``phases/<name>/dump/node<r>.pt``
(``dump``: parameters and pre-sync summed gradients), ``errors/node<r>.json`` on failure.

Failure semantics: any error, or a peer failure seen by the heartbeat, writes
``errors/node<r>.json`` naming the node at fault and exits the process at once (``os._exit``)
with :data:`~.failure.EXIT_FAILED` / :data:`~.failure.EXIT_PEER_FAILED`; gloo waits are bounded
by ``job.timeout_s``.  The launcher (or torchrun) then stops the other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .failure import (EXIT_FAILED, EXIT_PEER_FAILED, Heartbeat, NodeFailure, abort_process,
                      set_parent_death_signal, write_error)
from .job import Job, Phase


class _Node:
    def __init__(self, job: Job, rank: int, world: int, addr: str, port: int):
        from ..config import config_from_dict
        from ..data.dataset import TokenDataset
        from ..data.loader import SampleSource
        from .transport import P2PTransport

        self.job, self.rank, self.world = job, rank, world
        self.run_dir = Path(job.run_dir)
        self.err_path = self.run_dir / "errors" / f"node{rank}.json"
        self.stage_of: dict[int, int] = {}
        hosted = os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1" or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.store = dist.TCPStore(addr, port, world, is_master=(rank == 0 and not hosted),
                                   timeout=timedelta(seconds=max(job.timeout_s, 60.0)),
                                   wait_for_workers=False)
        self.hb = Heartbeat(self.store, rank, world, job.heartbeat_s, job.timeout_s, self._peer_failed,
                            describe=self.describe).start()
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", self.store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=job.timeout_s))
        # a separate gloo context for pipeline messages, so collectives never share tags with them
        self.p2p_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=job.timeout_s))
        self.hb.arm()
        self.cfg = config_from_dict(job.config)
        ds = TokenDataset.open(job.data_path)
        self.cfg.model.vocab_size = ds.vocab_size
        self.src = SampleSource(ds.tokens("train"), self.cfg.model.seq_len, seed=self.cfg.train.seed)
        self.tr = P2PTransport(rank, self.p2p_group, stage_of=lambda n: self.stage_of.get(n, -1))

    def describe(self, n: int) -> str:
        s = self.stage_of.get(n)
        return f"node {n}" + (f" (stage {s})" if s is not None else "")

    def _peer_failed(self, node: int, reason: str) -> None:
        write_error(self.err_path, self.rank, NodeFailure(f"node {self.rank}: {reason}", node), node)
        abort_process(EXIT_PEER_FAILED)

    def _fault(self, phase: str, iteration: int, where: str) -> None:
        f = self.job.fault
        if not f or f.get("node") != self.rank or f.get("phase", phase) != phase \
                or f.get("iteration", 0) != iteration or f.get("where", "start") != where:
            return
        self.store.set(f"fault/{self.rank}", repr(time.time()))
        kind = f["kind"]
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "raise":
            raise RuntimeError(f"injected fault on node {self.rank}")

    # ---- one phase -------------------------------------------------------------------------

    def run_phase(self, ph: Phase) -> None:
        from ..dp.strategy import make_strategy
        from ..model.transformer import StagedLM
        from ..net.topology import Topology
        from ..schedule.cost import CostModel
        from ..schedule.schedule import Schedule
        from ..schedule.timeline import Event
        from ..train.optim import lr_at
        from .executor import Executor
        from .wan import ComputePadding, LinkFifo

        cfg, rank = self.cfg, self.rank
        sched = Schedule.from_dict(ph.schedule)
        self.stage_of = sched.stage_of()
        stage = self.stage_of.get(rank)
        timeout = timedelta(seconds=self.job.timeout_s)
        groups = [dist.new_group(sorted(p), timeout=timeout) for p in sched.placement]
        cost = CostModel.from_dict(ph.cost) if ph.cost else None
        topo = Topology.from_dict(ph.topology) if ph.topology else None
        self.tr.link = (LinkFifo.from_topology(topo, rank, ph.bytes_scale, cost.hop_overhead_s if cost else 0.0)
                        if ph.wan and topo is not None else None)
        speed = topo.speed(rank) if topo is not None and rank < topo.n else 1.0
        padding = ComputePadding(ph.emulate_compute and cost is not None)
        model = strat = None
        if stage is not None:
            torch.manual_seed(cfg.train.seed)
            model = StagedLM(cfg.model, stages=[stage], seed=cfg.train.seed)
            model.train()
            strat = make_strategy(cfg.dp, model.named_parameters(), groups[stage], cfg.train)
            _warm_up(model, stage, cfg)
        ex = Executor(rank, self.tr, model, stage, cost, speed, padding, self.job.timeout_s, self.describe)
        mbsz = cfg.train.micro_batch
        order = {mb.id: i for i, mb in enumerate(sorted(sched.micro_batches, key=lambda m: m.id))}
        gb = len(order) * mbsz
        out_dir = self.run_dir / "phases" / ph.name
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {"rank": rank, "stage": stage, "iterations": []}
        metrics = open(self.run_dir / "metrics.jsonl", "a") if rank == 0 else None
        cursor = 0
        sync_replicas = sched.placement[stage] if stage is not None else []
        try:
            for it in range(ph.iterations):
                self._fault(ph.name, it, "start")
                # common start: everyone present, then rank 0's clock + a margin for the broadcast
                dist.barrier()
                tt = torch.tensor([time.time() + 0.2], dtype=torch.float64)
                dist.broadcast(tt, 0)
                t0 = float(tt[0])
                time.sleep(max(0.0, t0 - time.time()))
                self.tr.begin_iteration(it, t0)

                def batch_fn(mb_id: int, _c=cursor):
                    i = order[mb_id]
                    return self.src.batch(range(_c + i * mbsz, _c + (i + 1) * mbsz))

                res = ex.run_iteration(it, sched, t0, batch_fn)
                self._fault(ph.name, it, "after_pipeline")
                events = list(res.events)
                lr = lr_at(it, cfg.train)
                if model is not None:
                    if ph.dump and it == 0:
                        torch.save({"n": res.n_processed, "stage": stage,
                                    "grads": {n: (p.grad.clone() if p.grad is not None else None)
                                              for n, p in model.named_parameters()}},
                                   out_dir / f"grads_node{rank}.pt")
                    ts = time.time()
                    st = strat.step(lr, res.n_processed)
                    if ph.emulate_sync and cost is not None and topo is not None:
                        time.sleep(cost.dp_sync_s(topo, sync_replicas, stage))
                    te = time.time()
                    if len(sync_replicas) > 1:
                        events.append(Event(rank, "sync", None, stage, ts - t0, te - t0, st.payload_bytes))
                    for p in model.parameters():
                        p.grad = None
                self.tr.wait_sent(self.job.timeout_s)
                events += self.tr.take_events()
                t_end = max((e.end for e in events), default=0.0)
                stats = torch.tensor([res.loss_sum, res.n_loss, t_end, padding.overruns, padding.overrun_s,
                                      res.max_in_flight], dtype=torch.float64)
                allst = [torch.empty_like(stats) for _ in range(self.world)]
                dist.all_gather(allst, stats)
                record["iterations"].append({"events": [e.to_dict() for e in events],
                                             "n_processed": res.n_processed, "t_end": t_end})
                if metrics is not None:
                    a = torch.stack(allst)
                    n = float(a[:, 1].sum())
                    row = {"phase": ph.name, "step": it + 1, "loss": round(float(a[:, 0].sum()) / max(n, 1), 5),
                           "iteration_s": round(float(a[:, 2].max()), 4), "lr": lr,
                           "tokens": (it + 1) * gb * cfg.model.seq_len,
                           "overruns": int(a[:, 3].sum()), "overrun_s": round(float(a[:, 4].sum()), 4),
                           "max_in_flight": int(a[:, 5].max())}
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                cursor += gb
        finally:
            if metrics is not None:
                metrics.close()
            (out_dir / f"node{rank}.json").write_text(json.dumps(record))
        if model is not None:
            if ph.dump:
                torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                           out_dir / f"params_node{rank}.pt")
            if ph.save_weights and rank == sched.placement[stage][0]:
                from safetensors.torch import save_file

                parts = self.run_dir / "parts"
                parts.mkdir(parents=True, exist_ok=True)
                save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
                          str(parts / f"stage{stage}.safetensors"))
        dist.barrier()
        for g in groups:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)

    def finish(self) -> None:
        self.tr.close()
        dist.barrier()
        self.hb.finish()


def _warm_up(model, stage: int, cfg) -> None:
    """One throw-away forward and backward of this node's pieces (first calls of torch kernels
    and the autograd engine are slow), so the timed iterations measure the steady state."""
    shape = (cfg.train.micro_batch, cfg.model.seq_len)
    if stage == 0:
        x = torch.zeros(shape, dtype=torch.long)
        h = model.embed(x)
        leaf = h.detach().requires_grad_(True)
        model.loss(model.logits(leaf), x).backward()
        h.backward(leaf.grad)
    else:
        h = torch.zeros(*shape, cfg.model.d_model, requires_grad=True)
        out = model.run_stage(stage, h)
        out.backward(torch.ones_like(out))   # a non-scalar backward, as in the pipeline (first one: slow)
    for p in model.parameters():
        p.grad = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.node", description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="job JSON written by `skiptrain launch` / the launcher")
    args = ap.parse_args(argv)
    if os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1":
        set_parent_death_signal()
    torch.set_num_threads(1)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        print(f"skiptrain node: set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE ({e})", file=sys.stderr)
        return 2
    job = Job.load(args.job)
    err_path = Path(job.run_dir) / "errors" / f"node{rank}.json"
    node = None
    try:
        node = _Node(job, rank, world, addr, port)
        for ph in job.phases:
            node.run_phase(ph)
        node.finish()
    except NodeFailure as e:
        write_error(err_path, rank, e, e.node)
        abort_process(EXIT_FAILED)
    except BaseException as e:  # noqa: BLE001 - report anything, then leave at once
        # a gloo error in a collective means some peer failed (which one: the launcher knows)
        write_error(err_path, rank, e, None if isinstance(e, dist.DistError) else rank)
        abort_process(EXIT_FAILED)
    abort_process(0)  # skip interpreter teardown (gloo/threads); everything is written
    return 0


if __name__ == "__main__":
    sys.exit(main())
