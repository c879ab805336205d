"""Watching a run from its run directory (skiptrain.watch): node states, bad input lines, the
live files the nodes write, the dashboard's server and the TensorBoard writer (no process started)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

import pytest

from conftest import tensorboard_tags
from skiptrain.cli import main
from skiptrain.errors import UserError
from skiptrain.runtime.event_log import LOG_NAME
from skiptrain.runtime.lease import LeaseTable, Renewal
from skiptrain.runtime.live import LiveRecord, common_iteration, load_live_records
from skiptrain.runtime.swarm_view import SwarmSnapshot, host_of_hello
from skiptrain.train.metrics import read_metrics
from skiptrain.watch.ideas import freezing
from skiptrain.watch.server import make_server, parse_bind
from skiptrain.watch.state import node_state, nodes_view, run_state, run_status


def node(status, age=0.1, lease=30.0):
    return {"node": 0, "status": status, "lease_age_s": age, "lease_s": lease}


def test_node_states_from_the_watchers_status_and_the_lease_age():
    assert node_state(node("alive"), 0.5) == "training"
    assert node_state(node("alive", age=2.5), 0.5) == "suspected"      # four heartbeats without a renewal
    assert node_state(node("alive", age=1.0), 0.5, lag_s=1.5) == "suspected"   # swarm.json itself is old
    for s in ("fenced", "failed", "joining", "done"):
        assert node_state(node(s, age=99.0), 0.5) == s
    assert node_state(node("alive", age=None), 0.5) == "training"


def test_nodes_without_a_swarm_file_come_from_the_schedule():
    placement = [[0, 2], [1], [3]]
    v = nodes_view(None, [{"rank": 1, "iteration": 7}], placement, over=False, now=0.0)
    assert [(n["node"], n["stages"], n["state"]) for n in v] == [(0, [0], "starting"), (1, [1], "starting"),
                                                                 (2, [0], "starting"), (3, [2], "starting")]
    assert v[1]["last_iteration"] == 7
    assert {n["state"] for n in nodes_view(None, [], placement, over=True, now=0.0)} == {"done"}


def write_run(run, rows, recoveries=(), swarm=None):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(rows))
    (run / LOG_NAME).write_text("".join(recoveries))
    if swarm is not None:
        (run / "swarm.json").write_text(json.dumps(swarm))
    (run / "job.json").write_text(json.dumps({"phases": [{"name": "train", "iterations": 10}]}))


ROWS = [json.dumps({"phase": "train", "step": i, "time": 100.0 + i, "loss": 5.0 - i / 10, "tokens": 64 * i,
                    "iteration_s": 0.1, "gen": 0 if i < 3 else 1, "nodes": 2}) + "\n" for i in (1, 2, 3)]
SWARM = {"t": 1000.0, "gen": 1, "mode": "recover", "heartbeat_s": 0.5, "done": False,
         "nodes": [{"node": 0, "host": "h0", "stages": [0], "status": "alive", "lease_age_s": 0.2, "lease_s": 5.0,
                    "gen": 1},
                   {"node": 1, "host": "h1", "stages": [1], "status": "fenced", "lease_age_s": 9.0, "lease_s": 5.0,
                    "gen": 0}]}


def test_half_written_and_bad_lines_are_skipped_not_raised(tmp_path):
    run = tmp_path / "run"
    failed = json.dumps({"gen": 1, "node": 1, "cause": "died (killed by SIGKILL)", "t_detect": 102.5}) + "\n"
    write_run(run, ROWS + ['{"phase": "train", "step": 4, "lo'], ["not json\n", failed, "[1, 2]\n"], SWARM)
    (run / "elastic.jsonl").write_text('{"step": 2, "action": "transition", "frozen_before": 0, "frozen_after": 2}\n{"ste')
    st = run_state(run, now=1001.0)
    assert st["status"] == "running" and st["iterations_done"] == 3 and st["iterations_total"] == 10
    assert [(n["node"], n["state"], n["host"]) for n in st["nodes"]] == [(0, "training", "h0"), (1, "fenced", "h1")]
    assert [(e["kind"], e["node"]) for e in st["membership"]] == [("failed", 1)]
    kinds = {e["kind"]: e for e in st["events"]}
    assert kinds["failed"]["tokens"] == 128            # at the last row before its time
    assert kinds["replan"]["step"] == 3 and kinds["freeze"]["step"] == 2
    assert st["ideas"]["freezing"]["frozen_layers"] == 2
    assert read_metrics(run / "metrics.jsonl", live=True)[-1]["step"] == 3
    with pytest.raises(ValueError):
        read_metrics(run / "metrics.jsonl")           # (a finished run's file is read strictly)


def test_the_run_status_says_starting_stalled_and_finished(tmp_path):
    assert run_status(tmp_path, None, None, has_job=False, now=0.0)[0] == "starting"
    assert run_status(tmp_path, None, None, False, 0.0, [{"step": 1, "loss": 3.0}])[0] == "running"  # one process
    assert run_status(tmp_path, SWARM, None, True, now=1005.0)[0] == "running"
    status, line = run_status(tmp_path, SWARM, None, True, now=1100.0)
    assert status == "stalled" and "may have died" in line
    assert run_status(tmp_path, SWARM, {"step": 9, "val_loss": 2.0}, True, 0.0)[0] == "finished"
    assert run_status(tmp_path, SWARM, {"step": 4, "interrupted": True}, True, 0.0)[0] == "interrupted"
    empty = tmp_path / "new"
    empty.mkdir()
    st = run_state(empty)
    assert st["status"] == "starting" and st["nodes"] == [] and st["loss"] == []


def test_a_missing_run_dir_is_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="does not exist"):
        run_state(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        run_state(tmp_path / "f")
    assert main(["status", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err


def test_live_records_are_written_once_a_window_and_agree_on_an_iteration(tmp_path):
    out = tmp_path / "phases" / "train"
    out.mkdir(parents=True)
    recs = [LiveRecord(r, every_s=1.0) for r in (0, 1)]
    for it, t0 in ((1, 10.1), (2, 10.6), (3, 11.2), (4, 11.7)):
        for rec in recs:
            wrote = rec.after_iteration(out, [rec.rank], it, {"t0": t0, "events": [], "samples": [1, 2],
                                                              "sync": {"payload": 10, "dense": 40}})
            assert wrote == (it in (1, 3))
    recs[0].after_iteration(out, [0], 5, {"t0": 11.9, "events": []}, cache_hits=12)    # (an originator's cache)
    recs[0].flush()                      # (a phase's end: node 0's last iteration written)
    (out / "live_node2.json").write_text('{"rank": 2, "iter')      # half written: left out
    got = load_live_records(tmp_path, "train")
    assert [r["rank"] for r in got] == [0, 1]
    assert got[0]["iteration"] == 5 and got[1]["iteration"] == 3 and got[0]["totals"]["dense_fp32_bytes"] == 160
    assert freezing([], got)["cache_hits"] == 12
    assert "samples" not in got[0]["iterations"][0]
    it, one = common_iteration(got)
    assert it == 3 and len(one) == 2
    assert common_iteration([]) == (None, [])


def test_the_swarm_snapshot_names_hosts_stages_and_leases(tmp_path):
    leases = LeaseTable(5.0, 30.0, clock=lambda: 100.0)
    leases.watch(0)
    leases.observe(0, Renewal("a", 1, 2, "run", 7.0))
    view = SwarmSnapshot(tmp_path, "recover", 0.5, clock=lambda: 0.0)
    view.placement, view.hosts = [[0], [1]], {0: "gpu-box"}
    view.write(2, [view.node(0, "alive", leases), view.node(1, "alive", None)])
    view.placement = [[0]]
    n1 = view.node(1, "fenced", None)
    snap = json.loads((tmp_path / "swarm.json").read_text())
    assert snap["gen"] == 2 and snap["nodes"][0] == {"node": 0, "host": "gpu-box", "stages": [0], "status": "alive",
                                                     "lease_age_s": 0.0, "lease_s": 7.0, "gen": 2}
    assert n1["stages"] == [1]           # a fenced node keeps the stages it served last
    assert host_of_hello('{"t": 1, "host": "h"}') == "h" and host_of_hello("{") is None and host_of_hello(None) is None


def test_bind_and_a_port_in_use_are_one_line_errors(tmp_path):
    assert parse_bind("127.0.0.1:9") == ("127.0.0.1", 9) and parse_bind(":0") == ("127.0.0.1", 0)
    with pytest.raises(UserError, match="HOST:PORT"):
        parse_bind("localhost:http")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(UserError, match="is in use"):
            make_server(tmp_path, f"127.0.0.1:{s.getsockname()[1]}")
    with pytest.raises(UserError, match="does not exist"):
        make_server(tmp_path / "nope", "127.0.0.1:0")


def test_the_server_serves_the_page_its_files_and_the_state(tmp_path):
    run = tmp_path / "run"
    write_run(run, ROWS, swarm=SWARM)
    server = make_server(run, "127.0.0.1:0")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        page = urllib.request.urlopen(base + "/").read().decode()
        assert '<script src="/app.js">' in page and "http" not in page.replace('"http://www.w3', "")
        js = urllib.request.urlopen(base + "/app.js").read().decode()
        assert "fetch(\"/state.json\"" in js and "https://" not in js
        st = json.loads(urllib.request.urlopen(base + "/state.json").read())
        assert [n["node"] for n in st["nodes"]] == [0, 1] and st["iterations_done"] == 3
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(base + "/etc/passwd")
    finally:
        server.shutdown()
        server.server_close()


def test_tensorboard_event_files_hold_the_runs_scalars_and_membership_events(tmp_path):
    from skiptrain.watch.tensorboard_log import TB_DIR, TensorBoardLog

    run = tmp_path / "run"
    rows = [json.dumps({"phase": "train", "step": i, "time": 100.0 + i, "loss": 5.0 - i / 10, "tokens": 64 * i,
                        "lr": 0.001 * i, "iteration_s": 0.1, "comm_s": 0.01, "payload_bytes": 100}) + "\n"
            for i in (1, 2, 3)] + [json.dumps({"phase": "train", "step": 3, "val_loss": 4.2, "tokens": 192}) + "\n"]
    failed = json.dumps({"gen": 1, "node": 1, "cause": "died (killed by SIGKILL)", "t_detect": 102.5}) + "\n"
    write_run(run, rows, [failed])
    out = run / "phases" / "train"
    out.mkdir(parents=True)
    LiveRecord(0).after_iteration(out, [0], 3, {"t0": 1.0, "events": [], "ckpt_s": 0.2,
                                                "sync": {"payload": 100, "dense": 400}})
    tb = TensorBoardLog(run)
    tb.write_new()
    (run / "metrics.jsonl").write_text("".join(rows) + '{"phase": "tr')        # (half written: not read)
    tb.close()
    scalars, texts = tensorboard_tags(run / TB_DIR)
    assert {"loss/train", "loss/val", "lr", "tokens_per_s", "time/iteration_s", "time/comm_s",
            "time/checkpoint_stall_s", "bytes/dp_payload", "bytes/dp_dense_fp32"} <= scalars
    assert any("node 1: failed" in t for t in texts["membership/text_summary"])
