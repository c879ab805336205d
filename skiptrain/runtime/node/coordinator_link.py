"""A node's link to its coordinator: the store connections, the heartbeat and its lease, the
coordinator's generation watch, its stop requests, and what the node tells it (acknowledgements,
the schedule in force, metrics rows).

One :class:`CoordinatorLink` per node process, held by its
:class:`~skiptrain.runtime.node.control.ControlPlane`, which keeps it told of the generation in
force (:meth:`CoordinatorLink.follow`).

Failure semantics: without recovery, a peer failure seen by the heartbeat ends the process
(:meth:`CoordinatorLink.peer_failed`, exit :data:`~skiptrain.runtime.failure.EXIT_PEER_FAILED`);
with recovery only a lost store does (the coordinator decides membership), and a lease that ran
out ends it at once (:meth:`CoordinatorLink.lease_expired`, exit
:data:`~skiptrain.runtime.failure.EXIT_FENCED`).  Each leaves ``errors/node<r>.json``.  A stop
request not signed by the coordinator is said once and ignored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..failure import (EXIT_FENCED, EXIT_PEER_FAILED, NO_COORDINATOR, Heartbeat, NodeFailure, abort_process,
                       write_error)
from ..membership import key_from_env, open_value, read_raw, set_member
from ..shipping import RowPublisher

STOP_KEY = "stop"     # set by the launcher (Ctrl-C / SIGTERM): end at the next iteration boundary


class CoordinatorLink:
    """The node's store clients, heartbeat and reports (see the module's docstring)."""

    def __init__(self, job, rank: int, world: int, addr: str, port: int, store, describe):
        hosted = os.environ.get("SKIPTRAIN_STORE_HOSTED") == "1" or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.job, self.rank = job, rank
        self.addr, self.port, self.rows = addr, port, None
        self.remote = bool(os.environ.get("SKIPTRAIN_WORK_DIR"))    # on another host than the coordinator
        self.err_path = Path(job.run_dir) / "errors" / f"node{rank}.json"
        store_timeout = timedelta(seconds=max(job.rt.timeout_s, 60.0))
        self.store = store or dist.TCPStore(addr, port, world, is_master=(rank == 0 and not hosted),
                                            timeout=store_timeout, wait_for_workers=False)
        self.gen, self.alive = 0, list(range(world))
        self.coord_key: bytes | None = None     # the coordinator's member key (a run with a secret)
        self.forged_stop = False
        self.stopped_for: str | None = None    # the signed stop request's value, once one was seen
        self.watch = None
        # a second client connection for the heartbeat and the membership watch: store calls of
        # one client are serialised, and a blocking get of the main thread (gloo rendezvous while
        # re-forming groups) must not stall the heartbeat
        self.hb_store = dist.TCPStore(addr, port, world, is_master=False, timeout=store_timeout,
                                      wait_for_workers=False)
        rt = job.rt
        self.hb = Heartbeat(self.hb_store, rank, world, rt.heartbeat_s, rt.timeout_s,
                            self._store_lost if rt.recover else self.peer_failed,
                            describe=describe, lease_floor_s=rt.heartbeat_deadline_s or rt.timeout_s,
                            lease_ceiling_s=rt.lease_max_s,
                            on_expired=self.lease_expired if rt.recover else None).start()

    def peer_failed(self, node: int, reason: str) -> None:
        """The heartbeat found ``node`` failed (-1: the store): this node leaves its error report,
        naming it, and ends with :data:`~skiptrain.runtime.failure.EXIT_PEER_FAILED`."""
        write_error(self.err_path, self.rank, NodeFailure(f"node {self.rank}: {reason}", node), node)
        abort_process(EXIT_PEER_FAILED)

    def _store_lost(self, node: int, reason: str) -> None:
        """Recovery mode: the coordinator decides membership; only a lost store stops the node."""
        if node == -1:
            self.peer_failed(node, reason)

    def lease_expired(self, why: str) -> None:
        """Self-fencing (the heartbeat's watchdog thread, or an iteration's start): this node's
        lease ran out, so the coordinator is about to give its place to another node; it stops at
        once, leaving its error report, with :data:`~skiptrain.runtime.failure.EXIT_FENCED` (its
        supervisor may bring it back as a new node)."""
        write_error(self.err_path, self.rank, NodeFailure(why, node=self.rank), self.rank)
        abort_process(EXIT_FENCED)

    def follow(self, gen: int, alive: list[int]) -> None:
        """The generation in force and its members, for the heartbeat and the watch."""
        self.gen, self.alive = gen, list(alive)
        self.hb.gen = gen
        self.hb.membership.alive = set(alive)
        if self.watch is not None:
            self.watch.gen = gen

    def watch_generations(self, on_change) -> None:
        """Recovery mode: follow the coordinator's generations (``on_change(gen)`` on a new one)."""
        from ..recovery import GenerationWatch

        self.watch = GenerationWatch(self.hb_store, self.job.rt.heartbeat_s, on_change, self.coord_key)
        self.watch.gen = self.gen
        self.watch.start()

    def newer_generation(self) -> bool:
        return self.watch is not None and self.watch.newer()

    def ack(self) -> None:
        """Tell the coordinator this node runs in its current generation (joins wait for it)."""
        if self.job.rt.recover:
            self.store.set(f"ack/{self.gen}/{self.rank}", repr(time.time()))

    def stop_code(self) -> float:
        """This node's stop flag for the iteration start's agreement (the strongest wins): 0 none,
        1 the launcher's stop, 2 the store's for want of a coordinator; only a request signed by the
        coordinator counts (anyone else's is printed once and ignored, :meth:`stop_reason`)."""
        reason = self.stop_reason()
        return 0.0 if reason is None else 2.0 if reason == NO_COORDINATOR else 1.0

    def agree_stop(self, code: float) -> None:
        """The stop every node agreed on (the largest :meth:`stop_code`): its reason is this node's
        too (it decides the exit status), whether or not this node read the request itself."""
        self.stopped_for = NO_COORDINATOR if code >= 2 else self.stopped_for or "1"

    def stop_reason(self) -> str | None:
        """The signed stop request's value (``1``: the launcher's; the store's when the run had no
        coordinator for too long: :data:`~skiptrain.runtime.failure.NO_COORDINATOR`), else None."""
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
