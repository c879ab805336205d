"""The freeze rule: which bottom-up prefix of layers stops training, and when.

PipeTransformer (DESIGN.md section 2) freezes a prefix of layers bounded by a geometric schedule;
its released code applies only the bound, once per epoch.  This module implements the rule
the paper describes, in windows of ``check_every`` optimizer steps, conservatively:

1. **Gradient signal.**  For every active layer the mean gradient norm over the window,
   ``G_l(w)``, is compared with the previous window's: ``change_l = |G_l(w) - G_l(w-1)| / G_l(w-1)``.
   A layer is *stable* when its change has been at most ``tol`` for ``stable_windows``
   consecutive windows (one calm window in a noisy run is not convergence).  The *converged
   prefix* is the longest run of stable layers starting at the first active one; it proposes
   ``candidate = F + len(prefix)``.
2. **Alpha bound.**  ``bound = F + ceil(alpha * (freezable - F))`` where ``freezable =
   n_layers - min_active`` (the top ``min_active`` layers never freeze).  ``alpha = 1/3`` is
   the paper's safe default; 1/5 is slower, 1/2 faster.
3. The new frozen count is ``min(candidate, bound)`` (never below ``F``), and only from window
   ``start_window`` on (warm-up: early gradient norms say nothing about convergence).
4. **Cumulative guard.**  While nothing is frozen, the validation loss of every window that
   ends after the learning-rate warm-up (``ref_after`` steps) is a *reference point*; the
   reference trajectory is the least-squares fit ``v = a + b ln(clock)`` over the last
   ``guard_ref`` of them (``guard_min_ref`` are needed before anything freezes), i.e. the loss
   the run would have had without freezing.  Warm-up windows are left out because the loss
   falls much faster while the rate ramps up than after: fitted through them, the projection
   was 2-4% too pessimistic by the end of the bench's runs, so a freeze's cost of 1% never
   showed above it.  The trainer's clock is the learning rate summed over the steps so far
   (progress follows the integrated learning rate, so the projection flattens with a decaying
   schedule); without one it is the step.  After the first freeze, every window compares its
   validation loss with that projection: if it is more than ``guard_tol`` (relative) above,
   the most recent freeze is undone (frozen count back to what it was before it) and freezing
   is delayed for ``guard_delay`` windows; the next window that is still above undoes the
   freeze before it, and so on.  Comparing against the projected
   unfrozen trajectory, not against the loss just before each freeze, keeps the *sum* of many
   small freezes' costs under ``guard_tol``.  With ``guard_confirm = k > 1`` an undo needs
   ``k`` consecutive windows above the projection (validation loss on a few windows is noisy:
   one window's blip should not discard a freeze and the cache built for it); a window above it
   that does not yet undo delays further freezing.

Every window produces a :class:`Decision` with its evidence (changes, stability streaks,
bound, candidate, validation loss, projection, action).  The whole rule state is JSON
(:meth:`FreezeRule.state_dict`), so checkpoints resume it exactly.  The rule is pure
bookkeeping: the trainer feeds it gradient norms and validation losses and applies its decisions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence


@dataclass
class Decision:
    """One window's outcome and the evidence for it."""
    step: int
    window: int
    action: str                  # "freeze", "hold", "undo", "delay", "warmup", "max"
    frozen_before: int
    frozen_after: int
    bound: int | None = None
    candidate: int | None = None
    changes: dict[str, float] = field(default_factory=dict)  # layer -> relative grad-norm change
    grad_norms: dict[str, float] = field(default_factory=dict)
    stable: dict[str, int] = field(default_factory=dict)     # layer -> consecutive windows <= tol
    val_loss: float | None = None
    projected: float | None = None  # the reference trajectory's loss at this step (guard)
    above: int = 0                  # consecutive windows above the projection, this one included
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def log_fit(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``v = a + b ln(t)`` through ``(t, v)`` points."""
    xs = [math.log(max(float(s), 1e-12)) for s, _ in points]
    ys = [float(v) for _, v in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


class FreezeRule:
    """Bookkeeping of the freeze rule (see the module docstring)."""

    def __init__(self, n_layers: int, alpha: float = 1 / 3, check_every: int = 25, tol: float = 0.1,
                 min_active: int = 2, start_window: int = 2, guard: bool = True, guard_tol: float = 0.01,
                 guard_delay: int = 2, stable_windows: int = 2, guard_ref: int = 4, guard_confirm: int = 1,
                 guard_min_ref: int = 2, ref_after: int = 0):
        if min_active < 1 or min_active > n_layers:
            raise ValueError(f"min_active={min_active} must lie in 1..{n_layers}")
        if stable_windows < 1:
            raise ValueError(f"stable_windows={stable_windows} must be >= 1")
        if guard_ref < 2:
            raise ValueError(f"guard_ref={guard_ref} must be >= 2 (a trajectory needs two points)")
        if guard_min_ref < 2:
            raise ValueError(f"guard_min_ref={guard_min_ref} must be >= 2 (a trajectory needs two points)")
        if guard_confirm < 1:
            raise ValueError(f"guard_confirm={guard_confirm} must be >= 1 (windows above the projection before an undo)")
        self.n_layers, self.alpha, self.check_every, self.tol = n_layers, alpha, check_every, tol
        self.min_active, self.start_window = min_active, start_window
        self.guard, self.guard_tol, self.guard_delay = guard, guard_tol, guard_delay
        self.stable_windows, self.guard_ref, self.guard_confirm = stable_windows, guard_ref, guard_confirm
        self.guard_min_ref, self.ref_after = guard_min_ref, ref_after
        self.above = 0                  # consecutive windows above the projection (guard_confirm)
        self.frozen = 0
        self.window = 0
        self.sums = [0.0] * n_layers
        self.count = 0
        self.prev: list[float | None] = [None] * n_layers
        self.streak = [0] * n_layers    # consecutive windows with change <= tol
        self.delay_until = 0            # first window at which freezing may happen again
        self.ref: list[list[float]] = []            # (clock, val loss) measured with nothing frozen
        self.freezes: list[dict[str, Any]] = []     # freezes in force, oldest first (undo pops)
        self.history: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, n_layers: int, e, warmup_steps: int = 0) -> "FreezeRule":
        """The rule of an ``ElasticConfig``; reference points start after ``warmup_steps``."""
        return cls(n_layers, alpha=e.alpha, check_every=e.check_every, tol=e.tol, min_active=e.min_active,
                   start_window=e.start_window, guard=e.guard, guard_tol=e.guard_tol,
                   guard_delay=e.guard_delay, stable_windows=e.stable_windows, guard_ref=e.guard_ref,
                   guard_confirm=e.guard_confirm, guard_min_ref=e.guard_min_ref, ref_after=warmup_steps)

    @property
    def freezable(self) -> int:
        return self.n_layers - self.min_active

    def bound(self) -> int:
        """The alpha schedule's cap on the frozen count for this window."""
        left = self.freezable - self.frozen
        return self.frozen + (math.ceil(self.alpha * left - 1e-12) if left > 0 else 0)

    def projected(self, clock: float) -> float | None:
        """The reference (unfrozen) trajectory's validation loss at ``clock``; None without two points."""
        pts = self.ref[-self.guard_ref:]
        if len(pts) < 2:
            return None
        a, b = log_fit(pts)
        return a + b * math.log(max(clock, 1e-12))

    def first_undoubted(self, step: int) -> int | None:
        """The step of the first window ending at or after ``step`` whose validation loss was not
        above the guard's projection (with ``guard_confirm > 1`` a window above it may be followed
        by an undo of the newest freeze); None while there is none yet."""
        return next((h["step"] for h in self.history if h["step"] >= step and not h.get("above", 0)), None)

    def observe(self, grad_norms: Mapping[int, float]) -> None:
        """Add one step's per-layer gradient norms (active layers only)."""
        for layer, g in grad_norms.items():
            self.sums[layer] += float(g)
        self.count += 1

    def window_done(self, step: int) -> bool:
        return step > 0 and step % self.check_every == 0

    def decide(self, step: int, val_loss: Callable[[], float] | None = None,
               clock: float | None = None) -> Decision:
        """Close the window ending at ``step``; returns the decision (the trainer applies it).

        ``val_loss`` is called once per window when the guard is on (the reference trajectory
        and the cumulative check need every window's validation loss), except in the warm-up
        windows (``step <= ref_after``) while nothing is frozen, which use none; ``clock`` is
        the guard's time axis (default: ``step``).
        """
        clock = float(step) if clock is None else float(clock)
        self.window += 1
        F = self.frozen
        n = max(self.count, 1)
        means = {l: self.sums[l] / n for l in range(F, self.n_layers)}
        changes = {}
        for l, g in means.items():
            p = self.prev[l]
            if p is not None and p > 0:
                changes[l] = abs(g - p) / p
        for l, g in means.items():
            self.prev[l] = g
            self.streak[l] = self.streak[l] + 1 if changes.get(l, math.inf) <= self.tol else 0
        self.sums = [0.0] * self.n_layers
        self.count = 0
        d = Decision(step=step, window=self.window, action="hold", frozen_before=F, frozen_after=F,
                     changes={str(l): round(c, 5) for l, c in changes.items()},
                     grad_norms={str(l): round(g, 6) for l, g in means.items()},
                     stable={str(l): self.streak[l] for l in means})
        guarded = self.guard and val_loss is not None
        # a warm-up window with nothing frozen is neither a reference point nor checked: its
        # validation pass would be spent for nothing, so it is not run (val_loss stays None)
        if guarded and (F > 0 or step > self.ref_after):
            vl = float(val_loss())
            d.val_loss = vl
            if F == 0:   # after the warm-up (see above): a reference point
                self.ref.append([clock, vl])
            else:
                proj = self.projected(clock)
                d.projected = proj
                over = proj is not None and vl > proj * (1 + self.guard_tol) and bool(self.freezes)
                self.above = self.above + 1 if over else 0
                d.above = self.above
                if over and self.above < self.guard_confirm:
                    d.action = "delay"
                    d.reason = (f"validation loss {vl:.4f} > {proj:.4f} * (1 + {self.guard_tol}) for {self.above} "
                                f"of the {self.guard_confirm} consecutive windows an undo needs; no freezing meanwhile")
                    return self._log(d)
                if over:
                    self.above = 0
                    last = self.freezes.pop()
                    d.action, d.frozen_after = "undo", int(last["frozen_before"])
                    d.reason = (f"validation loss {vl:.4f} > {proj:.4f} * (1 + {self.guard_tol}), the loss "
                                f"projected without freezing; undoing the freeze of window {last['window']}")
                    self.frozen = d.frozen_after
                    self.delay_until = self.window + 1 + self.guard_delay
                    # the layers thawed by the undo must prove stable again before refreezing
                    for l in range(d.frozen_after, F):
                        self.streak[l] = 0
                    return self._log(d)
        if self.window < self.start_window:
            d.action, d.reason = "warmup", f"freezing starts at window {self.start_window}"
            return self._log(d)
        if self.window < self.delay_until:
            d.action, d.reason = "delay", f"guard delay until window {self.delay_until}"
            return self._log(d)
        if F >= self.freezable:
            d.action, d.reason = "max", f"{F} layers frozen, {self.min_active} must stay active"
            return self._log(d)
        cand = F
        while cand < self.freezable and self.streak[cand] >= self.stable_windows:
            cand += 1
        b = self.bound()
        d.bound, d.candidate = b, cand
        new = max(F, min(cand, b))
        if new == F:
            d.reason = (f"layer {F} gradient norm stable for {self.streak[F]} window(s) "
                        f"(change {changes[F]:.3f}, tol {self.tol}); needs {self.stable_windows}"
                        if F in changes else f"no previous window for layer {F}")
            return self._log(d)
        if guarded and len(self.ref) < self.guard_min_ref:
            d.reason = (f"guard: {len(self.ref)} of the {self.guard_min_ref} unfrozen validation points "
                        f"(after step {self.ref_after}) the reference trajectory needs")
            return self._log(d)
        self.freezes.append({"frozen_before": F, "window": self.window, "step": step, "val_loss": d.val_loss})
        d.action, d.frozen_after = "freeze", new
        d.reason = (f"layers {F}..{new - 1} changed <= tol {self.tol} for {self.stable_windows} window(s)"
                    + (f", capped by alpha bound {b}" if cand > b else ""))
        self.frozen = new
        return self._log(d)

    def _log(self, d: Decision) -> Decision:
        self.history.append(d.to_dict())
        return d

    # ---- exact resumption ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "window": self.window, "sums": list(self.sums), "count": self.count,
                "prev": list(self.prev), "streak": list(self.streak), "delay_until": self.delay_until,
                "ref": [list(p) for p in self.ref], "freezes": [dict(f) for f in self.freezes],
                "above": self.above, "history": list(self.history)}

    def load_state_dict(self, st: Mapping[str, Any]) -> None:
        self.frozen, self.window = int(st["frozen"]), int(st["window"])
        self.sums, self.count = [float(x) for x in st["sums"]], int(st["count"])
        self.prev = [None if x is None else float(x) for x in st["prev"]]
        self.streak = [int(x) for x in st.get("streak", [0] * self.n_layers)]
        self.delay_until = int(st["delay_until"])
        self.ref = [[float(s), float(v)] for s, v in st.get("ref", [])]
        self.freezes = [dict(f) for f in st.get("freezes", [])]
        self.above = int(st.get("above", 0))
        self.history = list(st.get("history", []))
