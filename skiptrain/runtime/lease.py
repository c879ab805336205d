"""Leases: a node's right to train, renewed through the store and timed on the reader's own clock.

A renewal is the value of ``hb/<node>`` (signed with the node's member key in a run with a
secret): ``{"inc", "seq", "gen", "state", "lease"}``.

* ``inc`` names the process (random, fresh at every start: its *incarnation*); ``seq`` grows by
  one with every renewal of that process; ``gen`` is the membership generation it is in.
* ``lease`` is the number of seconds the writer promises to stop its own work within, counted
  from the moment it *sent* its last renewal that the store acknowledged, less
  :data:`FENCE_MARGIN_S` (:class:`LeaseKeeper`).  It adapts to the measured round trip of the
  renewals (:data:`RTT_FACTOR` times the 90th percentile of the recent ones) within a floor and
  a ceiling.

Readers (the coordinator, and the peers of a run without a coordinator) keep a
:class:`LeaseTable`: it notes on the reader's *monotonic* clock when each node's ``seq`` last
advanced, and a lease has expired when that is longer ago than the node's lease.  No check ever
compares two hosts' clocks, so a host whose clock is minutes off is judged like any other.  A
value that does not advance (the same renewal read again, an old one written back by a process
that copied it) never refreshes a lease; a second incarnation writing the same node's key is
reported as a conflict (two processes claiming one identity).

Failure semantics: parsing never raises (a value that is not a renewal is None); a reader
never trusts a writer's clock or a lease outside its bounds; a writer whose lease ran out
reports it for good (:meth:`LeaseKeeper.remaining`), and its clock counts a suspended host's
sleep (:func:`boot_clock`).

Why the writer can stop in time: the reader's clock for a renewal starts when it *reads* it,
which is after the writer sent it; the writer counts from its send.  So a node that cannot renew
stops at least :data:`FENCE_MARGIN_S` before any reader can see its lease expire, and a
coordinator that waits a further margin before it publishes the next generation never has a
cut-off node training alongside its replacement.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import deque
from dataclasses import dataclass

from .membership import strip_tag

#: A renewal's lease is this many times the 90th percentile of the recent renewal round trips (at least the floor).
RTT_FACTOR = 8.0
#: Round trips remembered for the adaptive lease.
RTT_WINDOW = 32
#: The writer stops its work this long before its lease ends (seconds).
FENCE_MARGIN_S = 0.25


@dataclass(frozen=True)
class Renewal:
    inc: str
    seq: int
    gen: int
    state: str
    lease: float

    def encode(self) -> str:
        return json.dumps({"inc": self.inc, "seq": self.seq, "gen": self.gen, "state": self.state,
                           "lease": round(self.lease, 3)}, separators=(",", ":"))


def parse_renewal(raw: str) -> Renewal | None:
    """The renewal in a ``hb/<node>`` value (tag stripped), None when it is not one."""
    try:
        d = json.loads(strip_tag(raw))
        r = Renewal(str(d["inc"]), int(d["seq"]), int(d["gen"]), str(d["state"]), float(d["lease"]))
    except (ValueError, KeyError, TypeError):
        return None
    return r if r.lease > 0 and r.seq >= 0 else None


def clamp_lease(seconds: float, floor_s: float, ceiling_s: float) -> float:
    return min(max(seconds, floor_s), max(floor_s, ceiling_s))


class LeaseTable:
    """Reader side: when each node's renewals last advanced, on this process's monotonic clock.

    ``observe`` answers ``"advanced"`` (a newer renewal of the incarnation it knows, or the
    first one seen), ``"same"`` (nothing new), ``"stale"`` (an older ``seq``: a replay) or
    ``"conflict"`` (another incarnation writes the same node's key; the first one seen keeps
    the node's lease).  Leases are clamped to ``[floor_s, ceiling_s]`` whatever a node claims.

    Tampering postpones judgment: a replay (``"stale"``), or a :meth:`dispute` (the reader found
    the key of a node it had heard from deleted or overwritten with something that is not that
    node's renewal), restarts the node's lease clock without counting as a renewal.  A process
    without the secret can hide a node's renewals that way, and so stall the judgment of a node
    it targets; it cannot get a healthy node fenced.  A node that really died under such a
    write is found by other evidence (its exit report, its peers' reports).  :meth:`rearm`
    restarts every lease clock (a reader that was itself stopped has no evidence for the time
    it was away).
    """

    def __init__(self, floor_s: float, ceiling_s: float, clock=time.monotonic):
        self.floor_s, self.ceiling_s, self.clock = floor_s, ceiling_s, clock
        self.last: dict[int, Renewal] = {}
        self.since: dict[int, float] = {}       # node -> reader time its seq last advanced (or watched)
        self.disputed: dict[int, float] = {}    # node -> reader time its key was last seen tampered with

    def watch(self, node: int) -> None:
        """Start timing ``node`` now, before its first renewal is read (a node that never renews
        expires one floor after it was admitted)."""
        self.since.setdefault(node, self.clock())

    def observe(self, node: int, renewal: Renewal) -> str:
        prev = self.last.get(node)
        if prev is not None and renewal.inc != prev.inc:
            return "conflict"
        if prev is not None and renewal.seq == prev.seq:
            return "same"
        if prev is not None and renewal.seq < prev.seq:
            self.dispute(node)
            return "stale"
        self.last[node] = renewal
        self.since[node] = self.clock()
        return "advanced"

    def dispute(self, node: int) -> None:
        """``node``'s key was tampered with (see the class doc): judge it one lease from now at the earliest."""
        if node in self.last:
            self.disputed[node] = self.clock()

    def vouch(self, node: int) -> None:
        """Evidence other than a renewal, which a process without the secret cannot replay, that
        ``node`` was alive now (an iteration it took part in was committed): its lease clock
        restarts, without counting as a renewal."""
        if node in self.since:
            self.since[node] = max(self.since[node], self.clock())

    def rearm(self) -> None:
        """Restart every lease clock now (this reader was stopped: it saw nothing meanwhile)."""
        now = self.clock()
        for node in self.since:
            self.since[node] = now

    def lease_of(self, node: int) -> float:
        r = self.last.get(node)
        return clamp_lease(r.lease if r else self.floor_s, self.floor_s, self.ceiling_s)

    def age(self, node: int) -> float | None:
        """Seconds since ``node``'s renewals last advanced (None: never watched nor seen)."""
        t = self.since.get(node)
        return None if t is None else self.clock() - t

    def expired(self, node: int, margin_s: float = 0.0) -> bool:
        """Whether ``node``'s lease (plus ``margin_s``) has run out; a node whose last renewal
        says ``done`` never expires."""
        r = self.last.get(node)
        if r is not None and r.state == "done":
            return False
        age = self.age(node)
        if node in self.disputed:
            age = min(age, self.clock() - self.disputed[node]) if age is not None else None
        return age is not None and age > self.lease_of(node) + margin_s

    def forget(self, node: int) -> None:
        self.last.pop(node, None)
        self.since.pop(node, None)
        self.disputed.pop(node, None)


def boot_clock() -> float:
    """Seconds on a clock that keeps counting while the host is suspended (``CLOCK_BOOTTIME``
    where there is one, else the monotonic clock): a host that slept past its lease knows it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class LeaseKeeper:
    """Writer side: the next renewal, the round trips measured, and whether the lease still holds.

    Call :meth:`next` for the value to write, then :meth:`acknowledged` with the send time the
    value came with once the store took it.  :meth:`remaining` is how long this process may
    still work (negative: it must stop now).  A lease that ran out stays out: a renewal that
    gets through afterwards (a stopped process resumed, a link back) does not revive it, since
    the coordinator may have given the node's place away by then."""

    def __init__(self, floor_s: float, ceiling_s: float, clock=boot_clock):
        self.floor_s, self.ceiling_s, self.clock = floor_s, ceiling_s, clock
        self.inc = secrets.token_hex(6)
        self.seq = 0
        self.rtts: deque[float] = deque(maxlen=RTT_WINDOW)
        self.held: tuple[float, float] | None = None   # (send time, lease) of the last acknowledged renewal
        self.lapsed = False

    def lease_s(self) -> float:
        """:data:`RTT_FACTOR` times the 90th percentile of the recent round trips, within the
        bounds: a slow link lengthens the lease, one renewal held up by a blip does not."""
        if not self.rtts:
            return clamp_lease(0.0, self.floor_s, self.ceiling_s)
        ordered = sorted(self.rtts)
        slow = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return clamp_lease(RTT_FACTOR * slow, self.floor_s, self.ceiling_s)

    def next(self, gen: int, state: str) -> tuple[Renewal, float]:
        """The next renewal and its send time."""
        self.seq += 1
        return Renewal(self.inc, self.seq, gen, state, self.lease_s()), self.clock()

    def acknowledged(self, renewal: Renewal, sent: float) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            self.lapsed = True          # (checked before the renewal counts: it came too late)
        self.rtts.append(self.clock() - sent)
        if self.held is None or sent >= self.held[0]:
            self.held = (sent, renewal.lease)

    def remaining(self) -> float | None:
        """Seconds of work left under the lease (None before the first acknowledged renewal;
        negative for good once it ran out)."""
        if self.held is None:
            return None
        sent, lease = self.held
        left = sent + lease - FENCE_MARGIN_S - self.clock()
        return min(left, -1.0) if self.lapsed else left
