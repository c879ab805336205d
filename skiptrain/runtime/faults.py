"""The fault-injection wrapper of the node, used by the tests and the benchmarks: a node process
that injects faults, ``python -m skiptrain.runtime.faults --job JOB.json``.

The node itself (:mod:`skiptrain.runtime.node`) has no fault code; this wrapper subclasses
:class:`~skiptrain.runtime.node.Node` and acts only at its ``hook`` points.  A job asks for it
with :func:`faulty_job` (``job.node_module`` and ``job.meta["faults"]``).  Each fault
is ``{"node", "kind", "phase", "iteration", "where", "delay_s", "factor"}``:

* ``kill`` / ``hang``: SIGKILL / SIGSTOP this process (after ``delay_s``: mid-iteration);
* ``raise``: the node itself fails (a non-recoverable error naming itself);
* ``nan`` / ``shape``: from then on every payload this node sends is NaN / cut in half (a bad peer);
* ``slow``: this node computes ``factor`` times slower from then on (drift);
* ``wrong_secret``: the node answers the admission challenge with a wrong secret;
* ``payload_nan`` / ``payload_index`` / ``payload_header``: from then on the DeMo payload this
  node contributes has a non-finite value / out-of-range indices / a wrong layout hash;
* ``grad_nan``: from then on this node's contribution to every dense DP sum (all-reduce) is NaN;
* ``hold``: the node waits (at most ``timeout_s``, default 60) until the store holds ``key``: a
  test holds the job at an iteration until an outside event (a joiner placed) happened;
* ``diverge``: this node's copy of ``tensor`` (default ``norm.weight``) drifts by ``by`` (default
  1e-3) before the iteration's step (replicas no longer identical, unless every replica drifts).

``where`` is ``start`` (default), ``after_pipeline``, ``after_sync``, ``after_commit`` or ``recover``;
each fault fires once.  ``flush``: a ``kill`` or ``hang`` waits for the node's pipeline sends first
(its peers finish their pipeline tasks).
The time a fault fires is written to the store as ``fault/<node>`` (the benches measure
detection from it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from skiptrain.runtime.failure import NodeFailure
from skiptrain.runtime.job import Job
from skiptrain.runtime.node import Node, main as node_main

MODULE = "skiptrain.runtime.faults"


def faulty_job(faults) -> dict:
    """Keyword arguments for :class:`~skiptrain.runtime.job.Job` that run every node through
    this wrapper with ``faults`` (one dict or a list)."""
    return {"node_module": MODULE, "meta": {"faults": faults if isinstance(faults, list) else [faults]}}


def _faults_of(job: Job, node: int) -> list[tuple[int, dict]]:
    return [(i, f) for i, f in enumerate(job.meta.get("faults") or []) if f and f.get("node") == node]


def _corrupting(send, kind: str):
    def send_corrupt(dst, k, mb, pos, tensor):
        payload = tensor.detach().to(torch.float32)
        if kind == "nan":
            payload = payload * float("nan")
        else:
            payload = payload.reshape(-1)[: max(1, payload.numel() // 2)].contiguous()
        return send(dst, k, mb, pos, payload)
    return send_corrupt


def _tampered(all_gather_bytes, kind: str, layout):
    """Wrap a strategy transport's ``all_gather_bytes`` so this node's own buffer is corrupted."""
    import numpy as np

    def gather(buf):
        buf = buf.copy()
        spec = layout.specs[0]
        a, b, _ = layout.blocks[spec.name]
        if kind == "payload_nan":
            bad = np.float32(np.nan) if layout.value_enc == "fp32" else np.float32(np.inf)
            buf[b:b + 4] = np.frombuffer(bad.tobytes(), np.uint8)   # first value / scale of a sign block
        elif kind == "payload_index":
            buf[a:b] = 0xFF        # every index at its encoding's maximum: out of range or duplicated
        else:
            buf[20:24] ^= 0xFF     # the layout hash in the header
        return all_gather_bytes(buf)
    return gather


def _poisoned(all_reduce_sum):
    """Wrap a strategy transport's ``all_reduce_sum`` so this node contributes NaN."""
    def poisoned(t, contribution=None):
        return all_reduce_sum(t.fill_(float("nan")), lambda: torch.full_like(t, float("nan")))
    return poisoned


class FaultyNode(Node):
    def __init__(self, job: Job, rank: int, *args, **kwargs):
        self.fired: set[int] = set()
        self.corrupt: str | None = None
        self.slowdown = 1.0
        if any(f["kind"] == "wrong_secret" for _, f in _faults_of(job, rank)):     # (the job was read with
            from skiptrain.runtime.join import SECRET_ENV                          # the right one)
            os.environ[SECRET_ENV] = "not the secret"
        super().__init__(job, rank, *args, **kwargs)

    def make_transport(self):
        tr = super().make_transport()
        if self.corrupt is not None:                 # an injected bad peer stays bad after a regroup
            tr.send = _corrupting(tr.send, self.corrupt)
        return tr

    def hook(self, phase, iteration, where, state=None):
        if state is not None and self.slowdown != 1.0:
            state.emulation.speed = state.emulation.base_speed / self.slowdown
        for i, f in _faults_of(self.job, self.rank):
            if i in self.fired or f.get("phase", phase) != phase or f.get("iteration", 0) != iteration \
                    or f.get("where", "start") != where or f["kind"] == "wrong_secret":
                continue
            self.fired.add(i)
            self._fire(f, state)

    def _mark(self) -> None:
        self.store.set(f"fault/{self.rank}", repr(time.time()))

    def _fire(self, f: dict, state) -> None:
        kind = f["kind"]
        if kind == "slow":
            self._mark()
            self.slowdown = float(f.get("factor", 4.0))
            if state is not None:
                state.emulation.speed = state.emulation.base_speed / self.slowdown
        elif kind in ("nan", "shape"):
            self._mark()
            self.corrupt = kind
            self.tr.send = _corrupting(self.tr.send, kind)
        elif kind == "grad_nan":
            self._mark()
            tr = state.strat.tr
            tr.all_reduce_sum = _poisoned(tr.all_reduce_sum)
        elif kind.startswith("payload_"):
            self._mark()
            tr = state.strat.tr
            tr.all_gather_bytes = _tampered(tr.all_gather_bytes, kind, state.strat.layout)
        elif kind == "diverge":
            with torch.no_grad():
                dict(state.model.named_parameters())[f.get("tensor", "norm.weight")].add_(float(f.get("by", 1e-3)))
        elif kind == "hold":
            from datetime import timedelta
            self._mark()                             # the test sees the node hold from the store
            self.store.wait([f["key"]], timedelta(seconds=float(f.get("timeout_s", 60.0))))
        elif kind == "raise":
            self._mark()
            raise NodeFailure(f"injected fault on node {self.rank}", node=self.rank)
        else:
            sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
            if f.get("flush"):
                self.tr.wait_sent(self.job.rt.timeout_s)

            def fire():
                self._mark()
                os.kill(os.getpid(), sig)

            if f.get("delay_s"):                     # mid-iteration
                threading.Timer(float(f["delay_s"]), fire).start()
            else:
                fire()


def main(argv: list[str] | None = None) -> int:
    return node_main(sys.argv[1:] if argv is None else argv, node_class=FaultyNode)


if __name__ == "__main__":
    sys.exit(main())
