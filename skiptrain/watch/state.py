"""The state of a run, read from its run directory only: what the dashboard and ``skiptrain status`` show.

:func:`run_state` reads the files a swarm writes as it goes (``swarm.json`` from whoever watches
the nodes, the nodes' ``phases/<phase>/live_node<r>.json``, ``metrics.jsonl``,
``recoveries.jsonl``, ``elastic.jsonl``, the committed checkpoints, ``job.json``,
``schedule.json``, ``run.json`` once it ended) with the project's own readers, and returns one
JSON-able dict.  In a run across hosts the coordinator's ``RUN_DIR`` holds every one of them
(the nodes' live files arrive with their outputs when they end).

Failure semantics: a run directory that does not exist (or is a file) raises
:class:`~skiptrain.errors.UserError` with one line; any file not written yet, being replaced, or
with a half-written last line reads as "nothing there yet", never as an error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import UserError
from ..runtime.event_log import membership_events
from ..runtime.live import common_iteration, load_live_records
from ..runtime.outputs import iteration_events
from ..runtime.swarm_view import SWARM_NAME
from ..train.metrics import read_metrics
from . import ideas

#: A node whose lease renewals stopped this many heartbeat intervals ago is shown suspected.
SUSPECT_HEARTBEATS = 4
#: ``swarm.json`` older than this (seconds) while the run is not over: its watcher is not writing.
STALE_S = 10.0


def check_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path; a one-line :class:`UserError` when it is missing or not a directory."""
    p = Path(run_dir)
    if not p.exists():
        raise UserError(f"run directory {str(p)!r} does not exist; pass the --out of a `skiptrain launch` or "
                        "`skiptrain train --nodes N` run (in a run across hosts: the coordinator's --out)")
    if not p.is_dir():
        raise UserError(f"{str(p)!r} is a file, not a run directory; pass the directory given as --out")
    return p


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when it is absent, half written or not an object."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines file written as the run goes: its complete object lines."""
    return read_metrics(path, live=True)


def node_state(node: dict, heartbeat_s: float, lag_s: float = 0.0) -> str:
    """What the dashboard calls a node (``node``: an entry of ``swarm.json``, ``lag_s``: the file's
    age): ``fenced``, ``failed``, ``joining``, ``done``, or for a member ``training``, ``suspected``
    once its renewals stopped for :data:`SUSPECT_HEARTBEATS` heartbeats."""
    status = node.get("status")
    if status in ("fenced", "failed", "joining", "done"):
        return status
    age = node.get("lease_age_s")
    if age is not None and age + lag_s > SUSPECT_HEARTBEATS * max(heartbeat_s, 0.05):
        return "suspected"
    return "training"


def nodes_view(swarm: dict | None, live: list[dict], placement: list[list[int]], over: bool,
               now: float) -> list[dict]:
    """One dict a node: ``node``, ``host``, ``stages``, ``state``, ``lease_age_s``, ``lease_s``,
    ``last_iteration``.  Without ``swarm.json`` (a run starting, or one written before it existed)
    the schedule's nodes, ``starting`` (``done`` once the run is over)."""
    last = {int(r.get("rank", -1)): r.get("iteration") for r in live}
    if swarm is None:
        nodes = sorted({n for p in placement for n in p})
        return [{"node": n, "host": None, "stages": [s for s, p in enumerate(placement) if n in p],
                 "state": "done" if over else "starting", "lease_age_s": None, "lease_s": None,
                 "last_iteration": last.get(n)} for n in nodes]
    lag = 0.0 if swarm.get("done") else max(0.0, now - float(swarm.get("t", now)))
    out = []
    for n in swarm.get("nodes", []):
        state = node_state(n, float(swarm.get("heartbeat_s", 0.5)), lag)
        age = n.get("lease_age_s")
        out.append({"node": n.get("node"), "host": n.get("host"), "stages": n.get("stages", []), "state": state,
                    "lease_age_s": None if age is None or state not in ("training", "suspected") else round(age + lag, 2),
                    "lease_s": n.get("lease_s"), "last_iteration": last.get(n.get("node"))})
    return out


def tokens_at(rows: list[dict], t: float | None = None, step: int | None = None) -> float | None:
    """The tokens of the last training row at or before wall time ``t`` (or of iteration ``step``)."""
    best = None
    for r in rows:
        if (step is not None and r.get("step", 0) <= step) or (t is not None and r.get("time", 0) <= t):
            best = r
    return None if best is None else best.get("tokens")


def run_events(membership: list[dict], elastic_rows: list[dict], ckpt_steps: list[int], rows: list[dict]) -> list[dict]:
    """The events to mark on the loss chart, oldest first: ``kind`` (``failed``, ``joined``,
    ``refused``, ``join_cancelled``, ``restart``, ``replan``, ``freeze``, ``undo``, ``checkpoint``),
    ``node``, ``step``, ``time``, ``tokens`` and a ``label``."""
    train = [r for r in rows if "loss" in r]
    out = [{"kind": e["kind"], "node": e["node"], "time": e["time"], "step": None,
            "tokens": tokens_at(train, t=e["time"]) if e["time"] is not None else None,
            "label": f"node {e['node']}: {e['kind']} (generation {e['gen']})" + (f": {e['cause']}" if e["cause"] else "")}
           for e in membership]
    gen = None
    for r in train:
        if "gen" in r and gen is not None and r["gen"] != gen:
            out.append({"kind": "replan", "node": None, "time": r.get("time"), "step": r["step"],
                        "tokens": r.get("tokens"), "label": f"re-planned for generation {r['gen']} ({r.get('nodes')} nodes)"})
        gen = r.get("gen", gen)
    for e in elastic_rows:
        if e.get("action") == "transition" and e.get("frozen_after") != e.get("frozen_before"):
            kind = "freeze" if e.get("frozen_after", 0) > e.get("frozen_before", 0) else "undo"
            out.append({"kind": kind, "node": None, "time": None, "step": e.get("step"),
                        "tokens": tokens_at(train, step=e.get("step")),
                        "label": f"{kind}: {e.get('frozen_before')} -> {e.get('frozen_after')} layers frozen"})
    for s in ckpt_steps:
        out.append({"kind": "checkpoint", "node": None, "time": None, "step": s, "tokens": tokens_at(train, step=s),
                    "label": f"checkpoint after iteration {s}"})
    return sorted(out, key=lambda e: (e["tokens"] is None, e["tokens"] or 0))


def run_status(run_dir: Path, swarm: dict | None, summary: dict | None, has_job: bool, now: float,
               rows: list[dict] = ()) -> tuple[str, str]:
    """``(status, line)``: ``starting``, ``running``, ``stalled``, ``stopped``, ``finished`` or
    ``interrupted``, and a sentence for the user."""
    if summary is not None:
        if summary.get("interrupted"):
            return "interrupted", f"interrupted after iteration {summary.get('step')}; `skiptrain launch --resume --out {run_dir}` continues"
        val = summary.get("val_loss")
        return "finished", f"finished: {summary.get('step')} iterations" + (
            f", validation loss {val:.4f}" if isinstance(val, (int, float)) else "")
    if not has_job and rows:
        return "running", "running in one process (`skiptrain train`): no swarm to show"
    if not has_job or swarm is None:
        return "starting", "the run is starting: no node has reported yet (this page updates by itself)"
    if swarm.get("done"):
        return "stopped", "the watcher has stopped (the run ended or failed); run.json appears when the launcher has finished"
    age = now - float(swarm.get("t", now))
    if age > STALE_S:
        return "stalled", (f"no update of {SWARM_NAME} for {age:.0f} s: the launcher or coordinator may have died "
                           "(see its terminal, and RUN_DIR/logs)")
    return "running", "running"


def gantt(run_dir: Path, phase: str, live: list[dict], done_records: list[dict]) -> dict:
    """The measured timeline of the newest iteration every node has written (the live files; the
    phase records once the phase ended), as ``[node, kind, stage, start, end]`` rows."""
    it, recs = common_iteration(live)
    if it is None and done_records:
        it = min(len(r["iterations"]) for r in done_records)
        recs = [{"iterations": [r["iterations"][it - 1]]} for r in done_records] if it else []
    events = iteration_events(recs, 0) if recs else []
    return {"iteration": it, "events": [[e.node, e.kind, e.stage, round(e.start, 5), round(e.end, 5)] for e in events]}


def idea_figures(run_dir: Path, sched, cfg, iterations: int, live: list[dict], elastic_rows: list[dict]) -> dict:
    """:mod:`.ideas`' figures of the run so far (those whose inputs are not there yet are left out)."""
    out = {"freezing": ideas.freezing(elastic_rows, live), "dp": ideas.dp_savings(live),
           "checkpoints": ideas.checkpoints(run_dir, live)}
    if sched is not None:
        out["skip"] = ideas.skip_savings(sched, iterations)
        act = activation_bytes_cached(run_dir, cfg, sched) if cfg is not None else None
        if act is not None:
            out["activations"] = {**act, "saved_bytes": (act["fp32_bytes"] - act["sent_bytes"]) * iterations}
    return out


_ACT: dict[tuple, dict] = {}


def activation_bytes_cached(run_dir: Path, cfg, sched) -> dict | None:
    """:func:`.ideas.activation_bytes` on the topology and cost model of the job's first phase
    (``job.json``; without torch), once per run directory (the schedule's routes are fixed);
    None before ``job.json`` is written."""
    from ..net.topology import Topology
    from ..schedule.cost import CostModel

    job = Path(run_dir) / "job.json"
    key = (str(job.resolve()), job.stat().st_mtime_ns if job.is_file() else None)   # (a run written over)
    if key not in _ACT:
        ph = ((read_json(job) or {}).get("phases") or [{}])[0]
        if not ph.get("topology") or not ph.get("cost"):
            return None
        _ACT[key] = ideas.activation_bytes(cfg, sched, Topology.from_dict(ph["topology"]), CostModel.from_dict(ph["cost"]))
    return _ACT[key]


_PLANS: dict[str, tuple] = {}


def load_plan(run_dir: Path):
    """``(job dict or None, Schedule or None, Config or None)`` as far as the run has written them
    (read again only when one of the three files changed)."""
    files = [Path(run_dir) / f for f in ("job.json", "schedule.json", "config.toml")]
    stamp = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None for f in files)
    key = str(Path(run_dir).resolve())
    if key not in _PLANS or _PLANS[key][0] != stamp:
        _PLANS[key] = (stamp, read_plan(Path(run_dir)))
    return _PLANS[key][1]


def read_plan(run_dir: Path):
    """:func:`load_plan`'s files, read."""
    from ..config import ConfigError, build_config
    from ..schedule.schedule import Schedule

    job = read_json(run_dir / "job.json")
    try:
        sched = Schedule.load(run_dir / "schedule.json")
    except (OSError, ValueError, KeyError, TypeError):
        sched = None
    try:
        cfg = build_config(toml_path=run_dir / "config.toml") if (run_dir / "config.toml").is_file() else None
    except (ConfigError, OSError, ValueError):
        cfg = None
    return job, sched, cfg


def run_state(run_dir: str | Path, now: float | None = None) -> dict:
    """Everything the dashboard shows, as one JSON-able dict (see the module's docstring)."""
    from ..runtime.outputs import load_phase_records
    from .simulated import simulated_timeline

    run_dir, now = check_run_dir(run_dir), time.time() if now is None else now
    job, sched, cfg = load_plan(run_dir)
    phases = [p["name"] for p in (job or {}).get("phases", [])] or ["train"]
    lives = {ph: load_live_records(run_dir, ph) for ph in phases}
    phase = next((ph for ph in reversed(phases) if lives[ph]), phases[0])
    live, swarm, summary = lives[phase], read_json(run_dir / SWARM_NAME), read_json(run_dir / "run.json")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    elastic_rows = read_jsonl(run_dir / "elastic.jsonl")
    membership = membership_events(run_dir)
    status, line = run_status(run_dir, swarm, summary, job is not None, now, train)
    placement = sched.placement if sched is not None else []
    fig = idea_figures(run_dir, sched, cfg, len(train), live, elastic_rows)
    try:
        done_records = [] if live else load_phase_records(run_dir, phase)
    except (OSError, ValueError):
        done_records = []
    its = [r.get("iteration_s") for r in train[-50:] if r.get("iteration_s") is not None]
    nodes = nodes_view(swarm, live, placement, summary is not None, now)
    gone = {n["node"] for n in nodes if n["state"] in ("fenced", "failed")}
    members = [r for r in live if r.get("rank") not in gone]     # (a fenced node's last iteration is old)
    return {
        "run_dir": str(run_dir), "status": status, "line": line, "now": now, "phase": phase,
        "generation": swarm.get("gen") if swarm else None, "mode": swarm.get("mode") if swarm else None,
        "iterations_done": len(train), "iterations_total": sum(p.get("iterations", 0) for p in (job or {}).get("phases", [])),
        "placement": placement, "nodes": nodes,
        "loss": [[r.get("tokens"), r.get("time"), r["loss"]] for r in train],
        "val": [[r.get("tokens"), r.get("time"), r["val_loss"]] for r in rows if "val_loss" in r],
        "last": {k: train[-1].get(k) for k in ("step", "loss", "lr", "iteration_s", "tokens", "gen", "nodes")} if train else None,
        "median_iteration_s": sorted(its)[len(its) // 2] if its else None,
        "events": run_events(membership, elastic_rows, fig["checkpoints"]["committed"], rows),
        "membership": membership, "ideas": fig,
        "gantt": {"measured": gantt(run_dir, phase, members, done_records), "simulated": simulated_timeline(run_dir, phase)},
    }
