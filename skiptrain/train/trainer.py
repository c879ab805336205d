"""The single-process trainer: the whole model in one process, routes emulated.

One iteration = ``n_micro`` micro-batches of ``micro_batch`` samples.  With skip ratio k > 0,
each micro-batch runs stage 0 plus its own route through the body stages (balanced over the
iteration, as the planner draws them), run by the runtime's executor exactly as a node of a
swarm runs its share of a schedule, here one node hosting every stage with an in-process
transport between them.  The update is the runtime's one optimizer step
(:func:`skiptrain.runtime.step.optimizer_step`) with this process hosting every stage, each in a
data-parallel group of one: each stage's gradient is the mean over the micro-batches that
visited it, one global clip, one optimizer step.  So this trainer computes what a swarm of node
processes computes on the same routes.

Layout changes.  The trainer trains under a :class:`~skiptrain.layout.Layout` (the partition
of layers into stages, the frozen depth); :meth:`Trainer.reconfigure` applies a new one between
iterations (the elastic bench's one-process harness does so at every freeze or undo; a run
that freezes trains through the runtime, as a swarm of one node when it has one process).

Device and precision: the model lives on ``train.device`` (``auto``: CUDA when present) and
each iteration's batch is moved there once; with ``train.precision=bf16`` the executor's
iteration (every forward and backward) and validation run under bf16 autocast, while weights,
gradients and AdamW state stay fp32 (:mod:`skiptrain.model.device`); every hop between stages
carries what a swarm's slow link carries (``runtime.act_codec``, else bf16 under bf16 compute:
:func:`skiptrain.schedule.actcodec.slow_link_codec`), so the one process is the swarm's reference.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.hf_import import load_hf_weights, model_config_for_data
from ..checkpoint.training import TrainerCheckpoints, restore_trainer
from ..config import Config, TrainConfig
from ..data.dataset import TokenDataset
from ..data.loader import SampleSource, ShardedLoader
from ..dp import make_strategy
from ..errors import UserError
from ..layout import Layout, is_frozen
from ..model.device import autocast, build_on_device, resolve_device, to_device
from ..model.memory import estimate_node_memory
from ..optim import build_optimizer, lr_at
from ..runtime.executor import Executor
from ..runtime.step import HostedStage, optimizer_step
from ..runtime.transport import LocalTransport
from ..schedule.actcodec import plain_codec, slow_link_codec
from ..schedule.baselines import one_node
from ..schedule.routes import balanced_routes, full_route, stage_visit_counts
from ..runtime.evaluate import evaluate
from .evaluate import unigram_loss
from .metrics import MetricsLog, plot_loss
from .rundir import prepare_run_dir, save_weights, write_summary


@dataclass
class StepResult:
    loss: float
    lr: float
    grad_norm: float
    routes: list[list[int]]


def draw_routes(cfg: Config, rng: random.Random) -> list[list[int]]:
    """The body-stage routes of one iteration's micro-batches."""
    s, t = cfg.model.n_stages, cfg.train
    if t.skip_ratio <= 0:
        return [full_route(s) for _ in range(t.n_micro)]
    return balanced_routes(s, t.skip_ratio, t.n_micro, rng, t.max_swaps)


class Trainer:
    """Trains ``cfg`` on the prepared data set ``cfg.data.path``, writing into ``out``."""

    #: whether the trainer honours train.device and train.precision (a subclass whose state
    #: lives on the CPU sets False: it then runs on the CPU in fp32 and refuses anything else)
    device_generic = True

    def __init__(self, cfg: Config, out: str | Path | None = None, dataset: TokenDataset | None = None,
                 claim: Callable[[], None] | None = None):
        """``claim``: called once every input has been checked and the model built, just before
        anything is written into ``out`` (the CLI's ``--overwrite`` deletes the old run there, so
        a refused input loses nothing)."""
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.ds = dataset or TokenDataset.open(cfg.data.path)
        if t.init_from:     # a pre-trained model decides the shapes
            cfg.model = model_config_for_data(t.init_from, cfg.model, self.ds.vocab_size)
        elif cfg.model.vocab_size != self.ds.vocab_size:
            cfg.model.vocab_size = self.ds.vocab_size  # the data set decides the vocabulary
        self.cfg = cfg.check()
        torch.manual_seed(t.seed)
        self.device = self.pick_device(t)
        # every stage here; AdamW's state counted (an upper bound for DeMo's stateless step).
        # Refused before anything is allocated when even one micro-batch in flight cannot fit;
        # the executor may hold up to every micro-batch of an iteration (the printed estimate).
        stages = list(range(cfg.model.n_stages))
        self.model, _ = build_on_device(cfg.model, stages, t.seed, self.device, t.micro_batch, 1, t.precision)
        self.memory = estimate_node_memory(cfg.model, stages, t.micro_batch, t.n_micro, t.precision)
        if t.init_from:
            load_hf_weights(self.model, t.init_from)
        self.model.train()
        hop = slow_link_codec(cfg.runtime.act_codec, plain_codec(t.precision))   # every hop as a swarm's slow link
        self.executor = Executor(0, LocalTransport(0, hop), self.model)
        self.reconfigure(Layout(self.model.partition, [[0] for _ in stages]))
        self.opt = build_optimizer(self.model.named_parameters(), t, self.syncs[0].update_rule)
        self.train_src = SampleSource(self.ds.tokens("train"), cfg.model.seq_len, seed=t.seed,
                                       name=self.ds.split_name("train"))
        self.val_src = SampleSource(self.ds.tokens("val"), cfg.model.seq_len, shuffle=False,
                                     name=self.ds.split_name("val"))
        self.loader = ShardedLoader(self.train_src, t.micro_batch * t.n_micro)
        self.route_rng = random.Random(t.seed)
        self.step = 0
        if claim is not None and out is not None:
            claim()
        self.out = prepare_run_dir(out, cfg, self.ds.path) if out is not None else None
        # periodic asynchronous checkpoints (skiptrain.checkpoint.training); resume() loads one
        c = cfg.checkpoint
        self.ckpt = (TrainerCheckpoints(self) if (self.out is not None or c.dir) and (c.every or c.final)
                     else None)

    def pick_device(self, t: TrainConfig) -> torch.device:
        """``train.device`` resolved; a loop that is not device-generic refuses cuda and bf16."""
        if self.device_generic:
            return resolve_device(t.device)
        if t.device == "cuda" or t.precision != "fp32":
            raise UserError(f"{type(self).__name__} runs on the CPU in fp32 only; "
                            "set train.device=cpu (or auto) and train.precision=fp32")
        return torch.device("cpu")

    def reconfigure(self, layout: Layout) -> None:
        """Train under ``layout`` from the next iteration on (its placement aside: this one node
        hosts every stage).  The model runs the partition's stages; parameters frozen at
        ``layout.frozen`` (:func:`skiptrain.layout.is_frozen`) stop requiring gradients, so they
        get no backward and no update (their optimizer state is kept); each stage with trainable
        parameters gets its data-parallel sync."""
        self.layout, m = layout, self.model
        m.partition = layout.partition
        for n, p in m.named_parameters():
            p.requires_grad_(not is_frozen(n, layout.frozen))
        named = {s: [(n, p) for n, p in m.stage_named_parameters(s) if p.requires_grad]
                 for s in range(layout.n_stages)}
        self.syncs = {s: make_strategy(self.cfg.dp, ps, None, self.cfg.train) for s, ps in named.items() if ps}

    @property
    def frozen(self) -> int:
        return self.layout.frozen

    def resume(self, path: str | Path | None = None) -> Path:
        """Continue from the latest checkpoint (or ``path``): weights, AdamW, step, data cursor, RNGs."""
        return restore_trainer(self, path)

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return t.micro_batch * t.n_micro * self.cfg.model.seq_len

    def routes(self) -> list[list[int]]:
        """The body-stage routes of this iteration's micro-batches."""
        return draw_routes(self.cfg, self.route_rng)

    def stage0_inputs(self, x: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """What stage 0 starts each micro-batch from: the tokens ``x`` of the global samples
        ``indices`` (elastic mode: the frozen prefix's output)."""
        return x

    def observe(self, updates: dict[str, torch.Tensor]) -> None:
        """Sees the synced, not yet clipped update of every trainable parameter by name."""

    def train_step(self) -> StepResult:
        """One iteration: the executor runs every micro-batch along its route (one node hosting
        every stage, an in-process transport between them), then the one optimizer step."""
        t, S = self.cfg.train, self.layout.n_stages
        indices = self.loader.indices()
        x, y = self.loader.next_batch()
        x, y = self.stage0_inputs(to_device(x, self.device), indices), to_device(y, self.device)
        routes = self.routes()
        self.opt.zero_grad(set_to_none=True)
        mb = t.micro_batch

        def batch(i: int):
            return x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]

        with autocast(self.device, t.precision):
            res = self.executor.run_iteration(self.step, one_node(routes, S), time.time(), batch)
        lr = lr_at(self.step, t)
        visits = stage_visit_counts(routes, S)
        out = optimizer_step([HostedStage(s, sync, visits[s]) for s, sync in self.syncs.items()],
                             self.opt, lr, t.grad_clip, inspect=self.observe)
        self.step += 1
        return StepResult(res.loss_sum / max(res.n_loss, 1), lr, out.grad_norm, routes)

    def validate(self, route=None) -> float:
        t = self.cfg.train
        with autocast(self.device, t.precision):
            return evaluate(self.model, self.val_src, t.eval_batches, t.micro_batch, route=route)

    def fit(self, steps: int | None = None) -> dict:
        """Train until ``steps`` (default cfg.train.steps) iterations are done; returns the summary."""
        from tqdm import tqdm

        t = self.cfg.train
        steps = t.steps if steps is None else steps
        assert self.out is not None, "fit() needs an output directory"
        log = MetricsLog(self.out / "metrics.jsonl", append=self.step > 0)
        baseline = unigram_loss(self.ds.tokens("train"), self.ds.tokens("val"), self.ds.vocab_size)
        bar = tqdm(total=steps, initial=self.step, disable=not t.progress, unit="it", dynamic_ncols=True)
        if t.progress:
            tqdm.write(f"memory on {self.device}, at most: {self.memory.describe()}")
        t0, tokens_at_t0 = time.perf_counter(), self.step * self.tokens_per_step
        val_loss = float("nan")
        completed = False
        try:
            while self.step < steps:
                r = self.train_step()
                tokens = self.step * self.tokens_per_step
                elapsed = time.perf_counter() - t0
                tok_s = (tokens - tokens_at_t0) / max(elapsed, 1e-9)
                if not math.isfinite(r.loss):
                    raise FloatingPointError(f"loss became {r.loss} at step {self.step}; lower train.lr")
                if self.step % t.log_every == 0 or self.step == steps:
                    log.write(step=self.step, loss=round(r.loss, 5), lr=r.lr, grad_norm=round(r.grad_norm, 4),
                              tokens=tokens, tok_s=round(tok_s, 1), elapsed_s=round(elapsed, 3))
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == steps:
                    val_loss = self.validate()
                    log.write(step=self.step, tokens=tokens, val_loss=round(val_loss, 5))
                bar.set_postfix(loss=f"{r.loss:.3f}", val=f"{val_loss:.3f}", tok_s=f"{tok_s:,.0f}")
                bar.update(1)
                if self.ckpt is not None:
                    self.ckpt.after_step(self)
            completed = True
        finally:
            bar.close()
            log.close()
            if self.ckpt is not None:
                self.ckpt.finish(self, completed=completed)
            save_weights(self.model, self.out)
            plot_loss(self.out / "metrics.jsonl", self.out / "loss.png",
                      title=f"skiptrain: {self.model.num_parameters() / 1e6:.1f}M params, k={t.skip_ratio}",
                      baseline=baseline)
        summary = {"step": self.step, "tokens": self.step * self.tokens_per_step, "val_loss": val_loss,
                   "unigram_val_loss": baseline, "params": self.model.num_parameters(),
                   "partition": self.model.partition.to_list(), "data": str(self.ds.path),
                   "memory_estimate_bytes": self.memory.total_bytes,
                   "seconds": round(time.perf_counter() - t0, 2)}
        write_summary(self.out, summary)
        return summary
