"""The command-line swarm path (`skiptrain launch` / `train --nodes N`, what `make demo` runs)."""

import json

from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.cli import main


def test_launch_swarm_leaves_a_complete_run_directory(byte_data, tmp_path):
    out = tmp_path / "swarm"
    assert main(["launch", "--preset", "tiny", "--data", str(byte_data), "--out", str(out), "--nodes", "6",
                 "--set", "runtime.stage_sizes=2,2,1,1", "--skip-ratio", "0.5", "--steps", "3"]) == 0
    summary = json.loads((out / "run.json").read_text())
    assert summary["step"] == 3 and summary["nodes"] == 6
    for f in ("metrics.jsonl", "loss.png", "gantt.png", "model.safetensors", "schedule.json", "config.toml"):
        assert (out / f).is_file(), f
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    assert latest == "step-00000003"
    assert CheckpointReader(out / "checkpoints" / latest).verify() > 0
    # the run is usable afterwards
    assert main(["eval", str(out), "--batches", "1", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["val_loss"] > 0
