"""The activation cache side of elastic freezing in the swarm: which originators share a cache,
whether a layout starts with its frozen prefix cached and prefilled (what the prefill buys against
what it costs, in the simulator's seconds), and the prefill itself before the first iteration of
such a layout.  A mixin of :class:`~skiptrain.runtime.freezing.SwarmFreezing`, whose state it
reads (``cfg``, ``st``, ``node``, ``rule``, ``frozen``, ``transitions``, ``cache``, ``runner``)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..elastic.cache import ActivationCache
from ..elastic.repartition import ElasticLayout
from ..schedule.schedule import Schedule
from ..schedule.simulator import simulate
from .prefill import prefill_plan, run_prefill
from .transition import layout_cost, layout_schedule


class PrefixCaching:
    """Decisions and work of the frozen prefix's activation cache (see the module's docstring)."""

    def cache_on(self, F: int) -> bool:
        """Whether the stage-0 nodes serve the frozen prefix from the activation cache: with
        ``elastic.cache=on`` (``auto`` recomputes: its measurement would differ between nodes)."""
        return F > 0 and self.cfg.elastic.cache == "on"

    def will_prefill(self, F: int, step: int) -> bool:
        """Every node's same answer: does the layout for ``F`` frozen layers start with each
        originator's windows prefilled (cache on, ``elastic.prefill``, room for the whole split,
        and no guard undo in the last ``prefill_after_undo`` windows: an undo discards it)?"""
        e, m = self.cfg.elastic, self.cfg.model
        if not (self.cache_on(F) and e.prefill):
            return False
        if int(e.cache_mb * 2**20) // (m.seq_len * m.d_model * 4) < self.node.src.n:
            return False
        return not any(d["action"] == "undo" and d["step"] > step - e.prefill_after_undo * e.check_every
                       for d in self.rule.history)

    def cache_in_due(self, step: int) -> bool:
        """Every node's same answer, at the end of a window that keeps the frozen depth: has the
        depth, recomputed so far, now held for ``elastic.prefill_hold`` windows, with a prefill
        allowed (:meth:`will_prefill`)?  Then the next iteration starts with the layout planned
        again with the prefix cached (the gate may still decline).  A window whose validation
        loss is above the guard's projection puts it off to the next window that is not (with
        ``elastic.guard_confirm > 1`` an undo may follow and discard the prefill).  Asked once
        per depth."""
        e = self.cfg.elastic
        if not (e.prefill_hold and self.frozen and not self.prefix_cached):
            return False
        since = max((t["step"] for t in self.transitions if t["frozen_before"] != t["frozen_after"]), default=None)
        return (since is not None and step == self.rule.first_undoubted(since + e.prefill_hold * e.check_every)
                and self.will_prefill(self.frozen, step))

    def location(self, rank: int) -> str | None:
        """The topology location whose originators share one activation cache with ``rank``
        (``elastic.cache_share=location``, room for the whole split, ``rank`` in the phase's
        topology), else None: the node keeps a cache of its own."""
        e, m, topo = self.cfg.elastic, self.cfg.model, self.st.topo
        if e.cache_share != "location" or topo is None or rank >= topo.n:
            return None
        if int(e.cache_mb * 2**20) // (m.seq_len * m.d_model * 4) < self.node.src.n:
            return None
        return topo.nodes[rank].location

    def open_cache(self) -> ActivationCache:
        """This originator's cache (``elastic.cache_dir`` or ``RUN_DIR/elastic_cache``; one
        directory per node, or per location when shared), keyed by training window."""
        if self.cache is None:
            e, m, node = self.cfg.elastic, self.cfg.model, self.node
            root = Path(e.cache_dir) if e.cache_dir else Path(node.run_dir) / "elastic_cache"
            loc = self.location(node.rank)
            name = f"loc-{''.join(c if c.isalnum() else '_' for c in loc)}" if loc is not None else f"node{node.rank}"
            self.cache = ActivationCache(root / name, node.src.n, m.seq_len, m.d_model, int(e.cache_mb * 2**20),
                                         shared=loc is not None)
        return self.cache

    def share(self, rank: int | None = None, sched: Schedule | None = None) -> list[int]:
        """The training windows node ``rank`` (default this node) starts micro-batches of, from
        this iteration to the end of the phase, under ``sched`` (default the schedule in force),
        in first-visit order, each once."""
        st, node, mbsz = self.st, self.node, self.cfg.train.micro_batch
        rank = node.rank if rank is None else rank
        sched = st.sched if sched is None else sched
        mine = sorted(st.order[mb.id] for mb in sched.micro_batches if mb.originator == rank)
        out: dict[int, None] = {}
        for it in range(st.it, st.ph.iterations):
            c = st.cursor + (it - st.it) * st.gb
            for i in mine:
                out.update((node.src.window(g), None) for g in range(c + i * mbsz, c + (i + 1) * mbsz))
        return list(out)

    def prefill_gain(self, F: int, on: tuple[ElasticLayout, dict], off: tuple[ElasticLayout, dict],
                     keep: dict[int, int]) -> float:
        """What a prefill buys, as a ratio of modelled seconds: the iteration time the layout
        ``on`` (planned with the prefix cached) saves over ``off`` (prefix recomputed), times the
        iterations left in the phase, over the prefill's time.  The prefill's time is the
        slowest cache's: its windows until the end of the phase (:meth:`share`, each once per
        cache: one per originator, or one per location when shared) run through all ``F``
        frozen layers, forward only, spread over the originators sharing it, at the slowest of
        their speeds (pessimistic: the prefill extends shallower rows and sends rows between caches).
        Iteration times are the simulator's when the phase has a topology (holding every node of
        both layouts) and a cost model, else AutoPipe's estimates; both sides are then in
        sample-layer units."""
        st = self.st
        s_on, s_off = self.schedule_of(on[0], keep), self.schedule_of(off[0], keep)
        groups: dict[tuple[str, Any], set[int]] = {}
        for mb in s_on.micro_batches:
            loc = self.location(mb.originator)
            groups.setdefault(("loc", loc) if loc is not None else ("node", mb.originator), set()).add(mb.originator)
        modelled = (self.base_cost is not None and st.topo is not None
                    and all(n < st.topo.n for s in (s_on, s_off) for p in s.placement for n in p))
        unit = self.base_cost.s_per_sample_per_layer if modelled else 1.0
        prefill = max((len({w for r in members for w in self.share(r, s_on)}) * F * unit
                       / (len(members) * min(st.topo.speed(r) if modelled else 1.0 for r in members))
                       for members in groups.values()), default=0.0)
        saved = (self.iteration_s(off, s_off, F, False, modelled)
                 - self.iteration_s(on, s_on, F, True, modelled))
        if not math.isfinite(saved):
            return 0.0
        return saved * (st.ph.iterations - st.it) / prefill if prefill > 0 else math.inf

    def schedule_of(self, layout: ElasticLayout, keep: dict[int, int]) -> Schedule:
        """The full-route schedule of one iteration over ``layout`` (the originators keeping ``keep``)."""
        return layout_schedule(layout.placement, sorted(self.st.order), 0.0, 0, self.memory,
                               self.cfg.train.seed + self.st.it, keep)

    def iteration_s(self, planned: tuple[ElasticLayout, dict], sched: Schedule, F: int, cached: bool,
                     modelled: bool) -> float:
        """A planned layout's iteration time: ``sched`` simulated with the phase's topology and
        cost model when ``modelled``, else AutoPipe's estimate (infinite when it has none)."""
        layout, evidence = planned
        if not modelled:
            return min((t["estimate"] for t in evidence["tried"] if t["counts"] == layout.counts
                        and t["estimate"] is not None), default=math.inf)
        cost = layout_cost(self.base_cost, self.cfg.model, layout.counts, F, hit=1.0 if cached else 0.0)
        return simulate(sched, self.st.topo, cost, contention=True, dp_sync=False, record=False).iteration_s

    def cache_of(self, rank: int) -> str:
        """The key of the cache originator ``rank`` reads: its location's, or its own."""
        loc = self.location(rank)
        return f"loc:{loc}" if loc is not None else f"node:{rank}"

    def prepare_prefix(self) -> None:
        """Every node, before the first iteration of a layout with a frozen prefix (the weights are
        loaded by then): the originators fingerprint the prefix (dropping stale cache entries) and,
        when the layout was planned with the prefix cached, every node waits for that, then takes
        part in the prefill (:mod:`skiptrain.runtime.prefill`: each window computed once, on a
        cache that holds it deepest, data parallel over the originators, forward only, padded to
        the cost model like any compute task; its row sent to the other caches that need it).
        The counts and the slowest node's time are all-reduced and logged."""
        st, node = self.st, self.node
        t0 = time.time()
        done = torch.zeros(5, dtype=torch.float64)   # rows, layer rows, received rows, dropped, (max) seconds
        if self.runner is not None:
            done[3] = self.runner.set_frozen(self.frozen)
        if self.prefix_cached:
            node.control.sync(dist.barrier)                   # no cache is read while one still drops stale rows
            n = run_prefill(self, prefill_plan(self), t0)
            done[0], done[1], done[2] = n["rows"], n["layer_rows"], n["received"]
            if self.cache is not None:
                self.cache.flush()
        done[4] = time.time() - t0
        if self.prefix_cached:
            mx = done[4:].clone()
            node.control.sync(dist.all_reduce, done)
            node.control.sync(dist.all_reduce, mx, dist.ReduceOp.MAX)
            if self.cache is not None and self.cache.shared:
                self.cache.refresh()
            rec = {"step": st.it, "action": "prefill", "frozen": self.frozen, "rows": int(done[0]),
                   "layer_rows": int(done[1]), "received_rows": int(done[2]), "dropped": int(done[3]),
                   "seconds": round(float(mx[0]), 6)}
            st.record.setdefault("prefills", []).append(rec)
            self.log(rec)
        self.prefix_due = False
