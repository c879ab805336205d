"""The command-line swarm path (`skiptrain launch` / `train --nodes N`, what `make demo` runs)."""

import json

import pytest

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


def test_launch_failure_flags_give_clear_errors(byte_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SKIPTRAIN_JOIN_SECRET", "")          # restored afterwards (--join sets it)
    assert main(["launch", "--preset", "tiny", "--data", str(byte_data), "--out", str(tmp_path / "x"),
                 "--nodes", "5", "--takeover"]) != 0
    assert "--takeover needs --recover" in capsys.readouterr().err
    assert main(["launch", "--join", "127.0.0.1:1", "--join-secret-file", str(tmp_path / "nope")]) != 0
    assert "cannot read the join secret file" in capsys.readouterr().err
    (tmp_path / "s").write_text("x")
    assert main(["launch", "--join", "nohostport", "--join-secret-file", str(tmp_path / "s")]) != 0
    assert "expected HOST:PORT" in capsys.readouterr().err
    assert main(["launch", "--join", "127.0.0.1:99999", "--join-secret-file", str(tmp_path / "s")]) != 0
    assert "with a port in 1..65535" in capsys.readouterr().err


def test_joining_a_closed_port_is_one_line_at_once(tmp_path, capsys, monkeypatch):
    """Nothing listens there (the run is over): one line within a second, not the store client's
    30 s of retries with C++ stack dumps."""
    import socket
    import time

    monkeypatch.setenv("SKIPTRAIN_JOIN_SECRET", "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed again when the block ends
    (tmp_path / "s").write_text("x")
    t0 = time.monotonic()
    assert main(["launch", "--join", f"127.0.0.1:{port}", "--join-secret-file", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert time.monotonic() - t0 < 5
    assert len(err) == 1 and f"no store answers at 127.0.0.1:{port} (Connection refused)" in err[0], err




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
                                                          "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        took = time.monotonic() - t0
    finally:
        server.close()
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert f"127.0.0.1:{server.port} accepts connections but does not answer as a run's store" in err[0], err
    assert took < 15, took


HUGE = ["--set", "model.d_model=65536", "--set", "model.n_heads=256", "--set", "model.n_kv_heads=0",
        "--set", "model.n_layers=1024"]


@pytest.mark.parametrize("cmd", [["launch", "--preset", "tiny"], ["train", "--preset", "tiny"]])
def test_a_swarm_whose_stages_cannot_fit_their_nodes_is_refused_before_any_node_starts(
        byte_data, tmp_path, capsys, monkeypatch, cmd):
    """One line naming the stage, the node's device and the fixes, from the estimate every node
    checks; refused before the cost model profiles a layer of that size, no node process started."""
    import skiptrain.runtime.job as job

    def no_profiling(*a, **k):
        raise AssertionError("the cost model profiled a layer of a model that cannot fit")

    monkeypatch.setattr(job, "profile_s_per_sample_per_layer", no_profiling)
    out = tmp_path / "swarm"
    assert main([*cmd, "--data", str(byte_data), "--out", str(out), "--nodes", "4", "--steps", "2", *HUGE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"skiptrain {cmd[0]}: error: stage " in err[0], err
    assert "does not fit node 0's cpu" in err[0] and "use more stages (model.n_stages)" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("nodes", ["4", "1"])
def test_a_refused_overwrite_keeps_the_run_it_would_replace(byte_data, tmp_path, capsys, nodes):
    """--overwrite deletes the old run only once the new one is known to fit: a refusal loses nothing."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"step": 7}')
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    argv = ["train", "--preset", "tiny", "--data", str(byte_data), "--out", str(out), "--nodes", nodes,
            "--steps", "2", "--overwrite", "--set", "runtime.s_per_sample_layer=0.001", *HUGE]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json"]
    assert (out / "run.json").read_text() == '{"step": 7}'


@pytest.mark.parametrize("nodes", ["4", "1"])
def test_an_overwrite_with_a_missing_data_set_keeps_the_run_it_would_replace(tmp_path, capsys, nodes):
    """--overwrite with a --data that holds no prepared data set: one line naming the path and the
    fix, and the old run is untouched (the trainer checks its inputs before the directory is claimed)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"step": 7}')
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    argv = ["train", "--preset", "tiny", "--data", str(tmp_path / "no-data"), "--out", str(out), "--nodes", nodes,
            "--steps", "2", "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-data" in err[0] and "skiptrain prepare" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json"]
    assert (out / "run.json").read_text() == '{"step": 7}'


def test_a_strike_count_a_bad_node_never_reaches_is_refused_in_one_line(tmp_path, capsys):
    """2**63 strikes would never ban a node that keeps sending bad payloads: the run would re-run
    one iteration until the launch's time limit."""
    out = tmp_path / "x"
    assert main(["launch", "--preset", "tiny", "--out", str(out), "--nodes", "5", "--recover",
                 "--strikes", str(2**63)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"skiptrain launch: error: runtime.strikes={2**63} is above its maximum 100"], err
    assert not out.exists()
