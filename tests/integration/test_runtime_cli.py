"""The command-line swarm path (`skiptrain launch` / `train --nodes N`, what `make demo` runs).

The units (no process started) are in tests/unit/test_runtime_cli_units.py."""

import json

import pytest

from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.cli import main


def test_launch_swarm_leaves_a_complete_run_directory(byte_data, tmp_path):
    out = tmp_path / "swarm"
    assert main(["launch", "--preset", "tiny", "--data", str(byte_data), "--out", str(out), "--nodes", "6",
                 "--set", "runtime.stage_sizes=2,2,1,1", "--skip-ratio", "0.5", "--steps", "3"]) == 0
    summary = json.loads((out / "run.json").read_text())
    assert summary["step"] == 3 and summary["nodes"] == 6 and summary["membership"] == []
    times = [json.loads(x)["time"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(times) >= 4 and times == sorted(times) and times[-1] - times[0] < summary["seconds"]
    for f in ("metrics.jsonl", "loss.png", "gantt.png", "model.safetensors", "schedule.json", "config.toml"):
        assert (out / f).is_file(), f
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    assert latest == "step-00000003"
    assert CheckpointReader(out / "checkpoints" / latest).verify() > 0
    # the run is usable afterwards
    assert main(["eval", str(out), "--batches", "1", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["val_loss"] > 0
    # its checkpoint continues in another run directory (whose metrics hold only the new steps)
    again = tmp_path / "again"
    assert main(["launch", "--preset", "tiny", "--data", str(byte_data), "--out", str(again), "--nodes", "6",
                 "--set", "runtime.stage_sizes=2,2,1,1", "--skip-ratio", "0.5", "--steps", "4",
                 "--resume", str(out / "checkpoints" / latest)]) == 0
    assert json.loads((again / "run.json").read_text())["step"] == 4 and (again / "gantt.png").is_file()


def test_launch_with_recover_checkpoints_the_job_and_cleans_the_join_secret(byte_data, tmp_path):
    out = tmp_path / "swarm"
    assert main(["launch", "--preset", "tiny", "--data", str(byte_data), "--out", str(out), "--nodes", "5",
                 "--set", "runtime.stage_sizes=2,1,1,1", "--steps", "2", "--recover", "--heartbeat-deadline", "8",
                 "--strikes", "2", "--ckpt-every", "1"]) == 0
    job = json.loads((out / "job.json").read_text())
    rt = job["config"]["runtime"]
    assert rt["recover"] and rt["heartbeat_deadline_s"] == 8 and rt["strikes"] == 2
    assert job["config"]["checkpoint"]["every"] == 1
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "step-00000002"
    assert {p.name for p in (out / "checkpoints").glob("step-*")} == {"step-00000001", "step-00000002"}
    assert not (out / "join_secret").exists() and not (out / "join.json").exists()   # run over: no joining
    assert json.loads((out / "run.json").read_text())["step"] == 2


class _Garbage:
    """A server on 127.0.0.1 that is not a run's store: ``kind`` "bytes" writes random bytes to whoever
    connects, "http" is an HTTP server, "silent" accepts and never answers."""

    def __init__(self, kind: str):
        import http.server
        import os
        import socketserver
        import threading

        class Bytes(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    self.request.sendall(os.urandom(4096))
                    self.request.recv(4096)
                except OSError:
                    pass

        class Silent(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    while self.request.recv(4096):
                        pass
                except OSError:
                    pass

        handler = {"bytes": Bytes, "http": http.server.SimpleHTTPRequestHandler, "silent": Silent}[kind]
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.mark.parametrize("kind", ["bytes", "http", "silent"])
def test_joining_a_port_where_something_else_answers_is_one_line_within_seconds(tmp_path, kind):
    """Something else listens at the port (a wrong port, another service): one line within seconds, whether
    it answers garbage ("bytes": not the store client's 30 s of retries, each logged with a C++ stack) or
    reads and never answers ("http", "silent": not a store client waiting for good)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    (tmp_path / "s").write_text("x")
    server = _Garbage(kind)
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "skiptrain.cli", "launch", "--join", f"127.0.0.1:{server.port}",
                            "--join-secret-file", str(tmp_path / "s")], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60, env={**os.environ, "SKIPTRAIN_JOIN_SECRET": "",
                                                          "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        took = time.monotonic() - t0
    finally:
        server.close()
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert f"127.0.0.1:{server.port} accepts connections but does not answer as a run's store" in err[0], err
    assert took < 15, took
