"""The freeze rule: which bottom-up prefix of layers stops training, and when.

PipeTransformer (DESIGN.md section 2) freezes a prefix of layers bounded by a geometric schedule;
its released code applies only the bound, once per epoch.  This module implements the rule
the paper describes, in windows of ``check_every`` optimizer steps:

1. **Gradient signal.**  For every active layer the mean gradient norm over the window,
   ``G_l(w)``, is compared with the previous window's: ``change_l = |G_l(w) - G_l(w-1)| / G_l(w-1)``.
   The *converged prefix* is the longest run of active layers, starting at the first active
   one, whose change is at most ``tol``; it proposes ``candidate = F + len(prefix)``.
2. **Alpha bound.**  ``bound = F + ceil(alpha * (freezable - F))`` where ``freezable =
   n_layers - min_active`` (the top ``min_active`` layers never freeze).  ``alpha = 1/3`` is
   the paper's safe default; 1/5 is slower, 1/2 faster.
3. The new frozen count is ``min(candidate, bound)`` (never below ``F``).
4. **Guard.**  Validation loss is measured when a freeze happens; at the next window, if it
   rose by more than ``guard_tol`` (relative), the freeze is undone (back to the previous
   count) and freezing is delayed for ``guard_delay`` windows.

Every window produces a :class:`Decision` with its evidence (changes, bound, candidate,
validation loss, action).  The whole rule state is JSON (:meth:`FreezeRule.state_dict`), so
checkpoints resume it exactly.  The rule is pure bookkeeping: the trainer feeds it gradient
norms and validation losses and applies its decisions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping


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
    val_loss: float | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FreezeRule:
    """Bookkeeping of the freeze rule (see the module docstring)."""

    def __init__(self, n_layers: int, alpha: float = 1 / 3, check_every: int = 25, tol: float = 0.1,
                 min_active: int = 2, start_window: int = 2, guard: bool = True, guard_tol: float = 0.01,
                 guard_delay: int = 2):
        if min_active < 1 or min_active > n_layers:
            raise ValueError(f"min_active={min_active} must lie in 1..{n_layers}")
        self.n_layers, self.alpha, self.check_every, self.tol = n_layers, alpha, check_every, tol
        self.min_active, self.start_window = min_active, start_window
        self.guard, self.guard_tol, self.guard_delay = guard, guard_tol, guard_delay
        self.frozen = 0
        self.window = 0
        self.sums = [0.0] * n_layers
        self.count = 0
        self.prev: list[float | None] = [None] * n_layers
        self.delay_until = 0          # first window at which freezing may happen again
        self.pending: dict[str, Any] | None = None  # last freeze awaiting the guard's verdict
        self.history: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, n_layers: int, e) -> "FreezeRule":
        return cls(n_layers, alpha=e.alpha, check_every=e.check_every, tol=e.tol, min_active=e.min_active,
                   start_window=e.start_window, guard=e.guard, guard_tol=e.guard_tol,
                   guard_delay=e.guard_delay)

    @property
    def freezable(self) -> int:
        return self.n_layers - self.min_active

    def bound(self) -> int:
        """The alpha schedule's cap on the frozen count for this window."""
        left = self.freezable - self.frozen
        return self.frozen + (math.ceil(self.alpha * left - 1e-12) if left > 0 else 0)

    def observe(self, grad_norms: Mapping[int, float]) -> None:
        """Add one step's per-layer gradient norms (active layers only)."""
        for layer, g in grad_norms.items():
            self.sums[layer] += float(g)
        self.count += 1

    def window_done(self, step: int) -> bool:
        return step > 0 and step % self.check_every == 0

    def decide(self, step: int, val_loss: Callable[[], float] | None = None) -> Decision:
        """Close the window ending at ``step``; returns the decision (the trainer applies it).

        ``val_loss`` is called (at most once) when the guard needs a validation loss.
        """
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
        self.sums = [0.0] * self.n_layers
        self.count = 0
        d = Decision(step=step, window=self.window, action="hold", frozen_before=F, frozen_after=F,
                     changes={str(l): round(c, 5) for l, c in changes.items()},
                     grad_norms={str(l): round(g, 6) for l, g in means.items()})
        vl = None
        if self.guard and self.pending is not None and val_loss is not None:
            vl = val_loss()
            d.val_loss = vl
            ref = self.pending["val_loss"]
            if vl > ref * (1 + self.guard_tol):
                d.action, d.frozen_after = "undo", self.pending["frozen_before"]
                d.reason = (f"validation loss {vl:.4f} > {ref:.4f} * (1 + {self.guard_tol}) measured at the "
                            f"freeze in window {self.pending['window']}")
                self.frozen = d.frozen_after
                self.delay_until = self.window + 1 + self.guard_delay
                self.pending = None
                return self._log(d)
            self.pending = None
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
        while cand < self.freezable and cand in changes and changes[cand] <= self.tol:
            cand += 1
        b = self.bound()
        d.bound, d.candidate = b, cand
        new = max(F, min(cand, b))
        if new == F:
            d.reason = (f"layer {F} gradient norm changed {changes[F]:.3f} > tol {self.tol}" if F in changes
                        else f"no previous window for layer {F}")
            return self._log(d)
        if self.guard and val_loss is not None:
            vl = d.val_loss if d.val_loss is not None else val_loss()
            d.val_loss = vl
            self.pending = {"val_loss": vl, "frozen_before": F, "window": self.window}
        d.action, d.frozen_after = "freeze", new
        d.reason = (f"layers {F}..{new - 1} changed <= tol {self.tol}"
                    + (f", capped by alpha bound {b}" if cand > b else ""))
        self.frozen = new
        return self._log(d)

    def _log(self, d: Decision) -> Decision:
        self.history.append(d.to_dict())
        return d

    # ---- exact resumption ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "window": self.window, "sums": list(self.sums), "count": self.count,
                "prev": list(self.prev), "delay_until": self.delay_until, "pending": self.pending,
                "history": list(self.history)}

    def load_state_dict(self, st: Mapping[str, Any]) -> None:
        self.frozen, self.window = int(st["frozen"]), int(st["window"])
        self.sums, self.count = [float(x) for x in st["sums"]], int(st["count"])
        self.prev = [None if x is None else float(x) for x in st["prev"]]
        self.delay_until = int(st["delay_until"])
        self.pending = dict(st["pending"]) if st.get("pending") else None
        self.history = list(st.get("history", []))
