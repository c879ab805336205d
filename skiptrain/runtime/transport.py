"""Tagged point-to-point messages between node processes over torch.distributed (gloo).

Wire format: every message is two gloo sends on the pair ``src -> dst``:

1. a **header**: an int64 tensor of :data:`HEADER_LEN` values ``[kind, iteration, mb, pos,
   ndim, d0, d1, d2, d3]`` sent with tag :data:`TAG_HEADER`;
2. the **payload**: a contiguous float32 tensor of that shape, tag :data:`TAG_PAYLOAD`.

The receiver posts ``irecv(src=None, tag=TAG_HEADER)`` (gloo's receive-from-any-source), learns
the sender from the completed work, then receives the payload from exactly that sender.  Gloo
matches messages per (pair, tag) in FIFO order and each destination has exactly one sender
thread, so a header is always followed by its own payload.  No tensor is pickled.

Threads: one **sender thread per destination** (created on first use) holds messages until their
emulated delivery time (:class:`~skiptrain.runtime.wan.LinkFifo`; immediately without emulation)
and sends them in FIFO order; one **receiver thread** receives exactly as many messages as the
executor announced with :meth:`P2PTransport.expect` (so no receive is ever posted when none is
due, and a receive that waits longer than the group timeout really means a stuck peer).

Failure semantics: a gloo error in either thread (peer killed: connection reset within tens of
ms; peer hung: the group timeout) is put into :attr:`P2PTransport.inbox` as a
:class:`TransportError` naming the peer when it is known; the executor raises it.  Nothing here
retries or re-routes; :meth:`close` stops the threads (daemon threads, so a failed process can
exit without joining them).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..schedule.timeline import Event
from .wan import LinkFifo

HEADER_LEN = 9
TAG_HEADER, TAG_PAYLOAD = 11, 12
ACT, GRAD = 0, 1          # message kinds: activations (forward), gradients (backward)
KIND_NAMES = ("activation", "gradient")


class TransportError(RuntimeError):
    """Sending to or receiving from a peer failed; ``peer`` is the node when known."""

    def __init__(self, msg: str, peer: int | None = None):
        super().__init__(msg)
        self.peer = peer


@dataclass
class Message:
    kind: int
    iteration: int
    mb: int
    pos: int
    src: int
    tensor: torch.Tensor
    arrived: float        # time.time() when the payload was in


def encode_header(kind: int, iteration: int, mb: int, pos: int, shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) > HEADER_LEN - 5:
        raise ValueError(f"payload has {len(shape)} dimensions; at most {HEADER_LEN - 5} fit a header")
    dims = list(shape) + [0] * (HEADER_LEN - 5 - len(shape))
    return torch.tensor([kind, iteration, mb, pos, len(shape), *dims], dtype=torch.int64)


def decode_header(h: torch.Tensor) -> tuple[int, int, int, int, tuple[int, ...]]:
    v = h.tolist()
    kind, it, mb, pos, nd = v[:5]
    if kind not in (ACT, GRAD) or not 0 <= nd <= HEADER_LEN - 5:
        raise TransportError(f"malformed message header {v}")
    return kind, it, mb, pos, tuple(v[5:5 + nd])


class P2PTransport:
    """See the module docstring.  ``clock()`` returns seconds relative to the iteration start;
    ``record`` (optional) receives timeline events for sends and receives."""

    def __init__(self, rank: int, group=None, link: LinkFifo | None = None,
                 stage_of: Callable[[int], int] | None = None,
                 rank_of: Callable[[int], int] | None = None, node_of: Callable[[int], int] | None = None):
        self.rank = rank
        # node id <-> rank in the current process group (they differ after a recovery re-formed
        # the groups over the survivors; identity otherwise)
        self.rank_of = rank_of or (lambda n: n)
        self.node_of = node_of or (lambda r: r)
        self.group = group
        self.link = link
        self.stage_of = stage_of or (lambda n: -1)
        self.inbox: "queue.Queue[Message | TransportError]" = queue.Queue()
        self.events: list[Event] = []
        self._events_lock = threading.Lock()
        self.t0 = time.time()
        self.iteration = 0
        self._senders: dict[int, tuple[queue.Queue, threading.Thread]] = {}
        self._expect: "queue.Queue[int | None]" = queue.Queue()
        self._recv_thread = threading.Thread(target=self._recv_loop, name=f"recv{rank}", daemon=True)
        self._recv_thread.start()
        self._closed = False
        self.bytes_sent = 0
        self._pending = 0
        self._cond = threading.Condition()

    # ---- timeline -------------------------------------------------------------------------

    def begin_iteration(self, iteration: int, t0: float) -> None:
        """New iteration: times are recorded relative to ``t0``; link FIFOs start idle."""
        self.iteration, self.t0 = iteration, t0
        if self.link is not None:
            self.link.reset()
        with self._events_lock:
            self.events = []

    def take_events(self) -> list[Event]:
        with self._events_lock:
            ev, self.events = self.events, []
        return ev

    def _record(self, e: Event) -> None:
        with self._events_lock:
            self.events.append(e)

    # ---- sending --------------------------------------------------------------------------

    def send(self, dst: int, kind: int, mb: int, pos: int, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` for ``dst``; returns at once (the sender thread does the work)."""
        if self._closed:
            raise TransportError("transport is closed")
        payload = tensor.detach().to(torch.float32).contiguous()
        nbytes = payload.numel() * 4
        now = time.time()
        if self.link is not None:
            start, deliver = self.link.schedule(dst, nbytes, now)
        else:
            start, deliver = now, now
        hdr = encode_header(kind, self.iteration, mb, pos, tuple(payload.shape))
        if dst not in self._senders:
            q: queue.Queue = queue.Queue()
            th = threading.Thread(target=self._send_loop, args=(dst, q), name=f"send{self.rank}->{dst}",
                                  daemon=True)
            self._senders[dst] = (q, th)
            th.start()
        with self._cond:
            self._pending += 1
        self._senders[dst][0].put((start, deliver, hdr, payload, mb, self.t0))
        self.bytes_sent += nbytes

    def _send_loop(self, dst: int, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            start, deliver, hdr, payload, mb, t0 = item
            delay = deliver - time.time()
            if delay > 0:
                time.sleep(delay)
            try:
                r = self.rank_of(dst)
                dist.send(hdr, r, group=self.group, tag=TAG_HEADER)
                dist.send(payload, r, group=self.group, tag=TAG_PAYLOAD)
            except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError
                self.inbox.put(TransportError(
                    f"node {self.rank}: sending {KIND_NAMES[int(hdr[0])]} of micro-batch {mb} to node {dst} "
                    f"(stage {self.stage_of(dst)}) failed: {str(e).splitlines()[0][:200]}", peer=dst))
                return
            end = time.time()
            self._record(Event(self.rank, "send", mb, self.stage_of(self.rank), start - t0, end - t0,
                               payload.numel() * 4, dst))
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    # ---- receiving ------------------------------------------------------------------------

    def expect(self, n: int) -> None:
        """Announce ``n`` more incoming messages (the executor knows them from the schedule)."""
        if n > 0:
            self._expect.put(n)

    def _recv_loop(self) -> None:
        while True:
            n = self._expect.get()
            if n is None:
                return
            for _ in range(n):
                src = None
                try:
                    hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
                    work = dist.irecv(hdr, src=None, group=self.group, tag=TAG_HEADER)
                    work.wait()
                    src = work._source_rank()
                    if self.group is not None:
                        src = dist.get_global_rank(self.group, src)
                    src_rank, src = src, self.node_of(src)
                    kind, it, mb, pos, shape = decode_header(hdr)
                    payload = torch.empty(shape, dtype=torch.float32)
                    dist.recv(payload, src_rank, group=self.group, tag=TAG_PAYLOAD)
                except Exception as e:  # noqa: BLE001
                    who = f"node {src}" if src is not None else "any peer"
                    self.inbox.put(TransportError(
                        f"node {self.rank}: receiving from {who} failed: {str(e).splitlines()[0][:200]}",
                        peer=src))
                    return
                now = time.time()
                self._record(Event(self.rank, "recv", mb, self.stage_of(self.rank), now - self.t0,
                                   now - self.t0, payload.numel() * 4, src))
                self.inbox.put(Message(kind, it, mb, pos, src, payload, now))

    def wait_sent(self, timeout: float) -> None:
        """Wait until every queued message has been handed to gloo (end of an iteration)."""
        deadline = time.time() + timeout
        with self._cond:
            while self._pending > 0:
                left = deadline - time.time()
                if left <= 0:
                    raise TransportError(f"node {self.rank}: {self._pending} message(s) still unsent after "
                                         f"{timeout:.0f} s")
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        """Stop the threads after queued messages are sent (does not wait for a stuck gloo call)."""
        if self._closed:
            return
        self._closed = True
        for q, _ in self._senders.values():
            q.put(None)
        self._expect.put(None)
        for _, th in self._senders.values():
            th.join(timeout=5.0)


class LocalTransport:
    """The transport between stages hosted by one process: a send is delivered to this process's
    own inbox at once (no copy, no wire, no thread).  What the one-process trainer runs on; the
    executor cannot tell it from :class:`P2PTransport`."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.link = None
        self.inbox: "queue.Queue[Message | TransportError]" = queue.Queue()
        self.iteration = 0
        self.bytes_sent = 0

    def begin_iteration(self, iteration: int, t0: float) -> None:
        self.iteration = iteration

    def expect(self, n: int) -> None:
        """Nothing to receive from a wire: every message is a local send."""

    def send(self, dst: int, kind: int, mb: int, pos: int, tensor: torch.Tensor) -> None:
        if dst != self.rank:
            raise TransportError(f"node {self.rank}: a local transport cannot reach node {dst}", peer=dst)
        self.inbox.put(Message(kind, self.iteration, mb, pos, self.rank, tensor, time.time()))

    def wait_sent(self, timeout: float) -> None:
        """Local sends are delivered at once."""

    def take_events(self) -> list[Event]:
        return []

    def close(self) -> None:
        """Nothing to stop."""
