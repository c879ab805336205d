"""The pluggable data-parallel sync interface.

A *sync strategy* keeps the replicas of a set of parameters (the whole model's replicas, or the
replicas of one pipeline stage) in sync over a process group.  It owns no optimizer: like
torchft's ``LocalSGD``/``DiLoCo`` it wraps the one optimizer path (:mod:`skiptrain.optim`), and
:func:`skiptrain.runtime.step.optimizer_step` drives it once per iteration::

    grads = strat.local_grads()                 # this replica's SUM over its micro-batches
    update = strat.exchange(grads, n, lr)       # the group's update input, or None
    ...one global clip, then optimizer.step() on ``update``...
    stats = strat.after_update(lr)              # DiLoCo's outer step, consistency, accounting

Contract of ``exchange(grads, n_processed, lr)``:

* ``grads`` holds the **sum** of the loss gradients of the ``n_processed`` micro-batches this
  replica ran this iteration (float32 copies the strategy may modify; zeros when
  ``n_processed == 0``);
* every replica of the group must call it (a replica that processed nothing still takes part
  in the collectives, with ``n_processed = 0``);
* it returns what the optimizer applies: the group's mean gradient for ``update_rule ==
  "adamw"`` strategies (all-reduce, PowerSGD; DiLoCo: this replica's own mean, its inner step),
  a unit-scale direction for ``"direction"`` strategies (DeMo), or None when parameters are not
  updated this iteration (nothing processed anywhere; DeMo between syncs);
* ``clip_local``: whether the global clip applies to the local gradients before the exchange
  (DeMo, as in its reference, clips what it folds into its momentum) or to the output;
* fed identical inputs in the same order, the optimizer keeps replicas bit-identical (DiLoCo:
  after every outer step; between them replicas drift by design);
* the gradient average is weighted by micro-batch counts: dense strategies all-reduce the
  summed gradients and counts and divide; DeMo weights each replica's coefficients by its count
  (see :mod:`skiptrain.dp.demo`);
* errors: a peer's malformed payload raises :class:`~skiptrain.dp.payload.PayloadError` and a
  failed consistency check :class:`~skiptrain.dp.consistency.ConsistencyError` on every rank,
  before anything is applied; a dead peer raises gloo's error after the group's timeout.

Parameters are ordered by global name, so replicas whose modules were built in another order
still agree; at construction the group checks that every replica has the same names and shapes.

``state_dict()`` returns ``{"strategy", "step", "tensors": {global name: {state: tensor}}, ...}``;
tensor states are keyed by global parameter name so checkpoints can be resharded by name.  The
optimizer's own state (AdamW moments) is not part of it: it belongs to the optimizer.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import UserError
from .consistency import check_consistency
from .transport import Transport


@dataclass
class SyncStats:
    step: int                 # iterations completed, this one included
    synced: bool              # whether this iteration exchanged data and updated parameters
    n_total: int              # micro-batches processed by the whole group (synced steps; else local)
    payload_bytes: int        # what this node contributed to the collectives this step
    received_bytes: int       # what this node downloaded (ring algorithms)
    dense_fp32_bytes: int     # payload of a dense fp32 all-reduce of the same parameters
    comm_s: float             # wall time spent in collectives (emulated delay included)
    checked: bool = False     # whether the consistency hashes were compared this step


class StrategyError(UserError, RuntimeError):
    """Replicas were built inconsistently (names/shapes differ) or a state does not fit."""


class SyncStrategy:
    """Base class: parameter bookkeeping, consistency checks, accounting.  Subclasses implement
    :meth:`_exchange` (and :meth:`_after_update` when they act after the optimizer)."""

    name = "base"
    update_rule = "adamw"     # the optimizer rule (skiptrain.optim.RULES) that consumes exchange()'s output

    @classmethod
    def rule_for(cls, dp_cfg) -> str:
        """The optimizer rule this strategy feeds under ``dp_cfg`` (its ``update_rule``), known
        before any parameter exists: what a node that serves no stage yet builds its optimizer
        with when it is handed one."""
        return cls.update_rule
    clip_local = False        # True: the global clip scales the local gradients before the exchange
    replicas_drift = False    # True: replicas' weights differ between syncs (checkpoints save each replica's)
    #: the step (``step_count``) at which the run or phase ends, set by the caller: a strategy with
    #: local steps also syncs there (:meth:`interval_due`), so the replicas end identical and the
    #: saved model is their consensus, not one replica's local weights
    end_step: int | None = None

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], transport: Transport,
                 dp_cfg, optim_cfg):
        self.named = sorted(((n, p) for n, p in named_params if p.requires_grad), key=lambda t: t[0])
        if not self.named:
            raise StrategyError("a sync strategy needs at least one trainable parameter")
        self.params = dict(self.named)
        self.device = self.named[0][1].device     # where every state tensor of the strategy lives
        self.tr = transport
        self.dp, self.opt = dp_cfg, optim_cfg
        self.n_params = sum(p.numel() for _, p in self.named)
        self.tr.acct.n_params = self.n_params
        self.step_count = 0
        self._c0 = 0.0
        self._synced, self._n_total = False, 0
        self._check_layout()

    @property
    def rank(self) -> int:
        return self.tr.rank

    @property
    def world(self) -> int:
        return self.tr.world

    def local_grads(self) -> dict[str, torch.Tensor]:
        """float32 copies of this replica's gradients by name (zeros where a parameter has none)."""
        return {n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                for n, p in self.named}

    def _check_layout(self) -> None:
        desc = "|".join(f"{n}:{tuple(p.shape)}" for n, p in self.named)
        h = torch.tensor([zlib.crc32(desc.encode()), self.n_params], dtype=torch.int64)
        allh = self.tr.all_gather_tensor(h, account=False)
        bad = [r for r, x in enumerate(allh) if not torch.equal(x, allh[0])]
        if bad:
            raise StrategyError(f"data-parallel replicas disagree on parameter names/shapes: ranks {bad} "
                                "differ from rank 0; every replica of a group must hold the same tensors")

    # ---- the interface -------------------------------------------------------------------

    def exchange(self, grads: dict[str, torch.Tensor], n_processed: int, lr: float) -> dict[str, torch.Tensor] | None:
        """Sync this iteration's gradients; return the optimizer's input (or None: no update)."""
        if n_processed < 0:
            raise ValueError(f"n_processed must be >= 0, got {n_processed}")
        self._c0 = self.tr.comm_s
        self.step_count += 1
        update, self._synced, self._n_total = self._exchange(grads, int(n_processed), float(lr))
        return update

    def after_update(self, lr: float) -> SyncStats:
        """After the optimizer applied :meth:`exchange`'s output: the strategy's own post-step
        (DiLoCo's outer sync), the consistency check on synced steps, and the step's accounting."""
        outer = self._after_update(float(lr))
        if outer is not None:
            self._synced, self._n_total = True, outer
        checked = False
        k = getattr(self.dp, "check_every", 0)
        if self._synced and k and self.step_count % k == 0:
            check_consistency(self.named, self.tr, self.step_count)
            checked = True
        sb = self.tr.acct.end_step()
        return SyncStats(self.step_count, self._synced, self._n_total, sb.payload, sb.received, 4 * self.n_params,
                         self.tr.comm_s - self._c0, checked)

    def carry_step(self, old: "SyncStrategy") -> None:
        """Take over the step ``old`` exchanged but did not finish (a group re-formed after a peer
        died between the exchange and :meth:`after_update`): its end step, whether it synced and
        over how many micro-batches, so :meth:`after_update` here finishes that step."""
        self.end_step, self._synced, self._n_total = old.end_step, old._synced, old._n_total
        self._c0 = self.tr.comm_s

    def interval_due(self, every: int) -> bool:
        """Whether a strategy that syncs every ``every`` steps syncs at this step: on the interval,
        and at :attr:`end_step`."""
        return self.step_count % every == 0 or self.step_count == self.end_step

    def check_consistency(self) -> None:
        """Compare parameter hashes across the group now (raises ConsistencyError)."""
        check_consistency(self.named, self.tr, self.step_count)

    def _exchange(self, grads: dict[str, torch.Tensor], n: int, lr: float) -> tuple[dict | None, bool, int]:
        """Exchange; return (optimizer input or None, synced, micro-batches over the group)."""
        raise NotImplementedError

    def _after_update(self, lr: float) -> int | None:
        """Work after the optimizer step; return the group's micro-batch count if it synced."""
        return None

    def state_dict(self) -> dict:
        return {"strategy": self.name, "step": self.step_count, "tensors": {}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("strategy") != self.name:
            raise StrategyError(f"state is for strategy {state.get('strategy')!r}, this is {self.name!r}")
        missing = [n for n in self.state_tensor_names() if n not in state["tensors"]]
        if missing:
            raise StrategyError(f"state lacks tensors {missing[:3]}{'...' if len(missing) > 3 else ''}")
        self.step_count = int(state["step"])

    def state_tensor_names(self) -> list[str]:
        """Parameter names whose per-tensor state :meth:`state_dict` carries."""
        return []

    def summary(self) -> dict:
        return self.tr.acct.summary()


def sync_summary(strats: list, n_params: int) -> dict:
    """What a node's sync strategies did over the phase (one per stage it serves): bytes per
    step summed over them, counts of the first, the parameter hashes of all (replica checks)."""
    from .consistency import param_hashes

    parts = [x.summary() for x in strats]
    out = dict(parts[0])
    for k in ("params", "payload_bytes_per_step", "payload_bytes_per_sync", "received_bytes_per_step",
              "control_bytes_per_step", "dense_fp32_payload_bytes", "dense_fp32_received_bytes"):
        out[k] = sum(p[k] for p in parts)
    for k, num, den in (("ratio_payload_vs_fp32", "dense_fp32_payload_bytes", "payload_bytes_per_step"),
                        ("ratio_received_vs_fp32", "dense_fp32_received_bytes", "received_bytes_per_step")):
        out[k] = out[num] / out[den] if out[den] else float("inf")
    out.update(emulated_link_s=sum(x.tr.emulated_s for x in strats), n_params=n_params,
               param_hashes=param_hashes([kv for x in strats for kv in x.named]).tolist())
    return out
