import json
import time

from skiptrain.runtime.progress import SwarmProgress


def test_progress_follows_metrics_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    with SwarmProgress(path, total_steps=3, poll_s=0.02) as prog:
        with open(path, "a") as f:
            f.write(json.dumps({"phase": "train", "step": 1, "loss": 5.0, "tokens": 100}) + "\n")
            f.write(json.dumps({"step": 1, "val_loss": 4.0}) + "\n")  # not an iteration line
            f.write(json.dumps({"phase": "train", "step": 2, "loss": 4.5, "tokens": 200}) + "\n")
            f.write('{"phase": "train", "st')  # half-written line: read once it is complete
            f.flush()
            time.sleep(0.2)
            assert prog.done == 2
            f.write('ep": 3, "loss": 4.0, "tokens": 300}\n')
        deadline = time.time() + 5
        while prog.done < 3 and time.time() < deadline:
            time.sleep(0.02)
    assert prog.done == 3
