"""DeMo (Decoupled Momentum, DisTrO): sync a compressed slice of the momentum, step by its sign.

Per parameter tensor, per iteration, on every replica (DESIGN.md section 3):

1. local mean gradient ``g = grad_sum / n_processed`` (zero if nothing was processed), already
   scaled by the global clip (``clip_local``: the optimizer path clips the local gradients
   before the exchange, as DeMo's reference clips what it folds into the momentum);
2. momentum with the learning rate folded in: ``m = beta * m + lr * C(g)``, where ``C`` is the
   chunked orthonormal DCT (:mod:`skiptrain.dp.dct`; identity when ``dp.dct`` is off).  The
   momentum is kept in coefficient space; since ``C`` is orthonormal this is the same as DeMo's
   parameter-space momentum (up to the padding of dimensions the chunk does not divide);
3. every ``H = dp.sync_every`` iterations: keep the ``k`` largest-magnitude coefficients of
   each chunk and quantise them with the value encoding;
4. exchange: one fixed-size byte payload per replica (:mod:`skiptrain.dp.payload`), one
   all-gather; every payload is validated before anything is applied; then exactly what was
   sent (this replica's payload as the others decode it) is subtracted from ``m`` (error
   feedback: the residual ``m - sent`` stays local, including the quantisation error);
5. decode: each coefficient is the average of the values of the replicas that sent it,
   weighted by their micro-batch counts (DeMo's plain mean when counts are equal; all weights
   are 1 if no replica processed anything); inverse DCT; padding cropped;
6. the direction ``sign(decoded)`` goes to the one optimizer path (:mod:`skiptrain.optim`,
   rule ``direction``): decoupled weight decay on matrices ``p *= 1 - lr * wd``, then
   ``p -= lr * sign(decoded)``.  Step rule ``adam`` hands ``decoded / lr`` to AdamW instead.

With ``H > 1`` the iterations between syncs only fold their gradients into the local momentum
(no parameter update), so replicas stay bit-identical at every iteration and bytes per
iteration drop by ``H``; the cost is ``H`` times fewer parameter updates for the same tokens.

Every replica decodes the same gathered payloads in the same (rank) order with the same
deterministic operations, so parameters stay bit-identical (checked every ``dp.check_every``
steps).  A replica that processed no micro-batch still sends a payload, with weight 0, and keeps
its residual (no error-feedback subtraction).
"""

from __future__ import annotations

import torch

from .sparse import SparseExchange
from .strategy import StrategyError, SyncStrategy


class DeMoStrategy(SyncStrategy):
    name = "demo"
    clip_local = True

    def __init__(self, named_params, transport, dp_cfg, optim_cfg):
        super().__init__(named_params, transport, dp_cfg, optim_cfg)
        self.beta, self.H = dp_cfg.beta, dp_cfg.sync_every
        self.step_rule = getattr(dp_cfg, "step_rule", "sign")
        if self.step_rule not in ("sign", "rms", "clip", "adam"):
            raise StrategyError(f"unknown dp.step_rule {self.step_rule!r}; choose sign, rms, clip or adam")
        self.sparse = SparseExchange(self.named, dp_cfg, transport)
        self.geo, self.k, self.layout = self.sparse.geo, self.sparse.k, self.sparse.layout
        self.m = self.sparse.zeros()
        self.mu = float(getattr(dp_cfg, "update_momentum", 0.0))
        # momentum of the decoded update (dp.update_momentum > 0): identical on every replica
        self.u = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.named} if self.mu else {}
        # step rule "adam": the decoded update, read as a gradient, goes to AdamW
        self.update_rule = self.rule_for(dp_cfg)
        self.n_since = 0        # micro-batches folded into m since the last sync

    @classmethod
    def rule_for(cls, dp_cfg) -> str:
        return "adamw" if getattr(dp_cfg, "step_rule", "sign") == "adam" else "direction"

    @property
    def payload_bytes(self) -> int:
        return self.sparse.payload_bytes

    @property
    def syncs(self) -> int:
        return self.sparse.syncs

    @torch.no_grad()
    def _exchange(self, grads: dict[str, torch.Tensor], n: int, lr: float):
        if n > 0:
            for name, g in grads.items():
                self.m[name].mul_(self.beta).add_(self.geo[name].forward(g.div_(n)), alpha=lr)
        else:
            for m in self.m.values():
                m.mul_(self.beta)
        self.n_since += n
        if self.step_count % self.H:
            return None, False, n
        # compress with error feedback, exchange, validate, then the weighted mean per coefficient
        decoded = self.sparse.exchange(self.m, self.n_since)
        self.n_since = 0
        n_total = sum(decoded.weights)
        out = {}
        for name, upd in self.sparse.average(decoded, by="senders").items():
            if self.mu:
                upd = self.u[name].mul_(self.mu).add_(upd)
            out[name] = self._direction(upd, lr)
        return out, True, n_total

    def _direction(self, upd: torch.Tensor, lr: float) -> torch.Tensor:
        """What the optimizer applies, from the decoded momentum (``dp.step_rule``): a unit-scale
        direction, or for ``adam`` the decoded update read as a gradient (it is lr-folded)."""
        if self.step_rule == "sign":
            return torch.sign(upd)
        if self.step_rule == "adam":
            return upd / lr if lr > 0 else torch.zeros_like(upd)
        rms = upd.square().mean().sqrt()  # "rms": same RMS as a sign step, relative magnitudes kept
        if not rms > 0:
            return torch.zeros_like(upd)
        if self.step_rule == "clip":  # "clip": sign where |d| >= rms(d), proportionally less below
            return (upd / rms).clamp_(-1.0, 1.0)
        return upd / rms

    def state_tensor_names(self) -> list[str]:
        return [n for n, _ in self.named]

    def state_dict(self) -> dict:
        st = super().state_dict()
        st.update(syncs=self.syncs, n_since=self.n_since,
                  tensors={n: {"momentum_coeffs": m.clone(), **({"update_momentum": self.u[n].clone()} if self.mu else {})}
                           for n, m in self.m.items()})
        return st

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sparse.syncs, self.n_since = int(state["syncs"]), int(state["n_since"])
        for n, m in self.m.items():
            src = state["tensors"][n]["momentum_coeffs"]
            if src.shape != m.shape:
                raise StrategyError(f"momentum of {n} has shape {tuple(src.shape)}, expected {tuple(m.shape)} "
                                    "(different dp.chunk or dp.dct setting)")
            m.copy_(src)
            if self.mu:
                u = state["tensors"][n].get("update_momentum")
                if u is None:
                    raise StrategyError(f"state lacks the update momentum of {n} (saved with dp.update_momentum=0); "
                                        "resume with dp.update_momentum=0")
                self.u[n].copy_(u)
