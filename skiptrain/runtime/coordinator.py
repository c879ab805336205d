"""The coordinator of a recovering run (``job.rt.recover``): membership authority, no model state.

:func:`coordinate` replaces the launcher's fail-fast monitor.  It watches the node processes it
started (exit status), every node's lease (``hb/<r>``: :mod:`.lease`, timed on this process's
clock; floor ``job.rt.heartbeat_deadline_s`` or ``job.rt.timeout_s``, ceiling
``job.rt.lease_max_s``), the exit reports of other hosts' supervisors (``exit/<r>``) and the nodes' failure reports (``report/<gen>/<r>``; a report of a rejected
payload names a *bad peer*).  On a detection it

0. (at the start) admits the nodes by challenge-response (:mod:`skiptrain.runtime.join`):
   only admitted nodes are in generation 0, and groups are formed over that set;
1. logs the node, the cause and the time it took (from the injected fault's time when known,
   else from the last heartbeat), to stderr and ``RUN_DIR/recoveries.jsonl``;
2. fences the node: leaves it out of the next generation; a node process this coordinator's
   launcher started is also SIGKILLed if it still runs (its gloo connections reset, so survivors
   blocked on it fail at once); any other node has stopped its own work when its lease ran out
   (:mod:`.fencing`);
3. publishes the next generation (:func:`~skiptrain.runtime.recovery.publish_generation`);
   the survivors re-form and re-plan themselves (see :mod:`skiptrain.runtime.recovery`).

Why not torchft's lighthouse: it provides quorum for *data-parallel replica groups* that each
hold a full model; here a node holds one stage of a pipeline whose routes cross all nodes, so
every membership change needs a global re-plan, not a per-replica-group quorum.  The
coordinator's state (alive set, generation) is tiny and lives in the store; it holds no weights.
The store is a process of its own (:mod:`.store`) that dies with the launcher by default;
with ``job.rt.restartable``, or across hosts (``skiptrain coordinator``), it outlives it, the
nodes train on, and a new coordinator takes the live run over
(:func:`~skiptrain.runtime.launcher.adopt`: ``python -m skiptrain.runtime.coordinator_restart
--run RUN_DIR`` on one host, ``skiptrain coordinator --resume`` across hosts): every piece of its
state is in the store (generation records, strikes, joins under way, the positions of the logs
it reads).  It raises a signed counter every heartbeat (:class:`SignOfLife`), by which the
store tells that no coordinator came back (``runtime.coordinator_wait_s``).

Joining (:class:`~skiptrain.runtime.joiners.Joiners`): nodes started with ``--join HOST:PORT``
are challenged, placed on the stage where they shorten the iteration most and announced in a
*join* generation that the nodes take up at their next iteration boundary.  Which node processes
still run, and fencing them: :mod:`skiptrain.runtime.fencing`.

Failure semantics: returns ``None`` when every surviving node exited 0, else a failure dict for
the launcher's error (no stage-0 node left, every node gone, or the run's time limit).
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from pathlib import Path

from ..schedule.schedule import Schedule
from .event_log import LOG_NAME, log_event
from .failure import RuntimeFailure, describe_exit
from .fencing import Members, RowEvidence
from .job import Job
from .joiners import Joiners, schedule_in_force
from .lease import LeaseTable
from .membership import COORDINATOR, MAX_NODE_IDS, Verifier, raise_count, sign
from .recovery import publish_generation
from .store import ALIVE_KEY
from .swarm_view import SwarmSnapshot, host_of_hello


#: Seconds a node refused at admission has to exit by itself before it is killed.
REFUSED_GRACE_S = 2.0


def _read_reports(store, verifier: Verifier, gen: int, alive: set[int], strikes: dict[int, int],
                  strikes_needed: int, found: dict, struck: dict) -> None:
    """Count a strike against every bad peer named in a signed report of generation ``gen``
    (each node's own ``report/<gen>/<r>``); at ``strikes_needed`` the peer goes to ``found`` (banned),
    below it to ``struck``.  Unsigned or forged reports are ignored (and logged by ``verifier``)."""
    for r in sorted(alive):
        raw = verifier.read(store, r, f"report/{gen}/{r}")
        try:
            rep = json.loads(raw) if raw is not None else None
        except ValueError:
            continue
        if not isinstance(rep, dict):
            continue
        bad = rep.get("node")
        if not (rep.get("bad_peer") and isinstance(bad, int) and bad in alive and bad not in found
                and bad not in struck):
            continue
        said = (str(rep.get("cause") or "?").splitlines() or ["?"])[0][:200]
        cause = f"bad peer: {said} (reported by node {r})"
        strikes[bad] = strikes.get(bad, 0) + 1
        store.set("coord/strikes", sign(verifier.key(COORDINATOR), "coord/strikes", json.dumps(strikes)))
        t = float(rep.get("t", time.time()))
        if strikes[bad] >= strikes_needed:
            found[bad] = (cause + f"; strike {strikes[bad]} of {strikes_needed}: banned", t)
        else:
            struck[bad] = (cause + f"; strike {strikes[bad]} of {strikes_needed}", t)


def coordinate(job: Job, procs, store, world: int, t_start: float, timeout_s: float,
               run_dir: Path, join_secret: str, resume: bool = False) -> dict | None:
    from .join import admit

    deadline = job.rt.heartbeat_deadline_s or job.rt.timeout_s
    strikes_needed = max(1, int(job.rt.strikes or 1))
    stage0 = set()
    for ph in job.phases:
        stage0 |= set(Schedule.from_dict(ph.schedule).placement[0])
    log_path = Path(run_dir) / LOG_NAME
    fenced: set[int] = set()
    members = Members(procs, store, Verifier(join_secret, Path(run_dir) / "rejected_writes.jsonl"),
                      LeaseTable(deadline, max(deadline, job.rt.lease_max_s)))
    if resume:
        from .recovery import latest_generation
        if latest_generation(store, members.verifier.key(COORDINATOR)) < 0:
            raise RuntimeFailure(
                f"the job in {run_dir} has no generation 0 yet: its coordinator died during admission, "
                "before any node entered a group, so there is nothing to resume; stop the job and launch it again")
        return _loop(job, store, members, stage0, deadline, strikes_needed, log_path, fenced, world, t_start,
                     timeout_s, join_secret, resume=True)
    # admission: only nodes that answer the join challenge enter generation 0 (and any group)
    t_adm = time.time()
    adm = admit(store, list(range(world)), join_secret, max(60.0, job.rt.timeout_s),
                alive=lambda n: members.code(n) is None)
    alive = {n for n, v in adm.items() if v == "ok"}
    for n, v in sorted(adm.items()):
        if v == "ok":
            continue
        members.wait({n}, REFUSED_GRACE_S)   # it reads its refusal, says why in its log and exits
        if members.is_child(n) and members.code(n) is None:
            fenced.add(n)
            members.kill(n)
        print(f"[coordinator] node {n}: {v}; not admitted", file=sys.stderr, flush=True)
        log_event(log_path, {"gen": 0, "node": n, "cause": v, "refused": True, "t_detect": time.time(),
                             "detect_s": time.time() - t_adm, "fenced": n in fenced, "alive": sorted(alive)})
    if not (alive & stage0):
        return {"kind": "exit", "node": min(set(range(world)) - alive), "t": time.time(),
                "code": members.code(min(set(range(world)) - alive))}
    for n in alive:
        members.leases.watch(n)
    raise_count(store, "nodes/next", world, MAX_NODE_IDS)   # a node that comes later joins the running job:
                                                            # (an id from the job's world on, never one refused here)
    publish_generation(store, 0, sorted(alive), {n: v for n, v in adm.items() if v != "ok"},
                       key=members.verifier.key(COORDINATOR))
    return _loop(job, store, members, stage0, deadline, strikes_needed, log_path, fenced, world, t_start,
                 timeout_s, join_secret, alive=alive)


def _loop(job, store, members, stage0, deadline, strikes_needed, log_path, fenced, world, t_start, timeout_s,
          join_secret, alive: set[int] | None = None, resume: bool = False) -> dict | None:
    """The coordinator's watch loop.  ``resume``: a restarted coordinator; everything it needs
    is read back from the store (generation, alive set, node PIDs, strikes, joins under way)."""
    watch = _Watch(job, store, members, stage0, deadline, strikes_needed, log_path, fenced, t_start, timeout_s,
                   Joiners(job, store, members, join_secret, log_path, world), alive)
    if resume:
        watch.restore()
    return watch.run()


class SignOfLife:
    """A coordinator's sign of life for the run's store: its signed counter
    (:data:`~skiptrain.runtime.store.ALIVE_KEY`) raised at once and then every ``interval_s``, from
    a thread of its own, for as long as its ``with`` block runs (the whole of a coordinator's work:
    watching, the relays' last poll, collecting the outputs), so that the store tells a
    coordinator that is gone (``runtime.coordinator_wait_s``) from one that is busy.  A failed
    write is retried at the next beat."""

    def __init__(self, store, key: bytes | None, interval_s: float):
        self.store, self.key, self.interval_s = store, key, interval_s
        self.incarnation, self.beats = secrets.token_hex(4), 0
        self.done = threading.Event()

    def beat(self) -> None:
        self.beats += 1
        try:
            self.store.set(ALIVE_KEY, sign(self.key, ALIVE_KEY, f"{self.incarnation}:{self.beats}"))
        except Exception:  # noqa: BLE001 - the store is away: the watch loop says so
            pass

    def __enter__(self) -> "SignOfLife":
        self.beat()
        threading.Thread(target=self._loop, name="coordinator-alive", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def _loop(self) -> None:
        while not self.done.wait(self.interval_s):
            self.beat()


class _Watch:
    """The watch loop's state (the generation in force, the alive set, the strikes, the joins
    under way) and its passes: detect, fence, log and publish the next generation."""

    def __init__(self, job, store, members: Members, stage0: set[int], deadline: float, strikes_needed: int,
                 log_path: Path, fenced: set[int], t_start: float, timeout_s: float, joins: Joiners,
                 alive: set[int] | None):
        self.job, self.store, self.members, self.stage0 = job, store, members, stage0
        self.deadline, self.strikes_needed, self.log_path, self.fenced = deadline, strikes_needed, log_path, fenced
        self.t_start, self.timeout_s, self.joins, self.alive = t_start, timeout_s, joins, alive
        self.gen = 0
        self.key = members.verifier.key(COORDINATOR)     # signs the generations the nodes act on
        self.strikes: dict[int, int] = {}
        self.view = SwarmSnapshot(log_path.parent, "recover", job.rt.heartbeat_s)   # swarm.json
        self.rows = RowEvidence(log_path.parent / "metrics.jsonl")      # progress vouches for the nodes
        self.view.placement = Schedule.from_dict(job.phases[0].schedule).placement

    def restore(self) -> None:
        """A restarted coordinator: read its state back from the store."""
        from .recovery import latest_generation, read_generation

        store, members = self.store, self.members
        self.gen = gen = latest_generation(store, self.key)
        self.alive = alive = set(read_generation(store, gen, self.key)["alive"])
        store.set("gen", str(gen))       # (its predecessor may have died between a record and the counter)
        for r in sorted(alive):
            members.leases.watch(r)
        saved = members.verifier.read(store, COORDINATOR, "coord/strikes")
        if saved is not None:
            self.strikes = {int(k): v for k, v in json.loads(saved).items()}
        self.joins.resume(gen, alive)
        print(f"[coordinator] restarted: generation {gen}, alive {sorted(alive)}", file=sys.stderr, flush=True)
        log_event(self.log_path, {"gen": gen, "node": None, "cause": "coordinator restarted", "restart": True,
                                  "t_detect": time.time(), "alive": sorted(alive)})

    def run(self) -> dict | None:
        """Watch until the run ends: None when every surviving node exited 0, else the failure."""
        next_hb = time.time() + self.job.rt.heartbeat_s
        tick = time.monotonic()
        while True:
            tick = self._rearm_after_own_stall(tick)
            codes = {r: self.members.code(r) for r in self.alive}
            if self._finished(codes):
                self.snapshot(done=True)
                return None
            if self.view.due():
                self.snapshot()
            now = time.time()
            if now - self.t_start > self.timeout_s:
                return {"kind": "timeout", "t": now}
            found: dict[int, tuple[str, float | None]] = {}     # node -> (cause, reference time)
            struck: dict[int, tuple[str, float | None]] = {}    # bad peers below the strike limit
            for r in sorted(self.alive):
                if codes[r] not in (None, 0):
                    found[r] = (f"died ({describe_exit(codes[r])})", None)
            if now >= next_hb:
                next_hb = now + self.job.rt.heartbeat_s
                self._check_heartbeats(codes, now, found)
                _read_reports(self.store, self.members.verifier, self.gen, self.alive, self.strikes,
                              self.strikes_needed, found, struck)
            if not found and not struck:
                if self.joins.step(self.gen, self.alive):
                    self.gen += 1
                    self.alive.add(self.joins.last_added)
                    self.snapshot()
                time.sleep(0.02)
                continue
            failure = self._act(found, struck, codes)
            self.snapshot(done=failure is not None)
            if failure is not None:
                return failure

    def _rearm_after_own_stall(self, last: float) -> float:
        """When this process itself did not run for a while (stopped, starved, its host
        suspended), it has no evidence about that time: every lease clock restarts instead of
        every node being judged silent.  Returns the time of this check."""
        now = time.monotonic()
        gap = now - last
        if gap > max(1.0, 4 * self.job.rt.heartbeat_s):
            self.members.leases.rearm()
            print(f"[coordinator] this process did not run for {gap:.1f} s (stopped or starved): every "
                  "node's lease starts again now, nobody is judged on that gap", file=sys.stderr, flush=True)
        return now

    def snapshot(self, done: bool = False) -> None:
        """Rewrite ``swarm.json`` (:mod:`.swarm_view`): every node this run has known, its status,
        lease, host and stages in the schedule in force."""
        view, members = self.view, self.members
        cur = schedule_in_force(members, self.store, self.gen, self.alive, quiet=True)
        if cur is not None:
            view.placement = cur["schedule"]["placement"]
        nodes = []
        proven = {r for r, st in self.joins.pending.items() if st["state"] != "challenged"}   # (not a forger)
        for r in sorted(set(range(self.joins.world)) | self.alive | proven | set(view.stages)):
            if r not in view.hosts and (r in self.alive or r in proven):
                host = host_of_hello(members.verifier.read(self.store, r, f"join/hello/{r}"))
                if host:
                    view.hosts[r] = host
            if r in self.joins.pending:
                status = "joining"
            elif r in self.alive:
                status = "done" if members.code(r) == 0 else "alive"
            else:
                status = "fenced"
            nodes.append(view.node(r, status, members.leases))
        view.write(self.gen, nodes, done)

    def _finished(self, codes: dict[int, int | None]) -> bool:
        """Whether every node exited 0.  Once every node but the placed joiners did, the run is
        over: the joins no node took up are cancelled (and their joiners waited for briefly)."""
        if not all(codes[r] == 0 for r in self.alive - self.joins.placed()):
            return False
        cancelled = self.joins.end_of_run()     # the run is over: joins no node took up are cancelled
        self.members.wait(cancelled, 5.0)       # (they read why before the store stops)
        self.alive -= cancelled
        return all(codes[r] == 0 for r in self.alive)

    def _check_heartbeats(self, codes: dict[int, int | None], now: float, found: dict) -> None:
        """Add to ``found`` every running node whose lease ran out (on this process's clock, plus
        a margin: it has stopped its own work by then), or whose identity a second process claims."""
        running = {r for r in self.alive - set(found) if codes[r] is None}
        if self.rows.new_iteration(self.gen):
            for r in running:
                self.members.leases.vouch(r)
        for r, seen in self.members.renew(running).items():
            if seen == "conflict":
                found[r] = ("two processes claim this node's identity (each with the run's secret): "
                            "start every host's node once, with its own --work-dir", None)
        for r in sorted(running - set(found)):
            why = self.members.lease_lost(r, self.job.rt.heartbeat_s)
            if why is not None:
                found[r] = (why, now - self.members.leases.age(r))

    def _act(self, found: dict, struck: dict, codes: dict[int, int | None]) -> dict | None:
        """Fence the ``found`` nodes, log every detection and publish the next generation; the
        failure of the run when no stage-0 node (or no node) is left, else None."""
        t_detect = time.time()
        cancelled = self.joins.cancel(self.alive)                    # a join not yet taken up by every node
        found.update(cancelled)
        for n in found:
            if self.members.code(n) is None:
                self.fenced.add(n)
                self.members.kill(n)
        self.alive -= set(found)
        self.gen += 1
        rows = [self._detection(n, cause, ref, t_detect, struck)
                for n, (cause, ref) in sorted({**found, **struck}.items())]
        for row in rows:
            log_event(self.log_path, row)
        if not self.alive or not (self.alive & self.stage0):
            n0 = min(found) if found else min(struck)
            return {"kind": "exit", "node": n0, "code": codes.get(n0), "t": t_detect,
                    "msg": "no stage-0 node left" if self.alive else "no node left"}
        publish_generation(self.store, self.gen, sorted(self.alive), {n: c for n, (c, _) in found.items()},
                           {"cancelled": sorted(cancelled)}, key=self.key)
        return None

    def _detection(self, n: int, cause: str, ref: float | None, t_detect: float, struck: dict) -> dict:
        """The log row of node ``n``'s detection (said on stderr too), timed from its injected
        fault when known, else from ``ref``."""
        fault_t = None
        try:
            if self.store.check([f"fault/{n}"]):
                fault_t = float(self.store.get(f"fault/{n}").decode())
        except Exception:  # noqa: BLE001
            pass
        since = fault_t if fault_t is not None else ref
        row = {"gen": self.gen, "node": n, "cause": cause, "t_detect": t_detect, "fault_t": fault_t,
               "detect_s": (t_detect - since) if since is not None else None, "fenced": n in self.fenced,
               "alive": sorted(self.alive)}
        if n in struck:
            row["strike"] = self.strikes[n]
        took = f"{row['detect_s']:.3f} s after the fault" if row["detect_s"] is not None else "time unknown"
        print(f"[coordinator] node {n}: {cause}; detected {took}; generation {self.gen}: "
              f"{len(self.alive)} node(s) left", file=sys.stderr, flush=True)
        return row
