"""The coordinator's side of nodes joining a running job: challenge, admit, place, announce.

Nodes started with ``python -m skiptrain.runtime.node --join HOST:PORT`` (protocol in
:mod:`skiptrain.runtime.join`) are challenged, placed on the stage where they shorten the
iteration most and announced in a *join* generation that the nodes take up at their next
iteration boundary.  :class:`Joiners` keeps the joins under way; the coordinator's watch loop
advances them (:meth:`Joiners.step`) whenever it has no failure to act on.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..schedule.schedule import Schedule
from .event_log import log_event
from .fencing import Members
from .job import Job
from .membership import COORDINATOR, MAX_NODE_IDS, open_signed, raise_count, read_count, read_raw
from .recovery import publish_generation


def schedule_in_force(members: Members, store, gen: int, alive: set[int], quiet: bool = False) -> dict | None:
    """The schedule of generation ``gen`` as the lowest node wrote it (signed ``sched/cur``):
    ``{"gen", "phase", "schedule", "cost"?}``; None when it is absent, forged or of another
    generation.  ``quiet``: a value the lowest node did not sign is not logged as a forgery (a
    reader that polls may find the previous lowest node's value there, before a re-plan)."""
    if not alive:
        return None
    if quiet:
        raw = read_raw(store, "sched/cur")
        raw = open_signed(members.verifier.key(min(alive)), "sched/cur", raw) if raw is not None else None
    else:
        raw = members.verifier.read(store, min(alive), "sched/cur")   # the lowest node's, signed
    try:
        cur = json.loads(raw) if raw is not None else {}
    except ValueError:
        cur = {}
    if not isinstance(cur, dict) or cur.get("gen") != gen:
        return None
    return cur


class Joiners:
    """Nodes joining the running job (``python -m skiptrain.runtime.node --join``; protocol in
    :mod:`skiptrain.runtime.join`).  One join at a time, only while every node has acknowledged
    the current generation: challenge -> (refused: logged, never signalled) -> admitted -> stage chosen
    on the current schedule (:func:`~skiptrain.runtime.join_placement.choose_stage`) -> a *join*
    generation with the new schedule -> every node switches at its next iteration boundary and
    acknowledges; the joiner then has its state.  A failure before every node acknowledged
    cancels the join (the joiner is fenced; it may try again)."""

    def __init__(self, job: Job, store, members: Members, secret: str, log_path: Path, world: int):
        self.job, self.store, self.members, self.secret = job, store, members, secret
        self.log_path, self.world = log_path, world
        self.seen: set[int] = set()
        self.pending: dict[int, dict] = {}       # node -> state
        self.last_added = -1

    def _ids(self) -> list[int]:
        top = read_count(self.store, "nodes/next", MAX_NODE_IDS)
        if top is None:         # deleted or forged (a joiner's `add` on it fails): put back
            try:
                raise_count(self.store, "nodes/next", max([self.world, *(j + 1 for j in self.seen)]), MAX_NODE_IDS)
            except Exception:  # noqa: BLE001 - the store is going away
                pass
            return []
        # ids are handed out one by one by `request_node_id`; a forged huge counter costs a bounded scan
        top = min(top, self.world + len(self.seen) + 64)
        return [j for j in range(self.world, top) if j not in self.seen]

    def _refuse(self, j: int, why: str, st: dict) -> None:
        from .join import refuse

        refuse(self.store, j, self.secret)
        now = time.time()
        # Not killed: it exits by itself on "refused" and never entered a group.
        print(f"[coordinator] joining node {j}: {why}; not admitted", file=sys.stderr, flush=True)
        log_event(self.log_path, {"gen": None, "node": j, "cause": why, "refused": True, "join": True, "t_detect": now,
                                  "detect_s": now - st["t_hello"]})
        self.pending.pop(j, None)

    def step(self, gen: int, alive: set[int]) -> bool:
        """Advance the joins; returns True when it published generation ``gen + 1``."""
        now = time.time()
        self._challenge_new(now)
        for j, st in sorted(self.pending.items()):
            if st["state"] == "challenged":
                self._check_challenged(j, st, now)
            elif st["state"] == "published":
                self._check_taken_up(j, st, alive)
        if any(st["state"] == "published" for st in self.pending.values()):
            return False
        ready = [j for j, st in sorted(self.pending.items()) if st["state"] == "admitted"]
        if not ready or not self.store.check([f"ack/{gen}/{n}" for n in sorted(alive)]):
            return False
        cur = schedule_in_force(self.members, self.store, gen, alive)
        if cur is None:
            return False
        j = ready[0]
        if self.members.code(j) is not None:
            self._refuse(j, "refused: exited before it was placed", self.pending[j])
            return False
        self._place(j, gen, alive, cur)
        return True

    def _challenge_new(self, now: float) -> None:
        """Challenge every node that said hello since the last pass."""
        from .join import challenge

        for j in self._ids():
            if not self.store.check([f"join/hello/{j}"]):
                continue
            self.seen.add(j)
            self.pending[j] = {"t_hello": now, "nonce": challenge(self.store, j), "state": "challenged"}

    def _check_challenged(self, j: int, st: dict, now: float) -> None:
        """A challenged node: admitted on the right response, refused on a wrong or a late one."""
        from .join import check_response

        ok = check_response(self.store, j, st["nonce"], self.secret)
        if ok is None:
            if now - st["t_hello"] > max(60.0, self.job.rt.timeout_s):
                self._refuse(j, "refused: no challenge response in time", st)
            return
        if not ok:
            self._refuse(j, "refused: wrong challenge response", st)
            return
        if len(self.job.phases) != 1:
            self._refuse(j, "refused: joining needs a single-phase job", st)
            return
        st.update(state="admitted", t_admit=now)
        self.members.leases.watch(j)
        print(f"[coordinator] joining node {j}: challenge answered, admitted "
              f"({now - st['t_hello']:.3f} s)", file=sys.stderr, flush=True)

    def _check_taken_up(self, j: int, st: dict, alive: set[int]) -> None:
        """A published join: done (logged) once every node acknowledged its generation."""
        if self.store.check([f"ack/{st['gen']}/{n}" for n in sorted(alive)]):
            st["t_ready"] = time.time()
            row = {"gen": st["gen"], "node": j, "cause": f"joined: stage {st['stage']}", "join": True,
                   "t_detect": st["t_admit"], "detect_s": st["t_admit"] - st["t_hello"],
                   "recover_s": st["t_ready"] - st["t_pub"], "t_published": st["t_pub"],
                   "t_ready": st["t_ready"], "choice": st["choice"], "alive": sorted(alive)}
            log_event(self.log_path, row)
            print(f"[coordinator] node {j} joined stage {st['stage']} in generation {st['gen']} "
                  f"({row['recover_s']:.3f} s after publishing)", file=sys.stderr, flush=True)
            del self.pending[j]                    # (a joiner that dies meanwhile: the caller's next pass)

    def _place(self, j: int, gen: int, alive: set[int], cur: dict) -> None:
        """Choose admitted node ``j``'s stage on the schedule in force ``cur`` and publish the join
        generation ``gen + 1`` that adds it there."""
        from ..net.topology import Topology
        from ..schedule.cost import CostModel
        from .join import assign_join
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

    def resume(self, gen: int, alive: set[int]) -> None:
        """A restarted coordinator: rebuild the joins under way from the store's join keys."""
        from .join import read_result
        from .recovery import generation_record

        key = self.members.verifier.key(COORDINATOR)
        top = read_count(self.store, "nodes/next", MAX_NODE_IDS)
        if top is None:
            return
        now = time.time()
        for j in range(self.world, top):
            if not self.store.check([f"join/hello/{j}"]):
                continue
            self.seen.add(j)
            res = (read_result(self.secret, j, self.store.get(f"join/result/{j}").decode(errors="replace"))
                   if self.store.check([f"join/result/{j}"]) else None)
            assigned = self.members.verifier.read(self.store, COORDINATOR, f"join/assign/{j}")
            rec = generation_record(self.store, int(assigned), key) if assigned and assigned.isdigit() else None
            if rec is not None and str(j) in (rec.get("join") or {}):
                if j in alive and not self.store.check([f"ack/{assigned}/{n}" for n in sorted(alive)]):
                    self.pending[j] = {"t_hello": now, "t_admit": now, "state": "published",
                                       "gen": int(assigned), "stage": rec["join"][str(j)],
                                       "choice": rec.get("choice"), "t_pub": now}
            elif res == "ok":       # admitted, perhaps assigned but never published: placed again
                self.pending[j] = {"t_hello": now, "t_admit": now, "state": "admitted"}
                self.members.leases.watch(j)
            elif res is None and self.store.check([f"join/nonce/{j}"]):
                self.pending[j] = {"t_hello": now, "state": "challenged",
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
            log_event(self.log_path, {"gen": st.get("gen"), "node": j, "cause": f"join cancelled: {why}",
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

