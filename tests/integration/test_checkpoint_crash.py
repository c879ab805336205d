"""Crash consistency: SIGKILL the saving process at 100 random moments during saves.

After every kill the latest committed checkpoint must load and verify, and hold one step only
(every tensor equals the step in its metadata); so must every other committed checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from skiptrain.checkpoint import store
from skiptrain.checkpoint.reader import CheckpointReader

KILLS = 100
WORKER = Path(__file__).with_name("ckpt_crash_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _check(path: Path) -> int:
    r = CheckpointReader(path)
    r.verify()
    step = r.step
    assert r.state["step"] == step and path.name == f"step-{step:08d}"
    for name, t in r.read_many(r.names()).items():
        assert torch.all(t == step), f"{path.name}: tensor {name} is from another step"
    assert sorted(r.state["ranks"]) == ["0", "1"]
    return step


@pytest.mark.slow
def test_sigkill_during_saves_never_breaks_latest(tmp_path):
    rng = random.Random(6)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    zygote = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    steps_seen, mid_save, prev_step = [], 0, 0
    try:
        for _ in range(KILLS):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.0, 0.12))
            os.kill(pid, signal.SIGKILL)
            assert zygote.stdout.readline().strip() == "reaped"
            mid_save += any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
            latest = store.latest(tmp_path)
            if latest is None:  # killed before the very first commit
                assert prev_step == 0
                continue
            step = _check(latest)
            assert step >= prev_step  # committed progress is never lost
            prev_step = step
            for _, p in store.list_committed(tmp_path):
                _check(p)
            steps_seen.append(step)
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=10)
    assert steps_seen and steps_seen[-1] > 1
    assert mid_save > 0, "no kill landed inside a save; the test did not exercise anything"
    print(f"{KILLS} kills, {mid_save} left a half-written save, final committed step {steps_seen[-1]}")
