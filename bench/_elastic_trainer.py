"""The PipeTransformer bench's one-process harness: freezing as a layout change of the plain
trainer, planned for ``n_nodes`` emulated nodes (bench/elastic.py).

Users freeze through the runtime (``skiptrain train`` with ``elastic.enabled`` is a swarm of one
node serving every stage; :mod:`skiptrain.runtime.freezing`).  This harness keeps, for the
bench, what one process can emulate of a larger swarm: the layouts AutoPipe and AutoDP pick for
``n_nodes`` nodes (which the bench times in the event simulator), the transfer bill of each
change, and an activation cache whose ``auto`` mode measures whether it pays.

:class:`ElasticTrainer` is :class:`skiptrain.train.trainer.Trainer` -- the same loop, executor and
optimizer step -- plus, every ``elastic.check_every`` steps, the freeze rule
(:class:`skiptrain.elastic.freezer.Freezer`; its guard gets the validation loss of every window
and, as its clock, the learning rate summed over the steps so far in units of the peak rate).
When the frozen count changes, a *transition* plans the new layout and the trainer applies it
(``Trainer.reconfigure``) before the next step:

1. the activation cache (:mod:`skiptrain.elastic.cache`) is measured and switched on when
   cheaper, and its entries are validated (an undo drops entries deeper than the new prefix);
   when the whole training split fits it is prefilled to the new depth (``elastic.prefill``), so
   no step runs the prefix again and AutoPipe plans without it in device memory;
2. AutoPipe + AutoDP (:func:`skiptrain.elastic.freezer.plan_layout`) repartition the active
   layers, shrink the stage count and assign the ``n_nodes`` emulated nodes to the new stages;
   :func:`skiptrain.layout.transfer.transfer_plan` bills the moves by name, and the largest
   receiver's message is packed and unpacked for real (the wire time is the runtime's);
3. the new layout is applied: frozen layers (and the embedding, with the first of them) get no
   backward and no update (their optimizer state is kept for an undo), and each iteration starts
   stage 0 from the frozen prefix's output, computed without autograd (from the cache when on).

The global batch, the data cursor and the learning-rate schedule (a function of the step) are
untouched by transitions, so no sample is repeated or skipped.  Checkpoints carry, under
``state["freeze"]``, the rule state, the layout history, the transitions and the cache position;
``resume`` restores them, applies the layout in force and revalidates the cache (refilling a
prefilled one that lost entries: ``resume_prefill``), so a resumed run continues exactly as the
uninterrupted one.  Decisions go to ``RUN_DIR/elastic.jsonl``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.checkpoint.training import TrainerCheckpoints, truncate_metrics, trainer_state
from skiptrain.checkpoint.wire import pack_state, state_sizes, unpack_tensors
from skiptrain.config import Config
from skiptrain.data.dataset import TokenDataset
from skiptrain.elastic.cache import ActivationCache, PrefixRunner, at_depth, expected_hit, measure, worth_it
from skiptrain.elastic.freezer import (Freezer, append_log, layer_sq_norms, layout_routes, plan_layout, prefix_input,
                               stage0_forward)
from skiptrain.elastic.repartition import ElasticLayout
from skiptrain.layout import is_frozen
from skiptrain.layout.transfer import transfer_plan
from skiptrain.runtime.evaluate import evaluate
from skiptrain.train.trainer import StepResult, Trainer


class ElasticCheckpoints(TrainerCheckpoints):
    """The trainer's checkpoints with the elastic state in ``state["freeze"]``."""

    def save(self, trainer) -> float:
        state, lay = trainer_state(trainer), trainer.layout
        state["placement"] = {"stages": {str(s): [0] for s in range(lay.n_stages)}, "partition": lay.counts}
        state["freeze"] = trainer.elastic_state()
        stall = self.manager.save_training(trainer.step, trainer.model, trainer.opt, state,
                                           layout={"n_stages": lay.n_stages, "replicas": lay.replicas,
                                                   "partition": lay.counts, "frozen": lay.frozen},
                                           overlap=self.cfg.overlap)
        self.stalls.append(stall)
        return stall


class ElasticTrainer(Trainer):
    """The trainer in elastic mode; see the module docstring."""

    device_generic = False      # the activation cache and its fingerprints live on the CPU, in fp32

    def __init__(self, cfg: Config, out: str | Path | None = None, dataset: TokenDataset | None = None,
                 claim: Callable[[], None] | None = None, n_nodes: int = 0):
        """``n_nodes``: the emulated nodes the layouts are planned for (0: one per stage)."""
        super().__init__(cfg, out, dataset, claim)
        m = self.cfg.model
        self.freezer = Freezer(self.cfg)
        self.start_stages = m.n_stages
        self.n_nodes = n_nodes or m.n_stages
        R = self.n_nodes // m.n_stages
        if R < 1:
            raise ValueError(f"{self.n_nodes} emulated nodes cannot serve {m.n_stages} stages")
        self.layouts = [ElasticLayout.of(0, self.model.partition.to_list(), R, self.cfg.train.n_micro,
                                         [[s * R + r for r in range(R)] for s in range(m.n_stages)], False, 0)]
        self.reconfigure(self.layouts[0])
        self.executor.embed = self._stage0
        self.transitions: list[dict[str, Any]] = []
        self.guard_s = 0.0
        self.guard_cpu_s = 0.0
        self.cache: ActivationCache | None = None
        self._cache_meas: dict[str, float] | None = None
        self._guard_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # the guard's windows
        self._guard_rows: tuple[Any, list[torch.Tensor]] | None = None   # and their prefix outputs
        self.runner = PrefixRunner(self.model)
        self.runner.enabled = False
        self.resume_prefill: dict[str, Any] | None = None   # a prefill redone when resuming
        if self.ckpt is not None:
            self.ckpt.manager.close()
            self.ckpt = ElasticCheckpoints(self)

    @property
    def rule(self):
        """The freeze rule (the freezer's)."""
        return self.freezer.rule

    def _open_cache(self) -> ActivationCache:
        if self.cache is None:
            e = self.cfg.elastic
            if e.cache_dir:
                d = Path(e.cache_dir)
            elif self.out is not None:
                d = Path(self.out) / "elastic_cache"
            else:
                d = Path(tempfile.mkdtemp(prefix="skiptrain-cache-"))
            self.cache = ActivationCache(d, self.train_src.n, self.cfg.model.seq_len, self.cfg.model.d_model,
                                         int(e.cache_mb * 2**20))
            self.runner.cache = self.cache
        return self.cache

    # ---- the trainer's step, with a frozen prefix -----------------------------------------

    def routes(self) -> list[list[int]]:
        """Routes over the layout's body stages; skipping (``train.skip_ratio``) needs two or more
        of them once the pipeline has shrunk."""
        S, t = self.layout.n_stages, self.cfg.train
        if S == self.start_stages:
            return super().routes()
        return layout_routes(S, t.skip_ratio, t.n_micro, self.route_rng, t.max_swaps)

    def stage0_inputs(self, x: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """The frozen prefix's output (no autograd; from the cache when on), or the tokens."""
        return prefix_input(self.runner, self.train_src, x, indices, self.frozen)

    def _stage0(self, h: torch.Tensor) -> torch.Tensor:
        """Stage 0's forward: its layers after the frozen prefix, on the prefix's output."""
        return stage0_forward(self.model, self.frozen, h)

    def observe(self, updates: dict[str, torch.Tensor]) -> None:
        """Per active layer, the norm of its stage-averaged gradient, to the freeze rule."""
        self.freezer.observe(layer_sq_norms(updates), self.frozen)

    def train_step(self) -> StepResult:
        """The trainer's iteration; at the end of a window, the freeze rule and any transition."""
        r = super().train_step()
        d = self.freezer.decide(self.step, self._guard_val)
        if d is not None:
            rec = d.to_dict()
            if d.frozen_after != d.frozen_before:
                rec["transition"] = self._transition()
            if self.out is not None:
                append_log(Path(self.out) / "elastic.jsonl", rec)
        return r

    # ---- windows and transitions ----------------------------------------------------------

    def _guard_val(self) -> float:
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.frozen > 0:
            v = self._guard_from_prefix()
        else:
            v = evaluate(self.model, self.val_src, self.cfg.elastic.guard_batches, self.cfg.train.micro_batch)
        self.guard_s += time.perf_counter() - t0
        self.guard_cpu_s += time.thread_time() - c0
        return v

    @torch.no_grad()
    def _guard_from_prefix(self) -> float:
        """:func:`evaluate`'s loss over the guard windows, with their frozen-prefix outputs kept.

        The guard reads the same validation windows at every check and frozen weights do not
        change, so the prefix is computed once per (depth, prefix fingerprint) -- after a
        transition, an undo or changed weights it is recomputed -- and each check runs only the
        active layers and the head.  Same operations on the same micro-batches as
        :func:`evaluate`, so the same value bit for bit (tested)."""
        m, F, mb = self.model, self.frozen, self.cfg.train.micro_batch
        if self._guard_batches is None:  # the guard windows never change
            n = min(self.cfg.elastic.guard_batches * mb, self.val_src.n)
            self._guard_batches = [self.val_src.batch(list(range(a, min(n, a + mb)))) for a in range(0, n, mb)]
        batches = self._guard_batches
        key = (F, self.runner.fps.get(F))
        was_training = m.training
        m.eval()
        if self._guard_rows is None or self._guard_rows[0] != key:
            self._guard_rows = (key, [self.runner.compute(x) for x, _ in batches])
        total, n = 0.0, 0
        for h, (_, y) in zip(self._guard_rows[1], batches):
            h = m.run_layers(h, range(F, self.cfg.model.n_layers))
            total += m.loss(m.logits(h), y).item() * len(y)
            n += len(y)
        m.train(was_training)
        return total / n

    def _prefill(self) -> tuple[dict[str, Any], float, float]:
        """Prefill the cache to the current depth, a global batch of windows at a time: (its
        record with wall ``seconds`` and thread ``cpu_s`` measured around it, wall, CPU)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        t = self.cfg.train
        rec = self.runner.prefill(lambda ws: self.train_src.window_batch(ws)[0], t.micro_batch * t.n_micro)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        rec.update(seconds=round(wall, 6), cpu_s=round(cpu, 6))
        return rec, wall, cpu

    def _cache_decision(self, F: int, visits_left: float, rec: dict[str, Any]) -> bool:
        """Whether the frozen prefix at depth ``F`` is served from the activation cache."""
        e, t = self.cfg.elastic, self.cfg.train
        if F == 0 or e.cache == "off":
            return False
        cache = self._open_cache()
        if e.cache == "on":
            return True
        if self._cache_meas is None:  # measured once, at the first freeze; other depths scale
            probe_tokens, _ = self.train_src.batch(list(range(min(t.micro_batch, self.train_src.n))))
            self._cache_meas = measure(self.model, F, probe_tokens, cache.dir)
        meas = at_depth(self._cache_meas, F)
        rec["cache_measure"] = {**{k: round(v, 7) for k, v in meas.items()}, "visits_left": round(visits_left, 3)}
        return worth_it(meas, visits_left) and cache.capacity > 0

    def _transfer_bill(self, old: ElasticLayout, new: ElasticLayout, sizes: dict[str, int]) -> dict[str, Any]:
        """The layout change's moves by name; the largest receiver's message packed and unpacked."""
        plan = transfer_plan(sizes, old, new)
        pack_s = 0.0
        if plan:
            biggest: dict[int, list[str]] = {}
            for tr in plan:
                biggest.setdefault(tr.dst, []).extend(tr.names)
            names = max(biggest.values(), key=lambda ns: sum(sizes[n] for n in ns))
            t1 = time.perf_counter()
            unpack_tensors(pack_state(self.model, self.opt, names, {"step": self.step, "data": self.loader.state_dict()}))
            pack_s = time.perf_counter() - t1
        return {"transfer_bytes": sum(tr.nbytes for tr in plan), "transfer_messages": len(plan),
                "pack_unpack_s": round(pack_s, 6)}

    def _transition(self) -> dict[str, Any]:
        """The layout for the rule's new frozen count (cache, AutoPipe, AutoDP), then applied."""
        t0, c0 = time.perf_counter(), time.thread_time()
        e, t = self.cfg.elastic, self.cfg.train
        F, old = self.rule.frozen, self.layout
        rec: dict[str, Any] = {"step": self.step, "frozen_before": old.frozen, "frozen_after": F}
        visits_left = max(0, t.steps - self.step) * t.micro_batch * t.n_micro / self.train_src.n
        cached = self.runner.enabled = self._cache_decision(F, visits_left, rec)
        rec["cache_dropped"] = self.runner.set_frozen(F)
        prefill_cpu = prefill_wall = 0.0
        # an undo within the last prefill_after_undo windows: freezing is unsettled, and the next
        # undo would discard a whole prefill (every entry deeper than the new prefix is dropped)
        settled = not any(d["action"] == "undo" and d["step"] > self.step - e.prefill_after_undo * e.check_every
                          for d in self.rule.history)
        rec["prefill_settled"] = settled
        if (cached and e.prefill and settled and visits_left >= 1
                and self.cache.capacity >= self.cache.n_windows):
            rec["prefill"], prefill_wall, prefill_cpu = self._prefill()
        # AutoPipe costs the prefix by the share of it the cache will really save
        hit = expected_hit(self.cache, F, visits_left) if cached else 0.0
        rec["expected_hit"] = round(hit, 4)
        sizes = state_sizes(self.model, self.opt, [n for n, _ in self.model.named_parameters() if is_frozen(n, F)])
        new, evidence = plan_layout(self.cfg.model, F, old.counts, old.placement, list(range(self.n_nodes)), sizes,
                                    self.start_stages, t.micro_batch * t.n_micro, old.n_micro, self.step, hit=hit,
                                    prefix_cached=cached and self.runner.complete(), cached=cached)
        rec.update(stages_before=old.n_stages, stages_after=new.n_stages, replicas_after=new.replicas,
                   counts=new.counts, placement=new.placement, cached=cached, autopipe=evidence,
                   **self._transfer_bill(old, new, sizes))
        self.layouts.append(new)
        self.reconfigure(new)
        # the transition's own cost; a prefill is the first epoch's prefix work, reported apart
        rec["seconds"] = round(time.perf_counter() - t0 - prefill_wall, 6)   # wall
        rec["cpu_s"] = round(time.thread_time() - c0 - prefill_cpu, 6)   # this thread's CPU (not inflated by load)
        self.transitions.append(rec)
        return rec

    # ---- checkpoints ----------------------------------------------------------------------

    def elastic_state(self) -> dict[str, Any]:
        c = self.cache
        return {"frozen_layers": self.frozen, "rule": self.rule.state_dict(),
                "layouts": [l.to_dict() for l in self.layouts], "transitions": self.transitions,
                "guard_s": self.guard_s, "guard_cpu_s": self.guard_cpu_s,
                "cache": {"dir": None if c is None else str(c.dir), "enabled": self.runner.enabled,
                          "depth": self.frozen, **({} if c is None else c.stats())}}

    def load_elastic_state(self, st: dict[str, Any]) -> None:
        self.rule.load_state_dict(st["rule"])
        self.layouts = [ElasticLayout.from_dict(d) for d in st["layouts"]]
        self.transitions = list(st.get("transitions", []))
        self.guard_s = float(st.get("guard_s", 0.0))
        self.guard_cpu_s = float(st.get("guard_cpu_s", 0.0))
        self.reconfigure(self.layouts[-1])
        cst = st.get("cache") or {}
        if cst.get("dir") and self.cfg.elastic.cache != "off":
            if not self.cfg.elastic.cache_dir and self.out is None:
                self.cfg.elastic.cache_dir = cst["dir"]
            self._open_cache()
        self.runner.enabled = bool(cst.get("enabled")) and self.cache is not None
        self.runner.set_frozen(self.frozen)
        if self.cache is not None:  # the counters continue where the checkpoint left them
            for k in ("hits", "misses", "extended", "writes", "prefilled"):
                setattr(self.cache, k, int(cst.get(k, 0)))
        self.resume_prefill = None
        planned = self.transitions[-1].get("autopipe", {}).get("prefix_cached") if self.transitions else False
        if self.runner.enabled and planned and not self.runner.complete():
            # the layout in force was planned without the prefix on the device: the cache lost
            # entries since the checkpoint (a later, deeper freeze rewrote them, or the cache
            # directory is new), so bring it back to the checkpoint's depth before any step
            self.resume_prefill = self._prefill()[0]

    def resume(self, path: str | Path | None = None) -> Path:
        p = super().resume(path)
        st = CheckpointReader(p).state.get("freeze", {})
        if "rule" in st:
            self.load_elastic_state(st)
        if self.out is not None:
            truncate_metrics(Path(self.out) / "elastic.jsonl", self.step)
        return p

    def fit(self, steps: int | None = None) -> dict:
        summary = super().fit(steps)
        summary["elastic"] = {"frozen_layers": self.frozen, "layouts": [l.to_dict() for l in self.layouts],
                              "transition_s": round(sum(t["seconds"] for t in self.transitions), 4),
                              "prefill_s": round(sum(t.get("prefill", {}).get("seconds", 0.0)
                                                     for t in self.transitions), 4),
                              "guard_s": round(self.guard_s, 4),
                              "cache": None if self.cache is None else self.cache.stats()}
        if self.out is not None:
            Path(self.out, "elastic.json").write_text(json.dumps(summary["elastic"], indent=1))
        return summary
