"""Trainer integration: periodic async saves, and `train --resume` continuing the exact loss curve."""

from __future__ import annotations

import json

import pytest

from skiptrain.checkpoint import store
from skiptrain.checkpoint.format import CheckpointCorruptError
from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.cli import main
from skiptrain.config import build_config
from skiptrain.train.trainer import Trainer


def _cfg(data, **ckpt):
    # skip training (routes drawn from the route RNG) so resumption must restore that RNG too
    return build_config("tiny", overrides={
        "data": {"path": str(data)},
        "train": {"steps": 16, "eval_every": 0, "progress": False, "skip_ratio": 0.34, "max_swaps": 1},
        "checkpoint": {"every": 4, "keep": 2, **ckpt}})


def _losses(run) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.mark.slow
def test_resume_continues_the_same_loss_curve(byte_data, tmp_path):
    full = Trainer(_cfg(byte_data), tmp_path / "full")
    full.fit()
    ref = _losses(tmp_path / "full")
    assert sorted(ref) == list(range(1, 17))
    # periodic saves, keep 2, final save at the end
    assert [s for s, _ in store.list_committed(tmp_path / "full" / "checkpoints")] == [12, 16]

    # an interrupted run: stops after step 10 with no final save -> latest checkpoint is step 8
    part = Trainer(_cfg(byte_data, final=False), tmp_path / "part")
    part.fit(steps=10)
    assert store.latest(tmp_path / "part" / "checkpoints").name == "step-00000008"
    st = CheckpointReader(tmp_path / "part" / "checkpoints").state
    assert st["data"]["cursor"] == 8 * 16 and st["step"] == 8 and "routes" in st["rng"]

    rc = main(["train", "--preset", "tiny", "--data", str(byte_data), "--out", str(tmp_path / "part"),
               "--quiet", "--resume", "--set", "train.steps=16", "--set", "train.eval_every=0",
               "--set", "train.skip_ratio=0.34", "--set", "train.max_swaps=1", "--set", "checkpoint.every=4",
               "--set", "checkpoint.keep=2"])
    assert rc == 0
    got = _losses(tmp_path / "part")
    assert sorted(got) == list(range(1, 17))  # steps 9, 10 of the interrupted run were replaced
    assert got == ref
    assert CheckpointReader(tmp_path / "part" / "checkpoints").step == 16


def test_resume_from_corrupt_latest_offers_previous(byte_data, tmp_path, capsys):
    tr = Trainer(_cfg(byte_data), tmp_path / "run")
    tr.fit(steps=8)
    root = tmp_path / "run" / "checkpoints"
    r = CheckpointReader(root)
    s = r.meta.tensors["tok_emb.weight"].shards[0]
    with open(r.path / s.file, "r+b") as f:
        f.seek(s.byte_offset + 8)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointCorruptError) as ei:
        Trainer(_cfg(byte_data), tmp_path / "run").resume()
    assert ei.value.previous.endswith("step-00000004") and ei.value.tensor == "tok_emb.weight"
    # on the command line the same problem is one line
    rc = main(["train", "--preset", "tiny", "--data", str(byte_data), "--out", str(tmp_path / "run"),
               "--quiet", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "tok_emb.weight" in err and "step-00000004" in err
    # the offered checkpoint works (a new branch: the damaged step moves aside)
    t2 = Trainer(_cfg(byte_data), tmp_path / "run")
    t2.resume(ei.value.previous)
    assert t2.step == 4 and t2.loader.cursor == 4 * 16
