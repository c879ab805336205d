"""The swarm half of ``bench/checkpoint.py``: what whole-job checkpoints cost a running swarm, and
whether a job killed at random moments during its saves always resumes.

* stall: a 9-node swarm (stages 3/2/2/2, the tiny model, k=0) run with a checkpoint every
  iteration and without checkpoints, alternately, in one launch (phases of the same node
  processes, placed alike on the cores for both kinds).  The iteration period is the time
  between the common start times of consecutive iterations (so it counts the save at the
  boundary and any wait for the snapshot before the next optimizer step); the slowdown is the
  ratio of the median periods minus 1.
* crash loop: a 6-node job (2/2/1/1) checkpointing every iteration is SIGKILLed whole (launcher
  and every node) at a random moment while a save is being written (a ``.tmp-`` directory in the
  checkpoint root), then resumed from ``LATEST``; each trial checks that ``LATEST`` loads with
  every checksum verified before the next resume, and the last trial's run goes on to a clean end
  with no sample lost or repeated over all the trials.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench._events import kill_job, launch_process  # noqa: E402


def _job(data: Path, run: Path, nodes: int, sizes: str, iterations: int, every: int, resume=None):
    from skiptrain.config import build_config
    from skiptrain.data.dataset import TokenDataset
    from skiptrain.runtime.job import Job, build_cost, build_schedule, build_topology, phase_for

    cfg = build_config("tiny", overrides={
        "model": {"n_stages": len(sizes.split(","))},
        "runtime": {"nodes": nodes, "stage_sizes": sizes, "mb_per_originator": 2, "timeout_s": 30},
        "train": {"steps": iterations, "warmup_steps": 2, "eval_every": 0},
        "checkpoint": {"every": every, "final": every > 0}})
    cfg.model.vocab_size = TokenDataset.open(data).vocab_size
    topo = build_topology(cfg, nodes)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    sched = build_schedule(cfg, "full_pipeline", topo, cost)
    return Job(config=cfg.to_dict(), data_path=str(data), run_dir=str(run),
               phases=[phase_for(cfg, sched, topo, cost, "train", iterations)], resume=resume)


def _periods(run: Path, skip: int, phase: str = "train") -> list[float]:
    """Seconds between consecutive iterations' common start times (rank 0's record of ``phase``)."""
    import json

    t0 = [it["t0"] for it in json.loads((run / "phases" / phase / "node0.json").read_text())["iterations"]]
    return [b - a for a, b in zip(t0[skip:], t0[skip + 1:])]


def swarm_stall(data: Path, work: Path, iterations: int, reps: int) -> dict:
    """Median iteration period with a checkpoint every iteration vs none: ``reps`` pairs of
    phases of one launch, alternating."""
    from skiptrain.runtime.launcher import launch

    run = work / "stall"
    job = _job(data, run, 9, "3,2,2,2", iterations, 0)
    kinds = [(f"{kind}{rep}", kind, every) for rep in range(reps) for kind, every in (("save", 1), ("none", 0))]
    job.phases = [dataclasses.replace(job.phases[0], name=name, config={"checkpoint": {"every": every, "final": False}})
                  for name, _, every in kinds]
    launch(job, timeout_s=900)
    per: dict[str, list[float]] = {"save": [], "none": []}
    for name, kind, _ in kinds:
        periods = _periods(run, skip=2, phase=name)
        per[kind] += periods
        print(f"[bench] swarm {name}: median period {statistics.median(periods):.4f} s", flush=True)
    save, none = statistics.median(per["save"]), statistics.median(per["none"])
    return {"nodes": 9, "iterations": iterations, "reps": reps, "period_save_s": save, "period_none_s": none,
            "swarm_stall_fraction": save / none - 1}


def _wait_for_save(root: Path, after: int, limit_s: float) -> bool:
    """Poll until a save past step ``after`` is being written; False if none within the limit."""
    from skiptrain.checkpoint import store

    end = time.time() + limit_s
    while time.time() < end:
        for e in root.glob(".tmp-step-*"):
            step = store.step_of(e.name[len(".tmp-"):])
            if step is not None and step > after:
                return True
        time.sleep(0.001)
    return False


def crash_loop(data: Path, work: Path, trials: int, seed: int = 0) -> dict:
    """Kill the whole job during a save ``trials`` times, resuming from ``LATEST`` each time."""
    from skiptrain.checkpoint.reader import CheckpointReader
    from skiptrain.runtime.job_checkpoint import resume_point
    from skiptrain.runtime.launcher import launch
    from skiptrain.runtime.recovery import trained_samples

    rng = random.Random(seed)
    run, total = work / "crash", 10_000
    root = run / "checkpoints"
    run.mkdir(parents=True)
    ok, during_save, start, steps = 0, 0, None, []
    for trial in range(trials):
        proc = launch_process(_job(data, run, 6, "2,2,1,1", total, 1, start).save(work / "crash-job.json"))
        after = start["iteration"] if start else 0
        hit = _wait_for_save(root, after + rng.randint(0, 2), 300)
        time.sleep(rng.uniform(0.0, 0.01))
        during_save += hit and any(root.glob(".tmp-step-*"))
        kill_job(proc, run)
        try:
            reader = CheckpointReader(root)
            reader.verify()
            start = resume_point(root)
            ok += 1
            steps.append(start["iteration"])
        except Exception as e:  # noqa: BLE001 - a failed trial is the figure
            print(f"[bench] crash trial {trial}: LATEST does not load: {e}", flush=True)
        print(f"[bench] crash trial {trial + 1}/{trials}: killed {'during a save' if hit else 'between saves'}; "
              f"LATEST = iteration {steps[-1] if steps else None}", flush=True)
    end = (start["iteration"] if start else 0) + 3
    launch(_job(data, run, 6, "2,2,1,1", end, 1, start), timeout_s=900)
    per_it = trained_samples(run / "phases" / "train")
    flat = sorted(i for s in per_it.values() for i in s)
    gb = 4 * 8
    return {"crash_trials": trials, "crash_resumes_ok": ok, "killed_during_save": during_save,
            "resumed_at": steps, "final_iteration": end,
            "samples_lost": len(set(range(end * gb)) - set(flat)), "samples_repeated": len(flat) - len(set(flat))}
