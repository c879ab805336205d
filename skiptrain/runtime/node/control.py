"""The control plane of a node: membership, process groups and the small collectives.

One :class:`ControlPlane` per node process.  It holds the generation in force, the alive node
ids (ranks are positions in that sorted list), the store clients, the heartbeat and the
coordinator's generation watch, and it is the only way the node's components talk to each
other: ``sync`` (a collective that gives up when a new generation is announced), the small
gathers and broadcasts, the common start of an iteration, ``regroup`` and the writes the
coordinator reads (acknowledgements, the schedule in force).

Failure semantics: every collective here raises :class:`~skiptrain.runtime.failure.NodeFailure`
as soon as the coordinator announces a newer generation (recovery mode), and otherwise waits at
most the job's ``timeout_s`` (gloo's own timeout).  Without recovery, a peer failure seen by the
heartbeat ends the process (:meth:`ControlPlane.peer_failed`); with recovery, only a lost store
does (the coordinator decides membership).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..failure import EXIT_FENCED, EXIT_PEER_FAILED, Heartbeat, NodeFailure, abort_process, write_error
from ..membership import key_from_env, open_value, read_raw, set_member
from ..shipping import RowPublisher

# every iteration starts at rank 0's clock plus a margin that lets the start time reach every
# node first: twice the slowest receipt of the last START_WINDOW iterations, within these bounds
START_MARGIN_S = (0.01, 0.2)
START_WINDOW = 10

STOP_KEY = "stop"     # set by the launcher (Ctrl-C / SIGTERM): end at the next iteration boundary


class ControlPlane:
    """Membership and the node's collectives (see the module's docstring)."""

    def __init__(self, job, rank: int, world: int, addr: str, port: int, store, describe):
        hosted = os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1" or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.job, self.rank, self.world = job, rank, world
        self.addr, self.port, self.rows = addr, port, None
        self.remote = bool(os.environ.get("SKIPTRAIN_WORK_DIR"))    # on another host than the coordinator
        self.err_path = Path(job.run_dir) / "errors" / f"node{rank}.json"
        self.timeout = timedelta(seconds=job.rt.timeout_s)
        store_timeout = timedelta(seconds=max(job.rt.timeout_s, 60.0))
        self.store = store or dist.TCPStore(addr, port, world, is_master=(rank == 0 and not hosted),
                                            timeout=store_timeout, wait_for_workers=False)
        # membership: node ids never change; ranks are positions in the sorted alive list
        self.gen = 0
        self.coord_key: bytes | None = None     # the coordinator's member key (a run with a secret)
        self.forged_stop = False
        self.stopped_for: str | None = None    # the signed stop request's value, once one was seen
        self.alive = list(range(world))
        self.rank_of = {n: n for n in self.alive}
        self.watch = None
        self.start_margin = START_MARGIN_S[1]
        self.start_delays: deque[float] = deque(maxlen=START_WINDOW)
        # a second client connection for the heartbeat and the membership watch: store calls of
        # one client are serialised, and a blocking get of the main thread (gloo rendezvous while
        # re-forming groups) must not stall the heartbeat
        self.hb_store = dist.TCPStore(addr, port, world, is_master=False, timeout=store_timeout,
                                      wait_for_workers=False)
        rt = job.rt
        on_peer_failed = self._store_lost if rt.recover else self.peer_failed
        self.hb = Heartbeat(self.hb_store, rank, world, rt.heartbeat_s, rt.timeout_s, on_peer_failed,
                            describe=describe, lease_floor_s=rt.heartbeat_deadline_s or rt.timeout_s,
                            lease_ceiling_s=rt.lease_max_s,
                            on_expired=self._lease_expired if rt.recover else None).start()

    # ---- membership ----------------------------------------------------------------------

    def peer_failed(self, node: int, reason: str) -> None:
        """The heartbeat found ``node`` failed (-1: the store): this node leaves its error report,
        naming it, and ends with :data:`~skiptrain.runtime.failure.EXIT_PEER_FAILED`."""
        write_error(self.err_path, self.rank, NodeFailure(f"node {self.rank}: {reason}", node), node)
        abort_process(EXIT_PEER_FAILED)

    def _store_lost(self, node: int, reason: str) -> None:
        """Recovery mode: the coordinator decides membership; only a lost store stops the node."""
        if node == -1:
            self.peer_failed(node, reason)

    def _lease_expired(self, why: str) -> None:
        """Self-fencing (the heartbeat's watchdog thread): this node's lease ran out, so the
        coordinator is about to give its place to another node; it stops at once, leaving its
        error report, with :data:`~skiptrain.runtime.failure.EXIT_FENCED` (its supervisor may
        bring it back as a new node)."""
        write_error(self.err_path, self.rank, NodeFailure(why, node=self.rank), self.rank)
        abort_process(EXIT_FENCED)

    def set_members(self, gen: int, alive: list[int]) -> None:
        """Generation ``gen`` with the nodes ``alive`` (ranks are positions in that list), for
        the heartbeat too."""
        self.hb.gen = gen
        self.gen, self.alive = gen, list(alive)
        self.rank_of = {n: i for i, n in enumerate(self.alive)}
        self.hb.membership.alive = set(self.alive)

    def form_groups(self) -> None:
        """The default process group of the generation in force (store prefix ``g<gen>/pg``, or
        ``pg`` for generation 0) and a separate gloo group for pipeline messages, so collectives
        never share tags with them."""
        self.store.set(f"g{self.gen}/here/{self.rank}", "1")     # (for those re-forming: :meth:`await_members`)
        prefix = f"g{self.gen}/pg" if self.gen else "pg"
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, self.store),
                                rank=self.rank_of[self.rank], world_size=len(self.alive), timeout=self.timeout)
        self.p2p_group = dist.new_group(list(range(len(self.alive))), timeout=self.timeout)

    def watch_generations(self, on_change) -> None:
        """Recovery mode: follow the coordinator's generations (``on_change(gen)`` on a new one)."""
        from ..recovery import GenerationWatch

        self.watch = GenerationWatch(self.hb_store, self.job.rt.heartbeat_s, on_change, self.coord_key)
        self.watch.gen = self.gen
        self.watch.start()

    def regroup(self, gen: int, alive: list[int]) -> None:
        """Destroy every process group and re-create them over ``alive`` on the store prefix
        ``g<gen>/``.  Threads blocked in the old groups are abandoned (never joined)."""
        from ..recovery import abandon_process_groups

        abandon_process_groups()   # not destroy_process_group(): its shutdown() can block (see there)
        self.set_members(gen, sorted(alive))
        if self.watch is not None:
            self.watch.gen = gen
            self.await_members()
        self.form_groups()

    def await_members(self) -> None:
        """Every member of the generation in force present before the groups' rendezvous (which
        would wait the whole ``timeout_s`` for a member that failed meanwhile); raises
        :class:`NodeFailure` as soon as a newer generation is announced, or after ``timeout_s``."""
        here = f"g{self.gen}/here"
        self.store.set(f"{here}/{self.rank}", "1")
        keys = [f"{here}/{n}" for n in self.alive]
        end = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(keys):
            if self.watch.newer() or time.monotonic() > end:
                raise NodeFailure(f"node {self.rank}: not every member of generation {self.gen} came to re-form "
                                  "the groups; abandoning it", node=None)
            time.sleep(0.005)

    def newer_generation(self) -> bool:
        return self.watch is not None and self.watch.newer()

    def check_generation(self) -> None:
        """Raise :class:`NodeFailure` when the coordinator has announced a new membership
        generation (recovery mode): a wait among the old members (a validation pass, a guard
        check, a freeze transition's state moves) would never end."""
        if self.newer_generation():
            raise NodeFailure(f"node {self.rank}: membership changed during a collective exchange; "
                              "abandoning the iteration", node=None)

    def is_root(self) -> bool:
        """Whether this node is rank 0 of the generation (it writes the run's metrics)."""
        return dist.get_rank() == 0

    # ---- collectives ---------------------------------------------------------------------

    def sync(self, fn, *args) -> None:
        """Run the collective ``fn(*args)``.  In recovery mode it runs asynchronously and the wait
        gives up as soon as the coordinator announces a new generation: a collective among live
        nodes can otherwise sit until the group timeout when a peer that already left it was the
        one it waited on (the abandoned work is never waited on again)."""
        if self.watch is None:
            fn(*args)
            return
        work = fn(*args, async_op=True)
        while not work.is_completed():
            if self.watch.newer():
                raise NodeFailure(f"node {self.rank}: membership changed during {fn.__name__}; "
                                  "abandoning the iteration", node=None)
            time.sleep(0.002)
        work.wait()

    def start_together(self, wait: bool = True) -> tuple[bool, float, float]:
        """An iteration's common start: every node's stop flag gathered at rank 0, which answers
        with one broadcast of (any stop, start time = its clock + the start margin, its clock).
        Unless a stop was agreed (or ``wait`` is False), this node then waits for the start time
        on its own clock: rank 0's clock is trusted only within the margin, so a host whose clock
        is off waits at most the margin after the start reached it (on one host this is exactly
        rank 0's start time).
        Returns (stop, the start time on this node's clock, how late the start reached it).
        A node whose lease ran out (its watchdog is about to end it) starts nothing."""
        if self.watch is not None and not self.hb.lease_holds():
            self._lease_expired(f"node {self.rank}: its lease ran out before an iteration's start")
        flags = self.gather_at_root(torch.tensor([1.0 if self.stop_requested() else 0.0], dtype=torch.float64))
        tt = torch.zeros(3, dtype=torch.float64)
        if flags is not None:
            stamp = time.time()
            tt[:] = torch.tensor([float(flags.max()), stamp + self.start_margin, stamp], dtype=torch.float64)
        self.sync(dist.broadcast, tt, 0)
        stop, t0, stamp = bool(tt[0] > 0), float(tt[1]), float(tt[2])
        if stop or not wait:
            return stop, t0, 0.0
        now = time.time()
        delay = min(max(now - stamp, 0.0), t0 - stamp)
        t0 = now + (t0 - stamp) - delay
        time.sleep(max(0.0, t0 - time.time()))
        return False, t0, delay

    def observe_start_delay(self, delay: float) -> None:
        """The slowest receipt of the last start time: the next margin is twice the slowest of
        the last ``START_WINDOW``, within ``START_MARGIN_S``."""
        self.start_delays.append(delay)
        self.start_margin = min(START_MARGIN_S[1], max(START_MARGIN_S[0], 2 * max(self.start_delays)))

    def all_gather_small(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every live node's ``t`` (the same shape and dtype everywhere, a few dozen numbers), in
        rank order: gathered at rank 0, then one broadcast of the table.  Two steps where gloo's
        ring all-gather takes one per node: for 16 processes on 2 cores, 8 ms against 43."""
        table = self.gather_at_root(t)
        if table is None:
            table = torch.empty((len(self.alive), *t.shape), dtype=t.dtype)
        self.sync(dist.broadcast, table, 0)
        return list(table.unbind(0))

    def gather_at_root(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every live node's ``t`` stacked in rank order at rank 0 (None on the others)."""
        root = dist.get_rank() == 0
        table = torch.empty((len(self.alive), *t.shape), dtype=t.dtype) if root else None
        self.sync(dist.gather, t, list(table.unbind(0)) if root else None, 0)
        return table

    def gather_bytes(self, b: bytes, size: int | None = None) -> list[tuple[int, bytes]]:
        """All-gather one byte string from every live node: [(node, bytes)].  With ``size`` every
        node sends exactly that many bytes (one collective instead of two)."""
        if size is None:
            lens = self.all_gather_small(torch.tensor([len(b)], dtype=torch.int64))
        else:
            lens = [torch.tensor([size])] * len(self.alive)
        m = max(1, max(int(x) for x in lens))
        buf = torch.zeros(m, dtype=torch.uint8)
        if b:
            buf[:len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        outs = [torch.empty(m, dtype=torch.uint8) for _ in self.alive]
        self.sync(dist.all_gather, outs, buf)
        return [(node, bytes(o[:int(k)].numpy())) for node, o, k in zip(self.alive, outs, lens)]

    def sum_across(self, x: float) -> float:
        """Sum one float over every node of the generation (the global clip's squared norm)."""
        t = torch.tensor([x], dtype=torch.float64)
        self.sync(dist.all_reduce, t)
        return float(t[0])

    def broadcast_json(self, obj):
        """Rank 0's JSON-able ``obj`` (or None) to every node of the group; returns it everywhere
        (what the other ranks pass is ignored)."""
        hdr = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if dist.get_rank() == 0 and obj is not None:
            payload = json.dumps(obj).encode()
            hdr[0], hdr[1] = 1, len(payload)
        self.sync(dist.broadcast, hdr, 0)
        if not hdr[0]:
            return None
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(int(hdr[1]), dtype=torch.uint8)
        self.sync(dist.broadcast, buf, 0)
        return json.loads(bytes(buf.tolist()).decode())

    def broadcast_schedule(self, adopted):
        """Rank 0's ``adopted = (schedule, record)`` (or None) to every node of the group; returns
        (schedule or None, record or None) everywhere."""
        from ...schedule.schedule import Schedule

        d = self.broadcast_json({"schedule": adopted[0].to_dict(), "last": adopted[1]} if adopted else None)
        return (Schedule.from_dict(d["schedule"]), d["last"]) if d else (None, None)

    # ---- what the coordinator reads and writes -------------------------------------------

    def ack(self) -> None:
        """Tell the coordinator this node runs in its current generation (joins wait for it)."""
        if self.job.rt.recover:
            self.store.set(f"ack/{self.gen}/{self.rank}", repr(time.time()))

    def stop_requested(self) -> bool:
        """Whether the launcher asked to stop: ``stop`` in the store, signed by the coordinator in a
        run with a secret (a request anyone else wrote is printed once and ignored)."""
        return self.stop_reason() is not None

    def stop_reason(self) -> str | None:
        """The signed stop request's value (``1``: the launcher's; the store's when the run had no
        coordinator for too long: :data:`~skiptrain.runtime.store.NO_COORDINATOR`), else None."""
        raw = read_raw(self.hb_store, STOP_KEY)
        if raw is None:
            return None
        value = open_value(self.coord_key, STOP_KEY, raw)
        if value is not None:
            self.stopped_for = value     # (read at the stop's agreement: the store may be gone by the exit)
            return value
        if not self.forged_stop:
            self.forged_stop = True
            print(f"skiptrain node {self.rank}: ignored a stop request not signed by the run's coordinator "
                  "(written by a process without the run's secret)", file=sys.stderr, flush=True)
        return None

    def publish_row(self, line: str, file: str = "metrics.jsonl") -> None:
        """A node on another host than its coordinator (``SKIPTRAIN_WORK_DIR``: its own run
        directory) also sends each metrics row it writes, from a thread of its own on a store
        connection of its own, so the coordinator's run directory follows the run as it goes
        (:class:`~skiptrain.runtime.shipping.RowMirror`) and training never waits on it."""
        if self.remote:
            self.row_publisher().put(line, file)

    def row_publisher(self) -> RowPublisher:
        if self.rows is None:
            self.rows = RowPublisher(self.addr, self.port, key_from_env(self.rank), self.rank)
        return self.rows

    def publish_sched(self, sched, phase_idx: int, cost=None) -> None:
        """The lowest node of the generation tells the coordinator the schedule in force and,
        when given, the cost model of its layout (it places joining nodes on them)."""
        if self.job.rt.recover and self.rank == min(self.alive):
            cur = {"gen": self.gen, "phase": phase_idx, "schedule": sched.to_dict()}
            if cost is not None:
                cur["cost"] = cost.to_dict()
            set_member(self.store, self.rank, "sched/cur", json.dumps(cur))   # signed: the coordinator checks

    def finish(self) -> None:
        dist.barrier()
        self.hb.finish()
