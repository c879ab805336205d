"""Shared fixtures: small real-text data sets built from the excerpts in tests/data (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skiptrain.data.corpus import read_documents
from skiptrain.data.dataset import write_dataset

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
    """PIDs of live processes whose command line names ``run_dir`` (node processes of a launch)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(run_dir).encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids
