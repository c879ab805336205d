"""Who computes which activation-cache rows at a freeze, and which rows travel between caches.

At a freeze with the cache on, every cache (one per originator, or one per location shared by
its originators) must hold the frozen prefix's output, at the new depth, for every window its
originators will start.  A window may be needed by several caches and already held by some, at
some depth (0: not at all).  :func:`plan_prefill` computes each window once, on a cache that
holds it deepest (the fewest layers to run; among those, one that needs it), on that cache's
least-loaded worker, the windows with the most layers to run first; every other cache that
needs the window receives the row, unless running its own missing layers costs less than the
row's wire time.  Work is balanced within a cache, not moved between caches to balance them.  So a cache
that starts originating at a freeze (a location whose nodes were body stages before) receives
rows that another location only extends by the newly frozen layers, instead of computing every
frozen layer from the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Mapping, Sequence


@dataclass
class PrefillPlan:
    """``work``: worker -> the windows it brings to the new depth in its cache (extending a
    shallower row or computing from the tokens); ``layers``: worker -> the layer forwards that
    takes, per sample; ``sends``: (sending worker, receiving worker) -> the windows whose rows go
    from the sender's cache to the receiver's, once the sender's work is done."""
    work: dict[int, list[int]] = field(default_factory=dict)
    layers: dict[int, int] = field(default_factory=dict)
    sends: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def received(self, worker: int) -> dict[int, list[int]]:
        """Sender -> the windows ``worker`` receives from it."""
        return {s: ws for (s, d), ws in self.sends.items() if d == worker}

    def sent(self, worker: int) -> dict[int, list[int]]:
        """Receiver -> the windows ``worker`` sends it."""
        return {d: ws for (s, d), ws in self.sends.items() if s == worker}


def plan_prefill(needs: Mapping[Hashable, Iterable[int]], depth: Mapping[Hashable, Mapping[int, int]],
                 workers: Mapping[Hashable, Sequence[int]], frozen: int,
                 row_cost: Callable[[Hashable, Hashable], float]) -> PrefillPlan:
    """The plan that leaves every cache ``k`` of ``needs`` holding each of ``needs[k]`` at depth
    ``frozen``.

    ``depth[k][w]``: the depth cache ``k`` holds window ``w`` at (missing: 0); ``workers[k]``:
    the processes that write cache ``k`` (a cache without workers neither computes nor
    receives); ``row_cost(a, b)``: one row's wire time from cache ``a`` to cache ``b``, in
    layer forwards per sample (the unit of the work).  Deterministic: every process computes
    the same plan from the same arguments."""
    caches = [k for k in needs if workers.get(k)]
    want = {k: {int(w) for w in needs[k]} for k in caches}
    d_of = {k: {int(w): int(d) for w, d in depth.get(k, {}).items()} for k in caches}
    lacking: dict[int, list] = {}
    for k in caches:
        for w in sorted(want[k]):
            if d_of[k].get(w, 0) < frozen:
                lacking.setdefault(w, []).append(k)
    load = {r: 0 for k in caches for r in workers[k]}
    got = dict.fromkeys(load, 0)
    plan = PrefillPlan(work={r: [] for r in load}, layers=dict.fromkeys(load, 0))
    best = {w: max(d_of[k].get(w, 0) for k in caches) for w in lacking}
    for w in sorted(lacking, key=lambda w: (best[w], w)):
        deepest = [k for k in caches if d_of[k].get(w, 0) == best[w]]
        deepest = [k for k in deepest if k in lacking[w]] or deepest      # one that needs it, if any
        src_k, src = min(((k, r) for k in deepest for r in workers[k]), key=lambda kr: (load[kr[1]], kr[1]))
        run = frozen - best[w]
        if run > 0:
            plan.work[src].append(w)
            plan.layers[src] += run
            load[src] += run
        for k in lacking[w]:
            if k == src_k:
                continue
            own = frozen - d_of[k].get(w, 0)
            if own <= row_cost(src_k, k):
                r = min(workers[k], key=lambda r: (load[r], r))
                plan.work[r].append(w)
                plan.layers[r] += own
                load[r] += own
            else:
                r = min(workers[k], key=lambda r: (got[r], r))
                got[r] += 1
                plan.sends.setdefault((src, r), []).append(w)
    return plan
