"""AutoCache: the frozen prefix's output per sample, in a memory-mapped file.

Key.  A sample is a window of the training split (:class:`skiptrain.data.loader.SampleSource`);
the window id is the cache key, so the same text hits the same entry in every epoch whatever
its global index.

Files (in ``directory``):

* ``data.f32``: ``capacity x seq_len x d_model`` float32 rows (the residual stream after the
  frozen prefix, bit-exact);
* ``tags.i64``: ``capacity x 3`` int64 ``(window, depth, fingerprint)`` per slot, window -1 =
  empty.  A slot's tag is cleared before its row is rewritten and set after, so a killed
  process never leaves a tag that points at a torn row.
* ``meta.json``: the shape, to reopen the files.

Validity.  An entry of depth ``k`` is the output of the embedding and layers ``0..k-1`` with
the weights they had when it was written; ``fingerprint`` is a CRC of those weights.  An entry
is used only when ``k <= frozen`` and its fingerprint equals the current weights' CRC at depth
``k`` (:meth:`ActivationCache.validate` drops the rest: after an undo of a freeze, after a
resume, after anything that changed those layers).  An entry with ``k < frozen`` is *extended*
incrementally: layers ``k..frozen-1`` run on the cached row and the slot is rewritten at the
new depth, which costs less than recomputing from the tokens.

Bound.  ``capacity = min(windows, max_bytes // row_bytes)`` rows; windows beyond it are
recomputed every time (no eviction: every window is equally likely to come back next epoch).

Sharing.  ``shared=True``: several processes open one directory (the node processes of one
machine in a swarm).  The cache must then hold every window, and window ``w`` lives in slot
``w``, so no process allocates a slot another uses; a lookup reads the tags from the file (it
sees rows other processes wrote), and :meth:`refresh` re-reads the whole index.  Writers must
write disjoint windows (the swarm's prefill deals them; its training steps only read); every
process may :meth:`validate` at the same time (each only invalidates rows).

Prefill.  When the whole training split fits, a freeze brings every window to the new depth at
once (:meth:`PrefixRunner.prefill`, forward only, data parallel over the nodes) instead of one
miss at a time over the next epoch: every later lookup hits, and the prefix need not stay
resident with the layers that still train (:meth:`PrefixRunner.complete`).

Whether to use the cache at all is a measurement (:func:`measure` and :func:`worth_it`):
per sample, recomputing the prefix vs reading a row, counting the write on the first visit
and the number of visits left in the run; measured once and rescaled by depth (:func:`at_depth`).
"""

from __future__ import annotations

import fcntl
import json
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch


def prefix_fingerprints(model, depth: int) -> dict[int, int]:
    """CRC32 of the embedding + layers ``0..k-1`` weights, for every ``k`` in ``1..depth``."""
    out: dict[int, int] = {}
    crc = zlib.crc32(model.tok_emb.weight.detach().contiguous().numpy().tobytes())
    for k in range(1, depth + 1):
        for _, p in sorted(model.layers[str(k - 1)].named_parameters()):
            crc = zlib.crc32(p.detach().contiguous().numpy().tobytes(), crc)
        out[k] = crc
    return out


@contextmanager
def _dir_lock(directory: Path):
    """An exclusive lock on ``directory`` (processes opening one shared cache create it once)."""
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ActivationCache:
    """Per-window rows of the frozen prefix's output; see the module docstring."""

    def __init__(self, directory: str | Path, n_windows: int, seq_len: int, d_model: int, max_bytes: int,
                 shared: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shape = (seq_len, d_model)
        self.row_bytes = seq_len * d_model * 4
        self.n_windows = n_windows
        self.capacity = int(min(n_windows, max_bytes // self.row_bytes))
        if shared and self.capacity < n_windows:
            raise ValueError(f"a shared cache needs room for all {n_windows} windows; it holds {self.capacity}")
        self.shared = shared
        self.hits = self.misses = self.extended = self.writes = self.prefilled = 0
        meta = {"capacity": self.capacity, "seq_len": seq_len, "d_model": d_model, "n_windows": n_windows}
        meta_path = self.dir / "meta.json"
        cap = max(self.capacity, 1)
        with _dir_lock(self.dir):
            reuse = meta_path.is_file() and json.loads(meta_path.read_text()) == meta
            mode = "r+" if reuse else "w+"
            self.data = np.memmap(self.dir / "data.f32", dtype=np.float32, mode=mode, shape=(cap, seq_len, d_model))
            self.tags = np.memmap(self.dir / "tags.i64", dtype=np.int64, mode=mode, shape=(cap, 3))
            if not reuse:
                self.tags[:] = -1
                self.tags.flush()
                meta_path.write_text(json.dumps(meta))
        self.slot_of: dict[int, int] = {}
        self.free: list[int] = []
        self._reindex()

    def _reindex(self) -> None:
        self.slot_of = {int(w): i for i, w in enumerate(self.tags[: self.capacity, 0]) if w >= 0}
        used = set(self.slot_of.values())
        self.free = [i for i in range(self.capacity - 1, -1, -1) if i not in used]

    def refresh(self) -> None:
        """Re-read the index from the tags file (a shared cache: rows other processes wrote)."""
        self._reindex()

    @property
    def entries(self) -> int:
        return len(self.slot_of)

    def nbytes(self) -> int:
        return self.entries * self.row_bytes

    def validate(self, fingerprints: dict[int, int], frozen: int) -> int:
        """Drop entries deeper than ``frozen`` or whose weights changed; returns how many.  In a
        shared cache the processes sharing it validate at the same time: a row another one has
        invalidated since this one read the index (its window tag no longer the window) is
        dropped from the index too."""
        if self.shared:
            self._reindex()
        if not self.slot_of:
            return 0
        windows = np.fromiter(self.slot_of.keys(), dtype=np.int64, count=len(self.slot_of))
        slots = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(self.slot_of))
        tags = np.asarray(self.tags[slots])                     # (window, depth, fingerprint) rows
        depth = tags[:, 1]
        want = np.full(max(frozen, 0) + 1, -1, dtype=np.int64)  # the fingerprint each depth must carry
        for d, fp in fingerprints.items():
            if 1 <= d <= frozen:
                want[d] = fp
        ok = (tags[:, 0] == windows) & (depth >= 1) & (depth <= frozen)
        ok[ok] = want[depth[ok]] == tags[ok, 2]
        bad = slots[~ok]
        if len(bad):
            self.tags[bad] = -1
            for w in windows[~ok]:
                del self.slot_of[int(w)]
            self.free.extend(bad.tolist())
        return len(bad)

    def lookup(self, windows: Sequence[int]) -> list[tuple[int, int] | None]:
        """Per window: ``(slot, depth)`` of its entry, or None."""
        out: list[tuple[int, int] | None] = []
        if self.shared:                 # slot = window; the file's tags, whoever wrote them
            for w in windows:
                t = self.tags[int(w)]
                if int(t[0]) == int(w):
                    self.slot_of[int(w)] = int(w)
                    out.append((int(w), int(t[1])))
                else:
                    self.slot_of.pop(int(w), None)
                    out.append(None)
            return out
        for w in windows:
            slot = self.slot_of.get(int(w))
            out.append(None if slot is None else (slot, int(self.tags[slot, 1])))
        return out

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.data[np.asarray(slots)]))

    def write(self, window: int, depth: int, fingerprint: int, row: torch.Tensor) -> bool:
        """Store ``row`` for ``window`` (reusing its slot); False when the cache is full."""
        slot = int(window) if self.shared else self.slot_of.get(int(window))
        if slot is None:
            if not self.free:
                return False
            slot = self.free.pop()
        self.tags[slot] = -1
        self.data[slot] = row.detach().numpy()
        self.tags[slot] = (int(window), int(depth), int(fingerprint))
        self.slot_of[int(window)] = slot
        self.writes += 1
        return True

    def flush(self) -> None:
        self.data.flush()
        self.tags.flush()

    def stats(self) -> dict[str, Any]:
        return {"entries": self.entries, "capacity": self.capacity, "bytes": self.nbytes(), "hits": self.hits,
                "misses": self.misses, "extended": self.extended, "writes": self.writes, "prefilled": self.prefilled}


class PrefixRunner:
    """Computes the frozen prefix's output for a batch, through the cache when it is on."""

    def __init__(self, model, cache: ActivationCache | None = None, store: bool = True):
        self.model = model
        self.cache = cache
        self.enabled = cache is not None
        self.store = store              # training steps write what they compute (a prefill always does)
        self.frozen = 0
        self.fps: dict[int, int] = {}

    def set_frozen(self, frozen: int) -> int:
        """New frozen depth: refresh fingerprints and drop invalid entries (returns how many)."""
        self.frozen = frozen
        self.fps = prefix_fingerprints(self.model, frozen) if frozen > 0 else {}
        return self.cache.validate(self.fps, frozen) if self.cache is not None else 0

    @torch.no_grad()
    def compute(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.run_layers(self.model.tok_emb(tokens), range(self.frozen))

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        if not self.enabled or self.cache is None:
            return self.compute(tokens)
        out = torch.empty(tokens.shape[0], tokens.shape[1], self.model.cfg.d_model)
        self._fill(tokens, windows, out)
        return out

    def _fill(self, tokens: torch.Tensor | None, windows: Sequence[int], out: torch.Tensor | None,
              tokens_of: Callable[[list[int]], torch.Tensor] | None = None) -> dict[str, int]:
        """Bring ``windows`` to the current depth: read full-depth entries, extend shallower ones,
        compute and write the missing (their tokens: ``tokens`` rows, or ``tokens_of(windows)``).
        Writes the outputs into ``out`` when given; returns the counts (hits, extended, misses,
        and the layer forwards run, per sample)."""
        F, c = self.frozen, self.cache
        assert c is not None
        found = c.lookup(windows)
        n = {"hits": 0, "extended": 0, "misses": 0, "layer_rows": 0}
        full = [(i, f[0]) for i, f in enumerate(found) if f is not None and f[1] == F]
        if full and out is not None:
            out[[i for i, _ in full]] = c.read([s for _, s in full])
        n["hits"] = len(full)
        by_depth: dict[int, list[tuple[int, int]]] = {}
        for i, f in enumerate(found):
            if f is not None and f[1] < F:
                by_depth.setdefault(f[1], []).append((i, f[0]))
        for depth, items in sorted(by_depth.items()):  # incremental extension
            h = self.model.run_layers(c.read([s for _, s in items]), range(depth, F))
            if out is not None:
                out[[i for i, _ in items]] = h
            for (i, _), row in zip(items, h):
                if out is None or self.store:
                    c.write(windows[i], F, self.fps[F], row)
            n["extended"] += len(items)
            n["layer_rows"] += len(items) * (F - depth)
        miss = [i for i, f in enumerate(found) if f is None]
        if miss:
            x = tokens[miss] if tokens is not None else tokens_of([int(windows[i]) for i in miss])
            h = self.compute(x)
            if out is not None:
                out[miss] = h
            for i, row in zip(miss, h):
                if out is None or self.store:
                    c.write(windows[i], F, self.fps[F], row)
            n["misses"] = len(miss)
            n["layer_rows"] += len(miss) * F
        if out is not None:  # a training step's lookups (prefill counts separately)
            c.hits += n["hits"]
            c.extended += n["extended"]
            c.misses += n["misses"]
        return n

    @torch.no_grad()
    def prefill(self, tokens_of: Callable[[list[int]], torch.Tensor], batch: int,
                windows: Sequence[int] | None = None) -> dict[str, Any]:
        """Bring every window of the training split (or just ``windows``: an originator's share in
        a swarm) to the current depth, ``batch`` windows at a time.

        Run at a freeze when the whole split fits the cache: the prefix then never runs inside a
        training step again (every lookup hits), and a prefix whose every output is cached need
        not be resident with the layers that still train (AutoPipe's ``prefix_cached``).  The
        work is what each window's next visit would do as a miss (the caller prefills only with
        at least one visit per window left); done at once it is forward-only and data parallel
        over all nodes.  Windows already at the depth are skipped, shallower ones extended.
        Returns ``rows`` (windows computed or extended), ``layer_rows`` (layer forwards run, per
        sample) and ``seconds``."""
        c = self.cache
        if c is None or self.frozen <= 0:
            return {"rows": 0, "layer_rows": 0, "seconds": 0.0}
        if c.capacity < c.n_windows:
            raise ValueError(f"prefill needs room for all {c.n_windows} windows; the cache holds {c.capacity} "
                             "(raise elastic.cache_mb)")
        todo = list(range(c.n_windows)) if windows is None else list(dict.fromkeys(int(w) for w in windows))
        t0 = time.perf_counter()
        rows = layer_rows = 0
        for a in range(0, len(todo), batch):
            n = self._fill(None, todo[a:a + batch], None, tokens_of)
            rows += n["extended"] + n["misses"]
            layer_rows += n["layer_rows"]
        c.prefilled += rows
        return {"rows": rows, "layer_rows": layer_rows, "seconds": round(time.perf_counter() - t0, 6)}

    def complete(self) -> bool:
        """Every training window's entry is at the current depth (so every lookup hits)."""
        c = self.cache
        if c is None or self.frozen <= 0 or c.entries < c.n_windows:
            return False
        slots = np.fromiter(c.slot_of.values(), dtype=np.int64, count=len(c.slot_of))
        return bool((c.tags[slots, 1] == self.frozen).all())


def measure(model, frozen: int, tokens: torch.Tensor, directory: str | Path, repeats: int = 3) -> dict[str, float]:
    """Seconds per sample: recompute the prefix vs write vs read a cached row (medians)."""
    runner = PrefixRunner(model)
    runner.frozen = frozen
    n = tokens.shape[0]
    probe = ActivationCache(Path(directory) / "probe", n, tokens.shape[1], model.cfg.d_model, n * tokens.shape[1]
                            * model.cfg.d_model * 4)

    def med(fn) -> float:
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2] / n

    h = runner.compute(tokens)
    t_comp = med(lambda: runner.compute(tokens))
    t_write = med(lambda: [probe.write(i, frozen, 0, h[i]) for i in range(n)])
    t_read = med(lambda: probe.read(list(range(n))))
    return {"recompute_s": t_comp, "write_s": t_write, "read_s": t_read, "depth": frozen}


def at_depth(meas: dict[str, float], depth: int) -> dict[str, float]:
    """:func:`measure`'s result re-expressed for another prefix depth, without running anything.

    Recomputing the prefix costs its layers (the embedding lookup is negligible next to one
    layer), so ``recompute_s`` scales with the depth; writing and reading a cached row do not
    depend on it.  A transition then costs no measurement after the first (on this machine a
    measurement is ~30 ms, half of a transition's time, against steps of ~35 ms on 16 nodes).
    """
    d0 = int(meas["depth"])
    if d0 <= 0 or depth <= 0:
        raise ValueError(f"depths must be positive (measured at {d0}, asked for {depth})")
    return {**meas, "recompute_s": meas["recompute_s"] * depth / d0, "depth": depth}


def expected_hit(cache: "ActivationCache", depth: int, visits_left: float) -> float:
    """Fraction of the prefix work the cache will save over the rest of the run, at ``depth``.

    Windows beyond the capacity always recompute; a cacheable window without an entry misses
    on its first visit (which happens with probability ``min(visits_left, 1)``), then hits on
    each of its remaining visits; an entry at a shallower depth ``d`` is extended, saving
    ``d / depth`` of the work.  With less than one visit left the hit fraction is the coverage
    (a lookup hits when its window is cached).  Call after
    :meth:`PrefixRunner.set_frozen` (entries deeper than ``depth`` or stale are gone then).
    """
    if depth <= 0 or cache.n_windows <= 0:
        return 0.0
    slots = np.fromiter(cache.slot_of.values(), dtype=np.int64, count=len(cache.slot_of))
    cover = float(np.minimum(cache.tags[slots, 1], depth).sum()) / depth / cache.n_windows
    cacheable = cache.capacity / cache.n_windows
    v = max(float(visits_left), 0.0)
    if v == 0:
        return min(cover, 1.0)
    return min(max((cacheable * v - (cacheable - cover) * min(v, 1.0)) / v, 0.0), 1.0)


def worth_it(m: dict[str, float], visits_per_window: float) -> bool:
    """Cache when ``recompute + write + (v - 1) * read < v * recompute`` (per window, over ``v``
    visits left): the first visit recomputes and writes, the others read."""
    v = max(visits_per_window, 0.0)
    if v <= 1.0:
        return False
    return m["write_s"] + m["recompute_s"] + (v - 1) * m["read_s"] < v * m["recompute_s"]
