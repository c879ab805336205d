"""Events a bench does to a running swarm from outside, and what it reads back: a launch in a
process of its own (so the whole job can be SIGKILLed), the job's node processes found by their
run directory, a node joining with ``python -m skiptrain.runtime.node --join``, the iterations
done so far, and the validation loss of a run's merged model.

Every process ended here is one this bench started (its launcher, that launcher's nodes, its
joiners), by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from skiptrain.runtime.node_processes import node_pids as forked_node_pids

REPO = Path(__file__).resolve().parents[1]


def launch_process(job_path: Path, log: Path | None = None) -> subprocess.Popen:
    """``launch(Job.load(job_path))`` in a new process session (output to ``log`` or nowhere); a
    failed run ends with what ``skiptrain launch`` prints (``skiptrain launch: error: ...``) and exit 2."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-c", "import sys\n"
                             "from skiptrain.runtime.failure import RuntimeFailure\n"
                             "from skiptrain.runtime.job import Job\n"
                             "from skiptrain.runtime.launcher import launch\n"
                             f"try:\n    launch(Job.load({str(job_path)!r}), timeout_s=3600)\n"
                             "except RuntimeFailure as e:\n"
                             "    print(f'skiptrain launch: error: {e}', file=sys.stderr)\n    sys.exit(2)\n"],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=out,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL, start_new_session=True)


def node_pids(run: Path) -> list[int]:
    """PIDs of the node processes of the launch into ``run`` and of their supervisors: the forked
    ones (the PID on the first line of their logs) and any whose command line names ``run``'s job
    file (nodes exec'd afresh); never this process."""
    job = str(Path(run) / "job.json").encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if job in (p / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
            except OSError:
                pass
    forked = list(forked_node_pids(run).values()) + list(forked_node_pids(run, "supervisor*.log").values())
    return pids + [p for p in forked if p not in pids and p != os.getpid()]


def kill_job(proc: subprocess.Popen, run: Path, extra: list[subprocess.Popen] = ()) -> None:
    """SIGKILL the launcher ``proc``, every node of ``run`` and the processes ``extra`` (joiners
    this bench started), then wait until none is left."""
    for pid in [proc.pid] + node_pids(run) + [p.pid for p in extra if p.poll() is None]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    for p in extra:
        p.wait(timeout=30)
    end = time.time() + 30
    while node_pids(run) and time.time() < end:
        time.sleep(0.05)


def spawn_joiner(run: Path, secret: str, name: str) -> subprocess.Popen:
    """A new node process joining the running job of ``run`` with ``secret`` (log: logs/NAME.log)."""
    info = json.loads((run / "join.json").read_text())
    env = dict(os.environ, SKIPTRAIN_JOIN_SECRET=secret, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    log = open(run / "logs" / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "skiptrain.runtime.node", "--join",
                             f"{info['host']}:{info['port']}"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def steps_done(run: Path) -> int:
    """Training iterations written to ``run``'s metrics so far."""
    try:
        return sum(1 for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def validation_loss(cfg, data: Path, state: dict | Path) -> float:
    """Validation loss (``train.eval_batches`` fixed micro-batches) of a whole model: a run
    directory (its merged ``model.safetensors``) or tensors by global name."""
    from safetensors.torch import load_file

    from skiptrain.data.dataset import TokenDataset
    from skiptrain.data.loader import SampleSource
    from skiptrain.model.transformer import StagedLM
    from skiptrain.runtime.evaluate import evaluate

    ds = TokenDataset.open(data)
    model = StagedLM(cfg.model, seed=cfg.train.seed)
    tensors = load_file(str(Path(state) / "model.safetensors")) if isinstance(state, (str, Path)) else state
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    if missing:
        raise RuntimeError(f"the model lacks {len(missing)} tensors (e.g. {missing[:2]}): a stage was lost for good")
    return evaluate(model, SampleSource(ds.tokens("val"), cfg.model.seq_len, shuffle=False),
                    cfg.train.eval_batches, cfg.train.micro_batch)
