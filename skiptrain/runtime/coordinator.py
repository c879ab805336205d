"""The coordinator of a recovering run (``job.rt.recover``): membership authority, no model state.

:func:`coordinate` replaces the launcher's fail-fast monitor.  It watches the node processes it
started (exit status), their heartbeats (``hb/<r>``, deadline ``job.rt.heartbeat_deadline_s`` or
``job.rt.timeout_s``) and the nodes' failure reports (``report/<gen>/<r>``; a report of a rejected
payload names a *bad peer*).  On a detection it

0. (at the start) admits the nodes by challenge-response (:mod:`skiptrain.runtime.join`):
   only admitted nodes are in generation 0, and groups are formed over that set;
1. logs the node, the cause and the time it took (from the injected fault's time when known,
   else from the last heartbeat), to stderr and ``RUN_DIR/recoveries.jsonl``;
2. fences the node: SIGKILL by PID if it still runs (a hung or bad node never comes back, and
   every gloo connection to it resets so survivors blocked on it fail at once);
3. publishes the next generation (:func:`~skiptrain.runtime.recovery.publish_generation`);
   the survivors re-form and re-plan themselves (see :mod:`skiptrain.runtime.recovery`).

Why not torchft's lighthouse: it provides quorum for *data-parallel replica groups* that each
hold a full model; here a node holds one stage of a pipeline whose routes cross all nodes, so
every membership change needs a global re-plan, not a per-replica-group quorum.  The
coordinator's state (alive set, generation) is tiny and lives in the store; it holds no weights.
By default the store lives in the launcher process (and nodes die with it); with
``job.rt.restartable`` it runs in a process of its own (:mod:`.store`), nodes are not tied to the
launcher, and ``python -m skiptrain.runtime.coordinator --run RUN_DIR`` (:func:`main`) replaces a
coordinator that died: every piece of its state is in the store (generation records, node PIDs,
strikes, joins under way).

Joining (:class:`_Joins`): nodes started with ``--join HOST:PORT`` are challenged, placed on the
stage where they shorten the iteration most and announced in a *join* generation that the nodes
take up at their next iteration boundary.

Failure semantics: returns ``None`` when every surviving node exited 0, else a failure dict for
the launcher's error (no stage-0 node left, every node gone, or the run's time limit).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from ..schedule.schedule import Schedule
from .failure import RuntimeFailure, describe_exit, pid_running
from .job import Job
from .membership import COORDINATOR, Verifier, sign
from .recovery import publish_generation


#: Seconds a node refused at admission has to exit by itself before it is killed.
REFUSED_GRACE_S = 2.0


class _Members:
    """Exit status of the launched children and of joined (external) node processes."""

    def __init__(self, procs, store, verifier: Verifier):
        self.procs, self.store, self.verifier = procs, store, verifier
        self.ext: dict[int, int] = {}            # joined node -> pid (0: unverified, never signalled)

    def code(self, r: int) -> int | None:
        if r < len(self.procs):
            return self.procs[r].poll()
        pid = self.ext.get(r)
        if pid and pid_running(pid):
            return None
        hb = self.verifier.read(self.store, r, f"hb/{r}")
        if hb is not None and hb.endswith(":done"):
            return 0
        # no verified PID: running until its signed heartbeat says done (or goes stale: hung)
        return None if not pid else -signal.SIGKILL

    def wait(self, nodes: set[int], timeout_s: float) -> None:
        """Wait until every one of ``nodes`` exited, at most ``timeout_s``."""
        end = time.time() + timeout_s
        while time.time() < end and any(self.code(r) is None for r in nodes):
            time.sleep(0.01)

    def kill(self, r: int) -> None:
        """SIGKILL node ``r``: only a child this coordinator started, or a process whose PID came
        signed with the node's member key (a joiner's hello, a node's ``pid/<r>``)."""
        pid = self.procs[r].pid if r < len(self.procs) else self.ext.get(r)
        if pid is None or pid <= 1 or pid == os.getpid():
            return
        if r < len(self.procs):
            self.procs[r].kill()
            try:
                self.procs[r].wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        end = time.time() + 5
        while pid_running(pid) and time.time() < end:
            time.sleep(0.01)


def verified_pid(verifier: Verifier, store, node: int) -> int:
    """The PID node ``node`` wrote (signed) to ``pid/<node>``; 0 (never signalled) when absent,
    forged or implausible."""
    raw = verifier.read(store, node, f"pid/{node}")
    try:
        pid = int(raw) if raw is not None else 0
    except ValueError:
        pid = 0
    if pid <= 1 or pid == os.getpid() or pid > 2 ** 22:
        print(f"[coordinator] node {node}: no verified PID; it will not be signalled", file=sys.stderr, flush=True)
        return 0
    return pid


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


def _log(log_path: Path, row: dict) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps(row) + "\n")


def coordinate(job: Job, procs, store, world: int, t_start: float, timeout_s: float,
               run_dir: Path, join_secret: str, resume: bool = False) -> dict | None:
    from .join import admit

    deadline = job.rt.heartbeat_deadline_s or job.rt.timeout_s
    strikes_needed = max(1, int(job.rt.strikes or 1))
    stage0 = set()
    for ph in job.phases:
        stage0 |= set(Schedule.from_dict(ph.schedule).placement[0])
    log_path = Path(run_dir) / "recoveries.jsonl"
    fenced: set[int] = set()
    members = _Members(procs, store, Verifier(join_secret, Path(run_dir) / "rejected_writes.jsonl"))
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
                alive=lambda n: procs[n].poll() is None)
    alive = {n for n, v in adm.items() if v == "ok"}
    for n, v in sorted(adm.items()):
        if v == "ok":
            continue
        members.wait({n}, REFUSED_GRACE_S)   # it reads its refusal, says why in its log and exits
        if procs[n].poll() is None:
            fenced.add(n)
            members.kill(n)
        print(f"[coordinator] node {n}: {v}; not admitted", file=sys.stderr, flush=True)
        _log(log_path, {"gen": 0, "node": n, "cause": v, "refused": True, "t_detect": time.time(),
                        "detect_s": time.time() - t_adm, "fenced": n in fenced, "alive": sorted(alive)})
    if not (alive & stage0):
        return {"kind": "exit", "node": min(set(range(world)) - alive), "t": time.time(),
                "code": procs[min(set(range(world)) - alive)].poll()}
    publish_generation(store, 0, sorted(alive), {n: v for n, v in adm.items() if v != "ok"},
                       key=members.verifier.key(COORDINATOR))
    return _loop(job, store, members, stage0, deadline, strikes_needed, log_path, fenced, world, t_start,
                 timeout_s, join_secret, alive=alive)


def _loop(job, store, members, stage0, deadline, strikes_needed, log_path, fenced, world, t_start, timeout_s,
          join_secret, alive: set[int] | None = None, resume: bool = False) -> dict | None:
    """The coordinator's watch loop.  ``resume``: a restarted coordinator; everything it needs
    is read back from the store (generation, alive set, node PIDs, strikes, joins under way)."""
    from .recovery import latest_generation, read_generation

    gen = 0
    key = members.verifier.key(COORDINATOR)     # signs the generations the nodes act on
    strikes: dict[int, int] = {}
    joins = _Joins(job, store, members, join_secret, log_path, world)
    if resume:
        gen = latest_generation(store, key)
        alive = set(read_generation(store, gen, key)["alive"])
        store.set("gen", str(gen))       # (its predecessor may have died between a record and the counter)
        for r in sorted(alive):
            members.ext[r] = verified_pid(members.verifier, store, r)
        saved = members.verifier.read(store, COORDINATOR, "coord/strikes")
        if saved is not None:
            strikes = {int(k): v for k, v in json.loads(saved).items()}
        joins.resume(gen, alive)
        print(f"[coordinator] restarted: generation {gen}, alive {sorted(alive)}, node PIDs "
              f"{[members.ext[r] for r in sorted(alive)]}", file=sys.stderr, flush=True)
        _log(log_path, {"gen": gen, "node": None, "cause": "coordinator restarted", "restart": True,
                        "t_detect": time.time(), "alive": sorted(alive)})
    next_hb = time.time() + job.rt.heartbeat_s
    while True:
        codes = {r: members.code(r) for r in alive}
        if all(codes[r] == 0 for r in alive - joins.placed()):
            cancelled = joins.end_of_run()     # the run is over: joins no node took up are cancelled
            members.wait(cancelled, 5.0)       # (they read why before the store stops)
            alive -= cancelled
            if all(codes[r] == 0 for r in alive):
                return None
        now = time.time()
        if now - t_start > timeout_s:
            return {"kind": "timeout", "t": now}
        found: dict[int, tuple[str, float | None]] = {}     # node -> (cause, reference time)
        struck: dict[int, tuple[str, float | None]] = {}    # bad peers below the strike limit
        for r in sorted(alive):
            if codes[r] not in (None, 0):
                found[r] = (f"died ({describe_exit(codes[r])})", None)
        if now >= next_hb:
            next_hb = now + job.rt.heartbeat_s
            for r in sorted(alive - set(found)):
                hb = None if codes[r] is not None else members.verifier.heartbeat(store, r)
                if hb is None:                # absent, forged or replayed: no decision on it
                    continue
                t, state = hb
                if state != "done" and now - t > deadline:
                    found[r] = (f"stopped responding: no heartbeat for {now - t:.2f} s "
                                f"(deadline {deadline:g} s)", t)
            _read_reports(store, members.verifier, gen, alive, strikes, strikes_needed, found, struck)
        if not found and not struck:
            if joins.step(gen, alive):
                gen += 1
                alive.add(joins.last_added)
            time.sleep(0.02)
            continue
        t_detect = time.time()
        cancelled = joins.cancel(alive)                    # a join not yet taken up by every node
        found.update(cancelled)
        for n in found:
            if members.code(n) is None:
                fenced.add(n)
                members.kill(n)
        alive -= set(found)
        gen += 1
        rows = []
        for n, (cause, ref) in sorted({**found, **struck}.items()):
            fault_t = None
            try:
                if store.check([f"fault/{n}"]):
                    fault_t = float(store.get(f"fault/{n}").decode())
            except Exception:  # noqa: BLE001
                pass
            since = fault_t if fault_t is not None else ref
            row = {"gen": gen, "node": n, "cause": cause, "t_detect": t_detect, "fault_t": fault_t,
                   "detect_s": (t_detect - since) if since is not None else None, "fenced": n in fenced,
                   "alive": sorted(alive)}
            if n in struck:
                row["strike"] = strikes[n]
            rows.append(row)
            took = f"{row['detect_s']:.3f} s after the fault" if row["detect_s"] is not None else "time unknown"
            print(f"[coordinator] node {n}: {cause}; detected {took}; generation {gen}: "
                  f"{len(alive)} node(s) left", file=sys.stderr, flush=True)
        for row in rows:
            _log(log_path, row)
        if not alive or not (alive & stage0):
            n0 = min(found) if found else min(struck)
            return {"kind": "exit", "node": n0, "code": codes.get(n0), "t": t_detect,
                    "msg": "no stage-0 node left" if alive else "no node left"}
        publish_generation(store, gen, sorted(alive), {n: c for n, (c, _) in found.items()},
                           {"cancelled": sorted(cancelled)}, key=key)


class _Joins:
    """Nodes joining the running job (``python -m skiptrain.runtime.node --join``; protocol in
    :mod:`skiptrain.runtime.join`).  One join at a time, only while every node has acknowledged
    the current generation: challenge -> (refused: logged, never signalled) -> admitted -> stage chosen
    on the current schedule (:func:`~skiptrain.runtime.join_placement.choose_stage`) -> a *join*
    generation with the new schedule -> every node switches at its next iteration boundary and
    acknowledges; the joiner then has its state.  A failure before every node acknowledged
    cancels the join (the joiner is fenced; it may try again)."""

    def __init__(self, job: Job, store, members: _Members, secret: str, log_path: Path, world: int):
        self.job, self.store, self.members, self.secret = job, store, members, secret
        self.log_path, self.world = log_path, world
        self.seen: set[int] = set()
        self.pending: dict[int, dict] = {}       # node -> state
        self.last_added = -1

    def _ids(self) -> list[int]:
        try:
            top = self.store.add("nodes/next", 0)
        except Exception:  # noqa: BLE001
            return []
        # ids are handed out one by one by `request_node_id`; a forged huge counter costs a bounded scan
        top = min(top, self.world + len(self.seen) + 64)
        return [j for j in range(self.world, top) if j not in self.seen]

    def _refuse(self, j: int, why: str, st: dict) -> None:
        from .join import refuse

        refuse(self.store, j, self.secret)
        now = time.time()
        # Not killed: it exits by itself on "refused" and never entered a group; a refused
        # process proved nothing, so the PID in its hello is not acted on.
        print(f"[coordinator] joining node {j}: {why}; not admitted", file=sys.stderr, flush=True)
        _log(self.log_path, {"gen": None, "node": j, "cause": why, "refused": True, "join": True, "t_detect": now,
                             "detect_s": now - st["t_hello"], "pid": st.get("pid")})
        self.pending.pop(j, None)

    def step(self, gen: int, alive: set[int]) -> bool:
        """Advance the joins; returns True when it published generation ``gen + 1``."""
        from .join import assign_join, challenge, check_response, hello_pid

        now = time.time()
        for j in self._ids():
            hello = self.store.check([f"join/hello/{j}"]) and self.store.get(f"join/hello/{j}").decode(errors="replace")
            if not hello:
                continue
            self.seen.add(j)
            pid = hello_pid(self.secret, j, hello)
            self.pending[j] = {"t_hello": now, "pid": pid, "nonce": challenge(self.store, j), "state": "challenged"}
        for j, st in sorted(self.pending.items()):
            if st["state"] == "challenged":
                ok = check_response(self.store, j, st["nonce"], self.secret)
                if ok is None:
                    if now - st["t_hello"] > max(60.0, self.job.rt.timeout_s):
                        self._refuse(j, "refused: no challenge response in time", st)
                    continue
                if not ok:
                    self._refuse(j, "refused: wrong challenge response", st)
                    continue
                if len(self.job.phases) != 1:
                    self._refuse(j, "refused: joining needs a single-phase job", st)
                    continue
                st.update(state="admitted", t_admit=now)
                self.members.ext[j] = st["pid"]
                print(f"[coordinator] joining node {j}: challenge answered, admitted "
                      f"({now - st['t_hello']:.3f} s)", file=sys.stderr, flush=True)
            elif st["state"] == "published":
                if self.store.check([f"ack/{st['gen']}/{n}" for n in sorted(alive)]):
                    st["t_ready"] = time.time()
                    row = {"gen": st["gen"], "node": j, "cause": f"joined: stage {st['stage']}", "join": True,
                           "t_detect": st["t_admit"], "detect_s": st["t_admit"] - st["t_hello"],
                           "recover_s": st["t_ready"] - st["t_pub"], "t_published": st["t_pub"],
                           "t_ready": st["t_ready"], "choice": st["choice"], "alive": sorted(alive)}
                    _log(self.log_path, row)
                    print(f"[coordinator] node {j} joined stage {st['stage']} in generation {st['gen']} "
                          f"({row['recover_s']:.3f} s after publishing)", file=sys.stderr, flush=True)
                    del self.pending[j]                    # (a joiner that dies meanwhile: the caller's next pass)
        if any(st["state"] == "published" for st in self.pending.values()):
            return False
        ready = [j for j, st in sorted(self.pending.items()) if st["state"] == "admitted"]
        if not ready or not self.store.check([f"ack/{gen}/{n}" for n in sorted(alive)]):
            return False
        raw = self.members.verifier.read(self.store, min(alive), "sched/cur")   # the lowest node's, signed
        try:
            cur = json.loads(raw) if raw is not None else {}
        except ValueError:
            cur = {}
        if not isinstance(cur, dict) or cur.get("gen") != gen:
            return False
        j = ready[0]
        if self.members.code(j) is not None:
            self._refuse(j, "refused: exited before it was placed", self.pending[j])
            return False
        from ..net.topology import Topology
        from ..schedule.cost import CostModel
        from .join_placement import add_replica, choose_stage

        ph = self.job.phases[0]
        sched = Schedule.from_dict(cur["schedule"])
        topo = Topology.from_dict(ph.topology) if ph.topology else None
        # the cost model of the layout in force (freezing changes it), else the phase's
        cost = CostModel.from_dict(cur["cost"]) if cur.get("cost") else CostModel.from_dict(ph.cost) if ph.cost else None
        stage, choice = choose_stage(sched, j, Schedule.from_dict(ph.schedule), topo, cost)
        new = add_replica(sched, j, stage, Schedule.from_dict(ph.schedule))
        st = self.pending[j]
        st.update(state="published", gen=gen + 1, stage=stage, choice=choice, t_pub=time.time())
        # assign first: a coordinator restarted between the two finds an assignment without its
        # generation and publishes the join again (the joiner waits for a record that places it)
        assign_join(self.store, j, self.secret, gen + 1)
        publish_generation(self.store, gen + 1, sorted(alive | {j}), {},
                           {"kind": "join", "join": {str(j): stage}, "schedule": new.to_dict(), "phase": 0,
                            "choice": choice}, key=self.members.verifier.key(COORDINATOR))
        print(f"[coordinator] joining node {j} -> stage {stage} ({choice['rule']}; simulated "
              f"{choice['simulated_s']}); generation {gen + 1}", file=sys.stderr, flush=True)
        self.last_added = j
        return True

    def resume(self, gen: int, alive: set[int]) -> None:
        """A restarted coordinator: rebuild the joins under way from the store's join keys."""
        from .join import hello_pid, read_result
        from .recovery import generation_record

        key = self.members.verifier.key(COORDINATOR)
        try:
            top = self.store.add("nodes/next", 0)
        except Exception:  # noqa: BLE001
            return
        now = time.time()
        for j in range(self.world, top):
            if not self.store.check([f"join/hello/{j}"]):
                continue
            self.seen.add(j)
            pid = hello_pid(self.secret, j, self.store.get(f"join/hello/{j}").decode(errors="replace"))
            res = (read_result(self.secret, j, self.store.get(f"join/result/{j}").decode(errors="replace"))
                   if self.store.check([f"join/result/{j}"]) else None)
            assigned = self.members.verifier.read(self.store, COORDINATOR, f"join/assign/{j}")
            rec = generation_record(self.store, int(assigned), key) if assigned and assigned.isdigit() else None
            if rec is not None and str(j) in (rec.get("join") or {}):
                if j in alive and not self.store.check([f"ack/{assigned}/{n}" for n in sorted(alive)]):
                    self.pending[j] = {"t_hello": now, "t_admit": now, "pid": pid, "state": "published",
                                       "gen": int(assigned), "stage": rec["join"][str(j)],
                                       "choice": rec.get("choice"), "t_pub": now}
            elif res == "ok":       # admitted, perhaps assigned but never published: placed again
                self.pending[j] = {"t_hello": now, "t_admit": now, "pid": pid, "state": "admitted"}
                self.members.ext[j] = pid
            elif res is None and self.store.check([f"join/nonce/{j}"]):
                self.pending[j] = {"t_hello": now, "pid": pid, "state": "challenged",
                                   "nonce": self.store.get(f"join/nonce/{j}").decode()}

    def placed(self) -> set[int]:
        """Joiners placed in a published generation (in the alive set, perhaps not yet taken up)."""
        return {j for j, st in self.pending.items() if st["state"] == "published"}

    def end_of_run(self) -> set[int]:
        """Every node but the placed joiners finished: no node takes a join up any more.  Each join
        of a node that proved the secret (admitted, or published but not taken up) is cancelled
        and its joiner told why (signed ``join/cancel/<node>``: it exits at once
        instead of waiting for groups no node will form).  A published join was taken up once the
        lowest node wrote ``join/go/<generation>`` (the nodes switch together or not at all).
        Returns the cancelled joiners."""
        from .join import cancel_join

        out = set()
        why = "the run ended before its nodes took this join up"
        for j, st in sorted(self.pending.items()):
            taken_up = st["state"] == "published" and self.store.check([f"join/go/{st['gen']}"])
            if st["state"] == "challenged" or taken_up:
                continue        # unproven (told nothing: it sees the store go), or trains to the end
            cancel_join(self.store, j, self.secret, why)
            now = time.time()
            print(f"[coordinator] joining node {j}: join cancelled: {why}", file=sys.stderr, flush=True)
            _log(self.log_path, {"gen": st.get("gen"), "node": j, "cause": f"join cancelled: {why}",
                                 "cancelled": True, "t_detect": now, "detect_s": now - st["t_hello"]})
            del self.pending[j]
            out.add(j)
        return out

    def cancel(self, alive: set[int]) -> dict[int, tuple[str, float | None]]:
        """A failure happened: a join published but not yet taken up everywhere is cancelled."""
        out = {}
        for j, st in list(self.pending.items()):
            if st["state"] == "published":
                out[j] = ("join cancelled: a failure happened before every node took it up", None)
                del self.pending[j]
        return out


def main(argv: list[str] | None = None) -> int:
    """``python -m skiptrain.runtime.coordinator --run RUN_DIR``: replace a coordinator that died
    (a run launched with ``Job(restartable=True)`` / ``--restartable``).  It reads the job, the
    store address and the join secret from the run directory, resumes from the store, and at
    the end merges the outputs like the launcher and stops the store."""
    import argparse
    from datetime import timedelta

    import torch.distributed as dist

    from .outputs import merge_outputs, stop_store

    ap = argparse.ArgumentParser(prog="python -m skiptrain.runtime.coordinator", description=main.__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="run directory of the running job")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds after the restart before giving up on the run (the run then fails and its store "
                         "stops); default: no limit, the nodes' own timeouts apply")
    args = ap.parse_args(argv)
    run_dir = Path(args.run)
    try:
        job = Job.load(run_dir / "job.json")
        info = json.loads((run_dir / "store.json").read_text())
        secret = (run_dir / "join_secret").read_text()
    except OSError as e:
        print(f"skiptrain coordinator: {run_dir} is not a running restartable job ({e.strerror}: {e.filename}); "
              "launch with restartable=True (--restartable)", file=sys.stderr)
        return 2
    gone = (f"skiptrain coordinator: the store of {run_dir} is gone, so the run has ended; its checkpoints "
            f"are in {run_dir / 'checkpoints'} (skiptrain launch --resume --out {run_dir} continues)")
    try:
        if not pid_running(int(info["pid"])):
            print(gone, file=sys.stderr)
            return 2
        store = dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=max(job.rt.timeout_s, 60.0)))
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        print(f"{gone} ({str(e).splitlines()[0][:120]})", file=sys.stderr)
        return 2
    t0 = time.time()
    timeout = math.inf if args.timeout is None else args.timeout
    try:
        failure = coordinate(job, [], store, job.world, t0, timeout, run_dir, secret, resume=True)
    except RuntimeFailure as e:  # nothing to resume: stopping the store makes the waiting nodes exit
        stop_store(int(info["pid"]), store, secret)
        print(f"skiptrain coordinator: {e}", file=sys.stderr)
        return 2
    (run_dir / "join_secret").unlink(missing_ok=True)
    (run_dir / "join.json").unlink(missing_ok=True)
    if failure is None:
        merge_outputs(job, run_dir)
    stop_store(int(info["pid"]), store, secret)
    if failure is not None:
        print(f"skiptrain coordinator: the run failed: {failure}", file=sys.stderr)
        return 1
    print(f"skiptrain coordinator: the run finished ({time.time() - t0:.1f} s after the restart)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
