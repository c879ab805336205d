"""The common start of an iteration: every node agrees whether to stop and when to start.

Rank 0 gathers every node's stop flag and answers with one broadcast of (the strongest stop,
start time = its clock + the start margin, its clock); each node then waits for the start time on
its own clock.  A stop carries its reason (:meth:`~skiptrain.runtime.node.coordinator_link.
CoordinatorLink.stop_code`): every node ends for the reason agreed on, whether or not it read the
request itself before the gather (a node that stops for want of a coordinator while its peers
think the run finished would leave its supervisor alone to wait for the next coordinator).  The margin follows the network: twice the slowest receipt of the start time over the
last :data:`START_WINDOW` iterations, within :data:`START_MARGIN_S`.

Failure semantics: the exchange is the control plane's (it gives up on a new generation); a node
whose lease ran out starts nothing: it ends at once
(:meth:`~skiptrain.runtime.node.coordinator_link.CoordinatorLink.lease_expired`).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

# every iteration starts at rank 0's clock plus a margin that lets the start time reach every
# node first: twice the slowest receipt of the last START_WINDOW iterations, within these bounds
START_MARGIN_S = (0.01, 0.2)
START_WINDOW = 10


class IterationStart:
    """The start of each iteration over a control plane (see the module's docstring)."""

    def __init__(self, control):
        self.control = control
        self.margin = START_MARGIN_S[1]
        self.delays: deque[float] = deque(maxlen=START_WINDOW)

    def agree(self, wait: bool = True) -> tuple[bool, float, float]:
        """Gather the stop flags, broadcast the start; unless a stop was agreed (or ``wait`` is
        False), wait for the start time on this node's clock: rank 0's clock is trusted only within
        the margin, so a host whose clock is off waits at most the margin after the start reached it
        (on one host this is exactly rank 0's start time).  Returns (stop, the start time on this
        node's clock, how late the start reached it)."""
        control, link = self.control, self.control.link
        if link.watch is not None and not link.hb.lease_holds():
            link.lease_expired(f"node {control.rank}: its lease ran out before an iteration's start")
        flags = control.gather_at_root(torch.tensor([link.stop_code()], dtype=torch.float64))
        tt = torch.zeros(3, dtype=torch.float64)
        if flags is not None:
            stamp = time.time()
            tt[:] = torch.tensor([float(flags.max()), stamp + self.margin, stamp], dtype=torch.float64)
        control.sync(dist.broadcast, tt, 0)
        stop, t0, stamp = bool(tt[0] > 0), float(tt[1]), float(tt[2])
        if stop:
            link.agree_stop(float(tt[0]))
        if stop or not wait:
            return stop, t0, 0.0
        now = time.time()
        delay = min(max(now - stamp, 0.0), t0 - stamp)
        t0 = now + (t0 - stamp) - delay
        time.sleep(max(0.0, t0 - time.time()))
        return False, t0, delay

    def observe(self, delay: float) -> None:
        """The slowest receipt of the last start time: the next margin is twice the slowest of
        the last ``START_WINDOW``, within ``START_MARGIN_S``."""
        self.delays.append(delay)
        self.margin = min(START_MARGIN_S[1], max(START_MARGIN_S[0], 2 * max(self.delays)))
