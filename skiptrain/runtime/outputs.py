"""What a job leaves behind, and its store's end: merged timelines and weights, salvage.

* :func:`prepare_outputs`: a launch's run directory cleared of an earlier launch's outputs (a
  resume keeps them up to its checkpoint);
* :func:`merge_outputs`: per-iteration timelines merged over the nodes, and the stages' weights
  merged into ``model.safetensors`` (a stage lost for good filled from the newest
  job checkpoint, else its initial weights, noted in ``lost_stages.json``);
* :func:`salvage_checkpoint`: an interrupted job's model from its newest committed checkpoint;
* :func:`stop_store`: ask the rendezvous store process to exit, SIGKILL it if it does not.

Used by the launcher and by a restarted coordinator alike.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..schedule.schedule import Schedule
from ..schedule.timeline import Event, from_dicts, save_timeline
from .event_log import LOG_NAME, log_event
from .failure import pid_running
from .job import Job
from .job_checkpoint import checkpoint_root


def load_phase_records(run_dir: str | Path, phase: str) -> list[dict]:
    """Every node's record of ``phase`` (``phases/<phase>/node<r>.json``), each read once."""
    return [json.loads(f.read_text()) for f in sorted((Path(run_dir) / "phases" / phase).glob("node*.json"))]


def iteration_events(records: list[dict], iteration: int) -> list[Event]:
    """All nodes' events of one iteration in ``records`` (its index there, from 0), sorted by
    start (simulator format)."""
    events: list[Event] = []
    for rec in records:
        if 0 <= iteration < len(rec["iterations"]):
            events += from_dicts(rec["iterations"][iteration]["events"])
    events.sort(key=lambda e: (e.start, e.node))
    return events


def load_phase_timeline(run_dir: str | Path, phase: str, iteration: int) -> list[Event]:
    """All nodes' events of one iteration of ``phase``, sorted by start (simulator format)."""
    return iteration_events(load_phase_records(run_dir, phase), iteration)

def latest_job_checkpoint(job: Job):
    """A reader of the newest committed checkpoint of the job's last phase, or None."""
    from ..checkpoint import store as ckstore
    from ..checkpoint.reader import CheckpointReader
    from .job_checkpoint import checkpoint_root

    path = ckstore.latest(checkpoint_root(job, job.phases[-1].name), warn=False)
    return None if path is None else CheckpointReader(path)


def salvage_checkpoint(job: Job) -> str:
    """Write ``model.safetensors`` from the job's newest committed checkpoint; returns what was
    done, for the user."""
    from ..checkpoint.weights import save_weights_file
    from .job_checkpoint import is_weight_name

    reader = latest_job_checkpoint(job)
    if reader is None:
        return ("no checkpoint was committed, so no weights were saved (set --ckpt-every N to checkpoint "
                "the job every N iterations)")
    run_dir = Path(job.run_dir)
    save_weights_file(reader.read_many(n for n in reader.names() if is_weight_name(n)), run_dir / "model.safetensors")
    (run_dir / "interrupted.json").write_text(json.dumps({"iteration": reader.step, "checkpoint": str(reader.path)})
                                              + "\n")
    return (f"{run_dir / 'model.safetensors'} holds the weights of checkpoint {reader.path} (iteration "
            f"{reader.step}); --resume continues from it")

def stop_store(store_proc, store, secret: str | None) -> None:
    """Ask the store process to exit (``store/stop``, signed with the coordinator's key when the
    run has a secret).  A store process this one started (a ``Popen``) is SIGKILLed if it does
    not exit within 5 s; one it did not start (its PID, from ``store.json``) is only waited for
    (``store_proc`` None: not even that)."""
    from .membership import coordinator_key, sign
    from .store import STOP_KEY

    try:
        store.set(STOP_KEY, sign(coordinator_key(secret), STOP_KEY, "1"))
    except Exception:  # noqa: BLE001
        pass
    if store_proc is None:
        return
    ours = not isinstance(store_proc, int)
    end = time.time() + 5
    while time.time() < end:
        if (store_proc.poll() is not None) if ours else not pid_running(store_proc):
            return
        time.sleep(0.05)
    if ours:
        store_proc.kill()


def merge_outputs(job: Job, run_dir: Path) -> None:
    """Per-iteration merged timelines, and the stage weights merged into model.safetensors."""
    for ph in job.phases:
        records = load_phase_records(run_dir, ph.name)       # (read once: they hold every iteration)
        for it in range(ph.iterations):
            ev = iteration_events(records, it)
            if ev:
                save_timeline(ev, run_dir / "phases" / ph.name / f"timeline_it{it}.json")
    parts = sorted((run_dir / "parts").glob("stage*.safetensors")) if (run_dir / "parts").is_dir() else []
    if parts:
        from safetensors.torch import load_file

        from ..checkpoint.weights import save_weights_file

        state = {}
        for p in parts:
            state.update(load_file(str(p)))
        if job.rt.recover:
            state.update(lost_stages_from_checkpoints(job, run_dir, {p.stem for p in parts}, set(state)))
        save_weights_file(state, run_dir / "model.safetensors")

def _initial_stage_weights(job: Job, stage: int) -> dict:
    """Stage ``stage``'s weights as the run initialised them (same seed), by global name."""
    from ..config import config_from_dict
    from ..model import StagedLM

    cfg = config_from_dict(job.config)
    return {n: t.detach() for n, t in StagedLM(cfg.model, stages=[stage], seed=cfg.train.seed).state_dict().items()}

def lost_stages_from_checkpoints(job: Job, run_dir: Path, have: set[str], names: set[str] = frozenset()) -> dict:
    """Recovery mode: a stage that ended the run without a replica (lost for good, never taken
    over) has no part; the job's newest checkpoint fills it in the merged model, else its initial
    weights do (so the run's model is complete and loads); ``RUN_DIR/lost_stages.json`` says which.
    A stage of the phase's schedule whose tensors are all among ``names`` (the parts' tensors:
    freeze transitions repartitioned the layers) is not lost."""
    ph = job.phases[-1]
    S = len(Schedule.from_dict(ph.schedule).placement)
    reader = None
    out, notes = {}, {}
    for s in range(S):
        if f"stage{s}" in have:
            continue
        init = _initial_stage_weights(job, s)
        if all(n in names for n in init):     # its tensors ended on other stages (a freeze repartitioned)
            continue
        reader = reader or latest_job_checkpoint(job)
        if reader is not None and all(n in reader.meta.tensors for n in init):
            out.update(reader.read_many(init))
            notes[s] = f"no replica at the end; weights from the checkpoint after iteration {reader.step} ({reader.path})"
        else:
            out.update(init)
            notes[s] = ("no replica at the end and no checkpoint: its INITIAL (untrained) weights are in "
                        "model.safetensors; checkpoint the job (--ckpt-every N) to avoid this")
    if notes:
        (run_dir / "lost_stages.json").write_text(json.dumps({str(k): v for k, v in notes.items()}, indent=1))
    return out


def prepare_outputs(job: Job, run_dir: Path) -> None:
    """Clear what an earlier launch into ``run_dir`` left; when resuming, keep its metrics and
    sample logs up to the checkpoint, and its membership events (the resume logged as one)."""
    from ..checkpoint.training import begin_branch, truncate_metrics

    run_dir.mkdir(parents=True, exist_ok=True)
    r = job.resume
    if r:                   # (the run's membership events go on: the resume is one of them)
        log_event(run_dir / LOG_NAME, {"gen": 0, "node": None, "restart": True, "t_detect": time.time(),
                                       "cause": f"resumed from the checkpoint of iteration {r['iteration']}"})
    else:
        (run_dir / LOG_NAME).unlink(missing_ok=True)
    keep = {}
    if r:
        for f in (run_dir / "phases").glob("*/samples_node*.jsonl"):
            keep[f] = [line for line in f.read_text().splitlines() if _before(line, r["iteration"])]
    shutil.rmtree(run_dir / ".shipped", ignore_errors=True)     # (uploads to a coordinator that died)
    for sub in ("errors", "phases", "parts"):
        d = run_dir / sub
        if d.is_dir():
            for f in sorted(d.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
    for f, lines in keep.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(line + "\n" for line in lines))
    if r:
        truncate_metrics(run_dir / "metrics.jsonl", int(r["iteration"]))
        begin_branch(checkpoint_root(job, job.phases[int(r["phase"])].name), r["path"], int(r["iteration"]),
                     run_dir / "metrics.jsonl")
    else:
        (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "logs").mkdir(exist_ok=True)


def _before(line: str, iteration: int) -> bool:
    """Whether a sample-log line is of an iteration before ``iteration`` (torn lines: no)."""
    try:
        return int(json.loads(line)["iteration"]) < iteration
    except (ValueError, KeyError, TypeError):
        return False
