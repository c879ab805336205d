"""Tagged point-to-point messages between node processes over torch.distributed (gloo).

Wire format: every message is two gloo sends on the pair ``src -> dst``:

1. a **header**: an int64 tensor of :data:`HEADER_LEN` values ``[kind, iteration, mb, pos,
   codec, ndim, d0, d1, d2, d3, generation]`` sent with tag :data:`TAG_HEADER`;
2. the **payload**, tag :data:`TAG_PAYLOAD`: a contiguous float32 tensor of that shape, or, when
   the link's codec (``codec_of(dst)``: bf16, or int8 / int4 with one scale per row,
   :mod:`skiptrain.schedule.actcodec`) is not fp32, the encoded uint8 buffer, which the
   receiver decodes back to a float32 tensor of that shape before anything else sees it.

Device: gloo sends host tensors.  With a CUDA ``device`` an outgoing tensor is encoded on the
device (a bf16 or int8 payload crosses PCIe at its wire size), copied into a pinned host buffer
by a non-blocking copy, and the sender thread waits for that copy's CUDA event before the gloo
send, so :meth:`P2PTransport.send` returns at once and the copy overlaps the next compute; a
received payload is copied to the device the same way (pinned, non-blocking) and decoded there.
On the CPU nothing is staged.

The receiver posts ``irecv(src=None, tag=TAG_HEADER)`` (gloo's receive-from-any-source), learns
the sender from the completed work, then receives the payload from exactly that sender.  Gloo
matches messages per (pair, tag) in FIFO order and each destination has exactly one sender
thread, so a header is always followed by its own payload.  No tensor is pickled.

Threads: one **sender thread per destination** (created on first use) holds messages until the
delivery time its pacing gives (the emulated links of :mod:`skiptrain.runtime.emulation`;
immediately without) and sends them in FIFO order; one **receiver thread** receives exactly as many messages as the
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

from ..model.device import to_device, to_host_async
from ..schedule import actcodec
from ..schedule.timeline import Event

MAX_DIMS = 4
HEADER_LEN = 7 + MAX_DIMS
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


def encode_header(kind: int, iteration: int, mb: int, pos: int, shape: tuple[int, ...],
                  codec: str = "fp32", gen: int = 0) -> torch.Tensor:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"payload has {len(shape)} dimensions; at most {MAX_DIMS} fit a header")
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    return torch.tensor([kind, iteration, mb, pos, actcodec.CODECS.index(codec), len(shape), *dims, gen],
                        dtype=torch.int64)


def decode_header(h: torch.Tensor) -> tuple[int, int, int, int, tuple[int, ...], str]:
    """(kind, iteration, micro-batch, position, shape, codec); raises TransportError if malformed."""
    v = h.tolist()
    kind, it, mb, pos, c, nd = v[:6]
    if kind not in (ACT, GRAD) or not 0 <= c < len(actcodec.CODECS) or not 0 <= nd <= MAX_DIMS \
            or any(d < 0 for d in v[6:6 + nd]):
        raise TransportError(f"malformed message header {v}")
    return kind, it, mb, pos, tuple(v[6:6 + nd]), actcodec.CODECS[c]


def header_generation(h: torch.Tensor) -> int:
    """The membership generation a header was sent in."""
    return int(h[HEADER_LEN - 1])


def encode_payload(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """What goes on the wire for ``tensor`` under ``codec`` (float32, or the encoded bytes)."""
    payload = tensor.detach().to(torch.float32).contiguous()
    return payload if codec == "fp32" else actcodec.encode(payload, codec)


def payload_buffer(shape: tuple[int, ...], codec: str) -> torch.Tensor:
    """An empty receive buffer for a payload of ``shape`` under ``codec``."""
    if codec == "fp32":
        return torch.empty(shape, dtype=torch.float32)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return torch.empty(actcodec.encoded_bytes(codec, rows, shape[-1] if shape else 1), dtype=torch.uint8)


def decode_payload(buf: torch.Tensor, codec: str, shape: tuple[int, ...]) -> torch.Tensor:
    return buf if codec == "fp32" else actcodec.decode(buf, codec, shape)


class P2PTransport:
    """See the module docstring.  ``clock()`` returns seconds relative to the iteration start;
    ``record`` (optional) receives timeline events for sends and receives."""

    def __init__(self, rank: int, group=None,
                 stage_of: Callable[[int], int] | None = None,
                 rank_of: Callable[[int], int] | None = None, node_of: Callable[[int], int] | None = None,
                 codec_of: Callable[[int], str] | None = None, device: torch.device | None = None,
                 gen: int = 0):
        self.rank, self.gen = rank, gen      # (``gen``: the membership generation; every message carries it)
        self.device = device or torch.device("cpu")     # where received tensors are handed over
        self.codec_of = codec_of or (lambda dst: "fp32")   # the encoding of messages to ``dst``
        # node id <-> rank in the current process group (they differ after a recovery re-formed
        # the groups over the survivors; identity otherwise)
        self.rank_of = rank_of or (lambda n: n)
        self.node_of = node_of or (lambda r: r)
        self.group = group
        # when a message may leave and when it arrives, ``schedule(dst, nbytes, now) -> (start,
        # deliver)`` with ``reset()`` per iteration; None: at once (set only by the emulation seam,
        # :meth:`skiptrain.runtime.emulation.Emulation.pace`)
        self.pacing = None
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
        self._pending = 0
        self._cond = threading.Condition()

    # ---- timeline -------------------------------------------------------------------------

    def begin_iteration(self, iteration: int, t0: float) -> None:
        """New iteration: times are recorded relative to ``t0``; link FIFOs start idle."""
        self.iteration, self.t0 = iteration, t0
        if self.pacing is not None:
            self.pacing.reset()
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
        codec = self.codec_of(dst)
        if dst == self.rank:        # between two stages of this node: straight to the inbox
            if codec != "fp32":
                tensor = decode_payload(encode_payload(tensor, codec), codec, tuple(tensor.shape))
            self.inbox.put(Message(kind, self.iteration, mb, pos, self.rank, tensor, time.time()))
            return
        payload, copied = to_host_async(encode_payload(tensor, codec))
        nbytes = payload.numel() * payload.element_size()
        now = time.time()
        if self.pacing is not None:
            start, deliver = self.pacing.schedule(dst, nbytes, now)
        else:
            start, deliver = now, now
        hdr = encode_header(kind, self.iteration, mb, pos, tuple(tensor.shape), codec, self.gen)
        if dst not in self._senders:
            q: queue.Queue = queue.Queue()
            th = threading.Thread(target=self._send_loop, args=(dst, q), name=f"send{self.rank}->{dst}",
                                  daemon=True)
            self._senders[dst] = (q, th)
            th.start()
        with self._cond:
            self._pending += 1
        self._senders[dst][0].put((start, deliver, hdr, payload, mb, self.t0, copied))

    def _send_loop(self, dst: int, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            start, deliver, hdr, payload, mb, t0, copied = item
            delay = deliver - time.time()
            if delay > 0:
                time.sleep(delay)
            try:
                if copied is not None:
                    copied.synchronize()     # the device-to-host copy into the pinned buffer is done
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
                               payload.numel() * payload.element_size(), dst))
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    # ---- receiving ------------------------------------------------------------------------

    def expect(self, n: int) -> None:
        """Announce ``n`` more incoming messages (the executor knows them from the schedule)."""
        if n > 0:
            self._expect.put(n)

    def _recv_loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)     # this thread's copies and decodes: on the node's GPU
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
                    kind, it, mb, pos, shape, codec = decode_header(hdr)
                    if header_generation(hdr) != self.gen:
                        raise TransportError(f"a message of generation {header_generation(hdr)} arrived in "
                                             f"generation {self.gen}: stale, rejected")
                    buf = payload_buffer(shape, codec)
                    dist.recv(buf, src_rank, group=self.group, tag=TAG_PAYLOAD)
                    nbytes = buf.numel() * buf.element_size()
                    payload = decode_payload(to_device(buf, self.device), codec, shape)
                except Exception as e:  # noqa: BLE001
                    who = f"node {src}" if src is not None else "any peer"
                    self.inbox.put(TransportError(
                        f"node {self.rank}: receiving from {who} failed: {str(e).splitlines()[0][:200]}",
                        peer=src))
                    return
                now = time.time()
                self._record(Event(self.rank, "recv", mb, self.stage_of(self.rank), now - self.t0,
                                   now - self.t0, nbytes, src))
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
    own inbox at once (no wire, no thread).  What the one-process trainer runs on; the executor
    cannot tell it from :class:`P2PTransport`.  With a ``codec`` other than fp32 every message
    goes through that encoding and back, as on a swarm's compressed links (so a one-process run
    shows what the quantisation does to training)."""

    def __init__(self, rank: int = 0, codec: str = "fp32"):
        actcodec.check_codec(codec)
        self.rank = rank
        self.codec = codec
        self.inbox: "queue.Queue[Message | TransportError]" = queue.Queue()
        self.iteration = 0

    def begin_iteration(self, iteration: int, t0: float) -> None:
        self.iteration = iteration

    def expect(self, n: int) -> None:
        """Nothing to receive from a wire: every message is a local send."""

    def send(self, dst: int, kind: int, mb: int, pos: int, tensor: torch.Tensor) -> None:
        if dst != self.rank:
            raise TransportError(f"node {self.rank}: a local transport cannot reach node {dst}", peer=dst)
        if self.codec != "fp32":
            tensor = decode_payload(encode_payload(tensor, self.codec), self.codec, tuple(tensor.shape))
        self.inbox.put(Message(kind, self.iteration, mb, pos, self.rank, tensor, time.time()))

    def wait_sent(self, timeout: float) -> None:
        """Local sends are delivered at once."""

    def take_events(self) -> list[Event]:
        return []

    def close(self) -> None:
        """Nothing to stop."""
