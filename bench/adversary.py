"""Hostile and unlucky users against a live 5-node swarm: nobody healthy fenced, nothing lost.

    .venv/bin/python bench/adversary.py --json runs/bench/adversary.json
    .venv/bin/python bench/adversary.py --quick

Each case runs once on a fresh swarm (the ``tiny`` preset on the test excerpts; stages
``[[0, 1], [2], [3], [4]]``: stage 0 has two replicas; leases of 4 s renewed every 0.2 s).
The "outsider" is a store client that reached the run's store port without the run's secret.

* ``replay``: ``--restartable``, five times the iterations; the outsider copies every node's
  signed lease renewal, the launcher is SIGKILLed, and while ``python -m
  skiptrain.runtime.coordinator_restart --run`` takes over the outsider writes the old renewals back in
  a loop for 15 s (about 500 times a second).
* ``unsigned counter``: the outsider sets ``nodes/next`` to ``x``; then node 1 is SIGKILLed.
* ``deleted lease key``: node 1 is SIGKILLed; once the swarm goes on without it, the outsider
  deletes ``hb/1``.
* ``forged renewal without --recover``: a run without ``--recover``; the outsider writes
  ``hb/3 = "0:run"`` in a loop.
* ``paused launcher``: the launcher (the coordinator) is SIGSTOPped for 9 s, then SIGCONTed;
  once as launched by default and once with ``--restartable``.
* ``NaN member``: node 1 (a replica of stage 0, with the run's secret) sends NaN to the dense
  all-reduce from iteration 3 on.

Per case: healthy nodes fenced (must be 0; the node a case kills or poisons is not healthy),
samples lost and repeated over the committed iterations (must be 0), whether the run finished
with a model ``skiptrain eval`` accepts, and the last line the user read.  Every process ended
here is one this bench started, by PID; nothing a run wrote is deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _data import excerpt_data  # noqa: E402
from _events import REPO, kill_job, launch_process, steps_done  # noqa: E402

from skiptrain.config import build_config  # noqa: E402
from skiptrain.runtime.faults import faulty_job  # noqa: E402
from skiptrain.runtime.job import Job, Phase, with_runtime  # noqa: E402
from skiptrain.runtime.node_processes import node_pids  # noqa: E402
from skiptrain.runtime.recovery import trained_samples  # noqa: E402
from skiptrain.schedule.schedule import MicroBatch, Schedule  # noqa: E402
from skiptrain.train.rundir import prepare_run_dir  # noqa: E402

PLACEMENT = [[0, 1], [2], [3], [4]]
ROUTES = [MicroBatch(k, k % 2, [(1, 2), (2, 3), (3, 4)]) for k in range(4)]


def make_job(run: Path, data: Path, iters: int, recover: bool = True, restartable: bool = False,
             faults=None) -> Path:
    cfg = build_config("tiny", overrides={"train": {"steps": iters, "warmup_steps": 1}, "checkpoint": {"every": 5},
                                          "data": {"path": str(data)}})
    sched = Schedule(placement=PLACEMENT, memory=2, method="test", micro_batches=ROUTES)
    rt = with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=4.0, recover=recover,
                      restartable=restartable)
    job = Job(config=rt, data_path=str(data), run_dir=str(run),
              phases=[Phase("train", sched.to_dict(), iterations=iters, save_weights=True)],
              **(faulty_job(faults) if faults else {}))
    prepare_run_dir(run, cfg, data)          # (config.toml: what `skiptrain eval` reads, as a launch writes it)
    return job.save(run.parent / f"{run.name}-job.json")


def outsider(run: Path, file: str = "join.json", launcher: int | None = None):
    """A store client of the run's store that holds no secret: the address is public (``file`` in
    the run directory; a run without joins announces none: then the port ``launcher`` listens on)."""
    import torch.distributed as dist

    info = json.loads((run / file).read_text()) if launcher is None else {"host": "127.0.0.1",
                                                                           "port": listening_port(launcher)}
    return dist.TCPStore(info["host"], int(info["port"]), 1, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def listening_port(pid: int) -> int:
    """The TCP port process ``pid`` (one this bench started) listens on."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = {os.readlink(f)[8:-1] for f in fds.iterdir() if os.readlink(f).startswith("socket:[")}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                return int(cols[1].split(":")[1], 16)
    raise RuntimeError(f"process {pid} listens on no TCP port")


def wait_steps(run: Path, n: int, limit_s: float = 180.0) -> None:
    end = time.time() + limit_s
    while steps_done(run) < n and time.time() < end:
        time.sleep(0.05)


def node_pid(run: Path, rank: int) -> int:
    return node_pids(run)[rank]


WRITES = {"n": 0}        # the outsider's writes of the case under way


def in_loop(stop: threading.Event, fn) -> None:
    """Call ``fn()`` every 2 ms until ``stop`` (errors: the store went away, the run ended)."""
    def loop():
        while not stop.is_set():
            try:
                fn()
            except Exception:  # noqa: BLE001
                return
            WRITES["n"] += 1
            time.sleep(0.002)
    threading.Thread(target=loop, daemon=True).start()


def case_replay(run: Path, data: Path, iters: int) -> dict:
    iters *= 5                                       # (training goes on for several leases under the replay)
    proc = launch_process(make_job(run, data, iters, restartable=True), run.parent / f"{run.name}-launch.log")
    wait_steps(run, iters // 4)
    st = outsider(run, "store.json")
    old = {f"hb/{r}": st.get(f"hb/{r}") for r in range(len(node_pids(run)))}
    time.sleep(1.0)                                  # (the nodes renew past the copies)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stop = threading.Event()
    in_loop(stop, lambda: [st.set(k, v) for k, v in old.items()])
    coord = subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.coordinator_restart", "--run", str(run)],
                             env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                             stderr=open(run.parent / f"{run.name}-coordinator.log", "wb"))
    time.sleep(15.0)
    stop.set()
    coord.wait(timeout=600)
    return {"targeted": [], "rc": coord.returncode, "log": run.parent / f"{run.name}-coordinator.log",
            "iterations": iters}


def case_counter(run: Path, data: Path, iters: int) -> dict:
    proc = launch_process(make_job(run, data, iters), run.parent / f"{run.name}-launch.log")
    wait_steps(run, iters // 4)
    outsider(run).set("nodes/next", "x")
    os.kill(node_pid(run, 1), signal.SIGKILL)
    return _finish(proc, run, [1])


def case_deleted_key(run: Path, data: Path, iters: int) -> dict:
    proc = launch_process(make_job(run, data, iters), run.parent / f"{run.name}-launch.log")
    wait_steps(run, iters // 4)
    os.kill(node_pid(run, 1), signal.SIGKILL)
    at = steps_done(run)
    wait_steps(run, at + 3)
    outsider(run).delete_key("hb/1")
    return _finish(proc, run, [1])


def case_forged_default(run: Path, data: Path, iters: int) -> dict:
    proc = launch_process(make_job(run, data, iters, recover=False), run.parent / f"{run.name}-launch.log")
    wait_steps(run, 2)
    st, stop = outsider(run, launcher=proc.pid), threading.Event()
    in_loop(stop, lambda: st.set("hb/3", "0:run"))
    out = _finish(proc, run, [])
    stop.set()
    return out


def case_paused(run: Path, data: Path, iters: int, restartable: bool) -> dict:
    proc = launch_process(make_job(run, data, iters, restartable=restartable), run.parent / f"{run.name}-launch.log")
    wait_steps(run, iters // 4)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(9.0)
    os.kill(proc.pid, signal.SIGCONT)
    return _finish(proc, run, [])


def case_nan(run: Path, data: Path, iters: int) -> dict:
    job = make_job(run, data, iters, faults={"node": 1, "kind": "grad_nan", "iteration": 3})
    return _finish(launch_process(job, run.parent / f"{run.name}-launch.log"), run, [1])


def _finish(proc, run: Path, targeted: list[int], limit_s: float = 600.0) -> dict:
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_job(proc, run)
    return {"targeted": targeted, "rc": proc.returncode, "log": run.parent / f"{run.name}-launch.log"}


CASES = {"replay": case_replay, "unsigned counter": case_counter, "deleted lease key": case_deleted_key,
         "forged renewal without --recover": case_forged_default,
         "paused launcher": lambda r, d, n: case_paused(r, d, n, False),
         "paused launcher (--restartable)": lambda r, d, n: case_paused(r, d, n, True),
         "NaN member": case_nan}


def figures(run: Path, iters: int, out: dict) -> dict:
    log = run / "recoveries.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    removed = sorted({r["node"] for r in rows if r.get("node") is not None and not r.get("join")
                      and not r.get("restart") and not r.get("refused")})
    per_it = trained_samples(run / "phases" / "train")
    gb = len(ROUTES) * build_config("tiny").train.micro_batch
    got = [i for s in per_it.values() for i in s]
    want = set(range(len(per_it) * gb))
    model = run / "model.safetensors"
    evaluated = subprocess.run([sys.executable, "-m", "skiptrain.cli", "eval", str(run)], capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=str(REPO))) if model.is_file() else None
    return {"healthy_fenced": [n for n in removed if n not in out["targeted"]], "fenced": removed,
            "iterations_committed": len(per_it), "iterations": iters,
            "samples_lost": len(want - set(got)), "samples_repeated": len(got) - len(set(got)),
            "finished": out["rc"] == 0 and len(per_it) == iters and model.is_file(),
            "eval_accepts": evaluated is not None and evaluated.returncode == 0,
            "user_read": last_line(out["log"])}


def last_line(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [x.strip() for x in text.replace("\r", "\n").splitlines()
             if x.strip() and not x.startswith(("frame #", "[W", "Exception raised", "<omitting"))]
    errors = [x for x in lines if ": error: " in x]          # (an error's first line names it)
    return (errors or lines or ["(nothing)"])[-1][:300]


def print_table(rows: dict) -> None:
    print(f"\n{'case':44s} {'healthy fenced':>14s} {'lost':>5s} {'repeated':>8s} {'committed':>9s} "
          f"{'finished':>8s} {'eval':>5s}  what the user read")
    for name, f in rows.items():
        print(f"{name:44s} {len(f['healthy_fenced']):14d} {f['samples_lost']:5d} {f['samples_repeated']:8d} "
              f"{f['iterations_committed']:4d}/{f['iterations']:<4d} {str(f['finished']):>8s} "
              f"{'yes' if f['eval_accepts'] else 'no':>5s}  {f['user_read'][:160]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 iterations per case instead of 60 (same code path)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", type=Path, default=REPO / "runs" / "bench" / "adversary", help="the runs go here")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    iters = 30 if args.quick else 60
    keep = args.keep / time.strftime("%Y%m%d-%H%M%S")          # (a new folder per bench run)
    data = excerpt_data(keep)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()] or list(CASES)
    rows = {}
    for i, name in enumerate(wanted):
        run = keep / f"case{i}"
        t0, WRITES["n"] = time.time(), 0
        out = CASES[name](run, data, iters)
        rows[name] = {**figures(run, out.get("iterations", iters), out), "outsider_loop_writes": WRITES["n"],
                      "wall_s": round(time.time() - t0, 1), "run": str(run)}
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"quick": args.quick, "iterations": iters, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
