"""Checkpoint format, plan, save/load round trips, corruption detection, keep-last-k, LATEST.

The units (no process started) are in tests/unit/test_checkpoint_units.py."""

from __future__ import annotations

import os

import torch

from skiptrain.checkpoint.reader import CheckpointReader


def test_separate_writer_processes(tmp_path):
    """3 stages x 2 replicas as 6 OS processes: each tensor written once, by a holder, balanced;
    the lowest rank commits after every part is on disk."""
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("ckpt_multiwriter_worker.py")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path), str(r), "3", "2"], env=env)
             for r in reversed(range(6))]  # the committer starts first and waits for the others
    assert [p.wait(timeout=120) for p in procs] == [0] * 6
    sys.path.insert(0, str(worker.parent))
    try:
        from ckpt_multiwriter_worker import tensors
    finally:
        sys.path.remove(str(worker.parent))
    r = CheckpointReader(tmp_path)
    assert r.step == 7 and sorted(r.state["ranks"]) == [str(k) for k in range(6)]
    want = tensors(3)
    got = r.read_many(want)
    for n, a in want.items():
        assert torch.equal(got[n], torch.from_numpy(a)), n
        stage = int(n.split("layers.")[1].split(".")[0])
        assert {int(s.file[6:-4]) for s in r.meta.tensors[n].shards} <= {2 * stage, 2 * stage + 1}
    loads = {k: 0 for k in range(6)}
    for t in r.meta.tensors.values():
        for sh in t.shards:
            loads[int(sh.file[6:-4])] += sh.nbytes
    assert sum(loads.values()) == sum(a.nbytes for a in want.values())
    for s in range(3):
        assert abs(loads[2 * s] - loads[2 * s + 1]) <= 16 << 10 and min(loads[2 * s], loads[2 * s + 1]) > 0
