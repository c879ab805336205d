"""The coordinator of a recovering run (``job.recover``): membership authority, no model state.

:func:`coordinate` replaces the launcher's fail-fast monitor.  It watches the node processes it
started (exit status), their heartbeats (``hb/<r>``, deadline ``job.heartbeat_deadline_s`` or
``job.timeout_s``) and the nodes' failure reports (``report/<gen>/<r>``; a report of a rejected
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
Limit: the store is hosted in the launcher process, so the launcher itself is not replaceable
without losing the run (a standalone store would lift that; not done).

Failure semantics: returns ``None`` when every surviving node exited 0, else a failure dict for
the launcher's error (no stage-0 node left, every node gone, or the run's time limit).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ..schedule.schedule import Schedule
from .failure import describe_exit
from .job import Job
from .recovery import publish_generation


def coordinate(job: Job, procs, store, world: int, t_start: float, timeout_s: float,
               run_dir: Path, join_secret: str) -> dict | None:
    from .join import admit

    deadline = job.heartbeat_deadline_s or job.timeout_s
    gen = 0
    stage0 = set()
    for ph in job.phases:
        stage0 |= set(Schedule.from_dict(ph.schedule).placement[0])
    log_path = Path(run_dir) / "recoveries.jsonl"
    fenced: set[int] = set()
    # admission: only nodes that answer the join challenge enter generation 0 (and any group)
    t_adm = time.time()
    adm = admit(store, list(range(world)), join_secret, max(60.0, job.timeout_s),
                alive=lambda n: procs[n].poll() is None)
    alive = {n for n, v in adm.items() if v == "ok"}
    with open(log_path, "a") as f:
        for n, v in sorted(adm.items()):
            if v == "ok":
                continue
            if procs[n].poll() is None:
                fenced.add(n)
                os.kill(procs[n].pid, signal.SIGKILL)
                procs[n].wait(timeout=10)
            print(f"[coordinator] node {n}: {v}; not admitted", file=sys.stderr, flush=True)
            f.write(json.dumps({"gen": 0, "node": n, "cause": v, "refused": True, "t_detect": time.time(),
                                "detect_s": time.time() - t_adm, "fenced": n in fenced,
                                "alive": sorted(alive)}) + "\n")
    if not (alive & stage0):
        return {"kind": "exit", "node": min(set(range(world)) - alive), "t": time.time(),
                "code": procs[min(set(range(world)) - alive)].poll()}
    publish_generation(store, 0, sorted(alive), {n: v for n, v in adm.items() if v != "ok"})
    next_hb = time.time() + job.heartbeat_s
    while True:
        codes = [p.poll() for p in procs]
        if all(codes[r] == 0 for r in alive):
            return None
        now = time.time()
        if now - t_start > timeout_s:
            return {"kind": "timeout", "t": now}
        found: dict[int, tuple[str, float | None]] = {}     # node -> (cause, reference time)
        for r in sorted(alive):
            if codes[r] not in (None, 0):
                found[r] = (f"died ({describe_exit(codes[r])})", None)
        if now >= next_hb:
            next_hb = now + job.heartbeat_s
            for r in sorted(alive - set(found)):
                try:
                    if codes[r] is not None or not store.check([f"hb/{r}"]):
                        continue
                    t, _, state = store.get(f"hb/{r}").decode().partition(":")
                except Exception:  # noqa: BLE001
                    continue
                if state != "done" and now - float(t) > deadline:
                    found[r] = (f"stopped responding: no heartbeat for {now - float(t):.2f} s "
                                f"(deadline {deadline:g} s)", float(t))
            for r in sorted(alive):
                key = f"report/{gen}/{r}"
                try:
                    if not store.check([key]):
                        continue
                    rep = json.loads(store.get(key).decode())
                except Exception:  # noqa: BLE001
                    continue
                bad = rep.get("node")
                if rep.get("bad_peer") and bad is not None and bad in alive and bad not in found:
                    found[bad] = (f"bad peer: {rep['cause'].splitlines()[0][:200]} (reported by node {r})",
                                  float(rep["t"]))
        if not found:
            time.sleep(0.02)
            continue
        t_detect = time.time()
        for n in found:
            if procs[n].poll() is None:
                fenced.add(n)
                try:
                    os.kill(procs[n].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    procs[n].wait(timeout=10)
                except Exception:  # noqa: BLE001
                    pass
        alive -= set(found)
        gen += 1
        rows = []
        for n, (cause, ref) in sorted(found.items()):
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
            rows.append(row)
            took = f"{row['detect_s']:.3f} s after the fault" if row["detect_s"] is not None else "time unknown"
            print(f"[coordinator] node {n}: {cause}; detected {took}; generation {gen}: "
                  f"{len(alive)} node(s) left", file=sys.stderr, flush=True)
        with open(log_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if not alive or not (alive & stage0):
            return {"kind": "exit", "node": min(found), "code": codes[min(found)], "t": t_detect,
                    "msg": "no stage-0 node left" if alive else "no node left"}
        publish_generation(store, gen, sorted(alive), {n: c for n, (c, _) in found.items()})
