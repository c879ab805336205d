"""The command-line swarm path (`skiptrain launch` / `train --nodes N`, what `make demo` runs).

Here the units, which start no process; the tests that start processes are in
tests/integration/test_runtime_cli.py."""

import pytest

from skiptrain.cli import main


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
