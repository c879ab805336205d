"""Shared fixtures: small real-text data sets built from the excerpts in tests/data (no network)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from skiptrain.data.corpus import read_documents
from skiptrain.data.dataset import write_dataset
from skiptrain.runtime.node_processes import node_pids

DATA = Path(__file__).parent / "data"
TRAIN_TEXTS = [str(DATA / "hamlet_excerpt.txt"), str(DATA / "macbeth_excerpt.txt")]
OOD_TEXTS = [str(DATA / "milton_excerpt.txt")]

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory) -> Path:
    """Hamlet + Macbeth excerpts, byte tokenizer, Milton as the out-of-distribution split."""
    out = tmp_path_factory.mktemp("byte_data")
    write_dataset(out, read_documents(TRAIN_TEXTS), read_documents(OOD_TEXTS), tokenizer="byte",
                  val_fraction=0.1, source="test excerpts")
    return out


@pytest.fixture(scope="session")
def bpe_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe_data")
    write_dataset(out, read_documents(TRAIN_TEXTS), None, tokenizer="bpe", vocab_size=512,
                  val_fraction=0.1, source="test excerpts")
    return out


def processes_of_run(run_dir: Path) -> list[int]:
    """PIDs of live processes of a launch of ``run_dir``: those whose command line names it (the
    launcher, the store), its forked node processes and their supervisors (:func:`node_pids`)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(run_dir).encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    forked = list(node_pids(run_dir).values()) + list(node_pids(run_dir, "supervisor*.log").values())
    return pids + [p for p in forked if p not in pids]


def launch_in_a_process(job_path: Path, capture: bool = False) -> subprocess.Popen:
    """``skiptrain.runtime.launcher.launch`` of the saved job in a process of its own (so the test
    can signal or kill the launcher); it prints ``interrupted`` or ``finished`` at the end.  With
    ``capture`` stdout and stderr are pipes (read them with ``communicate``), else discarded."""
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-c", "from skiptrain.runtime.job import Job; "
                             "from skiptrain.runtime.launcher import launch; "
                             f"r = launch(Job.load({str(job_path)!r}), timeout_s=300); "
                             "print('interrupted' if r.interrupted else 'finished')"],
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
                            stdout=out, stderr=out, text=True)


def wait_for(cond, seconds: float = 120) -> None:
    """Poll ``cond()`` until it holds (asserts it does within ``seconds``)."""
    deadline = time.time() + seconds
    while time.time() < deadline and not cond():
        time.sleep(0.05)
    assert cond()


def metrics_lines(run: Path) -> int:
    m = run / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


class FakeStore(dict):
    """A store's key-value calls (``check``, ``get``, ``set``) over a dict, values as written."""

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, k):
        return dict.__getitem__(self, k).encode()

    def set(self, k, v):
        self[k] = v


def tensorboard_tags(logdir) -> tuple[set, dict]:
    """Scalar tags and text entries of the event files under ``logdir``, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    texts = {t: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(t)] for t in tags["tensors"]}
    return set(tags["scalars"]), texts
