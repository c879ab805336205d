"""A node's outputs reach the coordinator's run directory through its file server, only as the
node's signed manifest says, and metrics rows are mirrored as they come; a supervisor refuses bad input in one
line (a coordinator that never answers, a data set that is not the job's, an address no peer can
reach).  In-process stores only: nothing here starts a process."""

from __future__ import annotations

import json
import socket

import pytest

from skiptrain.errors import UserError
from skiptrain.runtime.addresses import AddressError, check_advertised, interface_of, route_address
from skiptrain.runtime.checkpoint_relay import open_file_server
from skiptrain.runtime.membership import Verifier, coordinator_key, member_key, sign
from skiptrain.runtime.shipping import RowMirror, collect_outputs, publish_row, ship_outputs

SECRET = "s3cret"


@pytest.fixture
def files(store, tmp_path):
    """The coordinator's file server, taking outputs under ``tmp_path/received``."""
    server = open_file_server(store, SECRET, {}, tmp_path / "received")
    yield server
    server.close()


def _ship(store, node, root):
    return ship_outputs(store, member_key(SECRET, node), coordinator_key(SECRET), node, root)


def _node_dir(root, rows, weights=b"w" * 100):
    (root / "parts").mkdir(parents=True)
    (root / "parts" / "stage1.safetensors").write_bytes(weights)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "big.bin").write_bytes(b"x")        # stays on the host
    return root


def test_outputs_arrive_as_the_signed_manifest_says_and_metrics_merge_in_step_order(store, files, tmp_path):
    a = _node_dir(tmp_path / "a", [{"step": 1, "loss": 3.0}, {"step": 3, "loss": 2.0}])
    b = _node_dir(tmp_path / "b", [{"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.0}], weights=b"v" * 10)
    assert _ship(store, 0, a) == 100 + len((a / "metrics.jsonl").read_bytes())
    _ship(store, 1, b)
    assert sorted(p.relative_to(files.outputs).as_posix() for p in files.outputs.rglob("*.*")) == \
        ["0/metrics.jsonl", "0/parts/stage1.safetensors", "1/metrics.jsonl", "1/parts/stage1.safetensors"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")    # mirrored already
    taken = collect_outputs(store, Verifier(SECRET), [0, 1, 2], run, files.outputs)
    assert taken == {0: 2, 1: 2, 2: 0}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]                  # each row once, by step
    assert (run / "parts" / "stage1.safetensors").read_bytes() == b"v" * 10        # (the later node's)
    assert not (run / "checkpoints").exists()


def test_a_file_changed_after_it_arrived_or_a_forged_manifest_is_refused(store, files, tmp_path, capsys):
    a = _node_dir(tmp_path / "a", [{"step": 1}])
    _ship(store, 0, a)
    (files.outputs / "0" / "parts" / "stage1.safetensors").write_bytes(b"evil")
    store.set("out/1", json.dumps({"parts/stage9.safetensors": "0" * 64}))    # no tag: not node 1's
    (files.outputs / "1" / "parts").mkdir(parents=True)
    (files.outputs / "1" / "parts" / "stage9.safetensors").write_bytes(b"evil")
    run = tmp_path / "run"
    run.mkdir()
    taken = collect_outputs(store, Verifier(SECRET), [0, 1], run, files.outputs)
    assert taken == {0: 1, 1: 0}
    assert not (run / "parts").exists()
    assert "do not match the node's signed manifest" in capsys.readouterr().err


def test_an_upload_is_taken_only_signed_by_its_node_and_with_the_bytes_its_signed_digest_names(files, tmp_path):
    import hashlib
    import http.client

    from skiptrain.runtime.file_channel import put_output, upload_signed
    from skiptrain.runtime.membership import tag

    src = tmp_path / "metrics.jsonl"
    src.write_bytes(b"{}\n")
    with pytest.raises(OSError, match="403"):
        put_output(files.address, member_key(SECRET, 3), 2, "metrics.jsonl", src)      # another node's key
    path, digest = "/out/2/metrics.jsonl", hashlib.sha256(b"{}\n").hexdigest()
    conn = http.client.HTTPConnection(*files.address, timeout=10)
    conn.request("PUT", path, body=b"{}\r", headers={            # signed, but other bytes (a replay)
        "Content-Length": "3", "X-Skiptrain-Node": "2", "X-Skiptrain-Sha256": digest,
        "X-Skiptrain-Sig": tag(member_key(SECRET, 2), "PUT", upload_signed("", path, digest))})
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (400, b"the bytes do not match their signed digest")
    conn.close()
    assert not (files.outputs / "2").exists() or not list((files.outputs / "2").rglob("*"))
    for rel in ("../escape.txt", "a/b/c/d.json", ".hidden/../x"):
        with pytest.raises(OSError, match="400"):
            put_output(files.address, member_key(SECRET, 2), 2, rel, src)
    assert put_output(files.address, member_key(SECRET, 2), 2, "metrics.jsonl", src) == digest
    assert (files.outputs / "2" / "metrics.jsonl").read_bytes() == b"{}\n"


def test_a_manifest_cannot_write_outside_the_run_directory(store, files, tmp_path):
    name = "out/0"
    data = b"x"
    import hashlib
    rel = "phases/../../escape.txt"                     # (it matches the pattern phases/*)
    (files.outputs / "0" / "phases").mkdir(parents=True)
    (files.outputs / "escape.txt").write_bytes(data)     # (where the path leads inside the received folder)
    store.set(name, sign(member_key(SECRET, 0), name, json.dumps({rel: hashlib.sha256(data).hexdigest()})))
    run = tmp_path / "run"
    run.mkdir()
    assert collect_outputs(store, Verifier(SECRET), [0], run, files.outputs) == {0: 0}
    assert not (tmp_path / "escape.txt").exists() and (files.outputs / "escape.txt").exists()


def test_an_upload_signed_for_another_run_of_the_same_secret_is_refused(store, tmp_path):
    from skiptrain.runtime.file_channel import put_output

    server = open_file_server(store, SECRET, {}, tmp_path / "received", run="run-b")
    src = tmp_path / "metrics.jsonl"
    src.write_bytes(b"{}\n")
    with pytest.raises(OSError, match="403"):
        put_output(server.address, member_key(SECRET, 1), 1, "metrics.jsonl", src, run="run-a")   # (a replay)
    put_output(server.address, member_key(SECRET, 1), 1, "metrics.jsonl", src, run="run-b")
    assert (tmp_path / "received" / "1" / "metrics.jsonl").read_bytes() == b"{}\n"
    server.close()


def test_a_supervisor_keeps_sending_outputs_until_a_coordinator_takes_them(store, tmp_path, monkeypatch, byte_data):
    """The coordinator is away (no file server) when the node ends; one comes a second later."""
    import threading

    from skiptrain.runtime.agent import AgentOptions, NodeAgent
    from skiptrain.runtime.job import Job
    from skiptrain.runtime.join import SECRET_ENV, publish_job
    from skiptrain.runtime.shipping import shipped

    monkeypatch.setenv(SECRET_ENV, SECRET)
    job = Job(config={}, data_path=str(byte_data), run_dir=str(tmp_path), phases=[], meta={"run_id": "r1"})
    publish_job(store, job.to_dict(), SECRET)
    store.add("nodes/next", 4)                            # (a run that admits nodes: ids 0-3 taken)
    agent = NodeAgent(AgentOptions(f"127.0.0.1:{store.port}", SECRET, tmp_path, wait_s=30))
    agent.run_dir = _node_dir(tmp_path / "node3", [{"step": 1}])
    servers = []
    later = threading.Timer(1.0, lambda: servers.append(open_file_server(store, SECRET, {}, tmp_path / "in", run="r1")))
    later.start()
    agent.deliver(store, 3, 0, job)
    later.join()
    assert sorted(shipped(store, Verifier(SECRET), 3)) == ["metrics.jsonl", "parts/stage1.safetensors"]
    assert (tmp_path / "in" / "3" / "parts" / "stage1.safetensors").read_bytes() == b"w" * 100
    servers[0].close()


def test_the_wait_for_outputs_lasts_while_their_uploads_bring_bytes(store):
    import time

    from skiptrain.runtime.shipping import wait_shipped

    until = time.monotonic() + 0.6
    t0 = time.monotonic()
    assert wait_shipped(store, Verifier(SECRET), [4], 0.1, sending=lambda nodes: time.monotonic() < until) == {4}
    assert time.monotonic() - t0 >= 0.6


def test_metrics_rows_are_mirrored_as_they_come_and_forged_rows_dropped(store, tmp_path):
    path = tmp_path / "metrics.jsonl"
    mirror = RowMirror(store, Verifier(SECRET), tmp_path)
    publish_row(store, member_key(SECRET, 2), 2, json.dumps({"step": 1}))
    mirror.poll()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1]
    i = int(store.add("metrics/n", 1)) - 1
    store.set(f"metrics/{i}", json.dumps({"node": 2, "row": json.dumps({"step": 99})}))     # no tag
    publish_row(store, member_key(SECRET, 3), 3, json.dumps({"step": 2}))
    mirror.poll()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def test_a_second_recovered_row_of_an_iteration_is_dropped(store, tmp_path):
    """Rank 0 wrote an iteration's row and died before the next boundary; the new rank 0,
    which did not see it, sends a ``recovered`` row of the same iteration: one row stays."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"phase": "train", "step": 1, "loss": 3.0}) + "\n")    # (from before a restart)
    mirror = RowMirror(store, Verifier(SECRET), tmp_path)
    key = member_key(SECRET, 2)
    for row in ({"phase": "train", "step": 1, "recovered": True}, {"phase": "train", "step": 2, "loss": 2.0},
                {"phase": "train", "step": 2, "recovered": True}, {"phase": "train", "step": 2, "val_loss": 2.5},
                {"phase": "train", "step": 3, "recovered": True}):
        publish_row(store, key, 2, json.dumps(row))
    mirror.poll()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["step"], "recovered" in r, "val_loss" in r) for r in rows] == \
        [(1, False, False), (2, False, False), (2, False, True), (3, True, False)]


def test_sample_log_rows_are_mirrored_into_the_senders_own_file_only(store, tmp_path):
    mirror = RowMirror(store, Verifier(SECRET), tmp_path)
    key = member_key(SECRET, 3)
    publish_row(store, key, 3, '{"iteration": 0}', "phases/train/samples_node3.jsonl")
    for bad in ("phases/train/samples_node4.jsonl", "phases/../samples_node3.jsonl", "phases/a/b/samples_node3.jsonl",
                "config.toml", "../metrics.jsonl"):
        publish_row(store, key, 3, '{"iteration": 9}', bad)
    mirror.poll()
    assert (tmp_path / "phases" / "train" / "samples_node3.jsonl").read_text() == '{"iteration": 0}\n'
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == \
        ["phases/train/samples_node3.jsonl"]


def test_addresses_a_node_may_not_advertise():
    assert route_address("127.0.0.1", 9) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(AddressError, match="no network interface of this host has the address 192.0.2.254"):
        interface_of("192.0.2.254")
    check_advertised("127.0.0.1", "127.0.0.1")                     # a coordinator on loopback: fine
    with pytest.raises(AddressError, match="loopback address 127.0.0.1, which its peers on other hosts cannot"):
        check_advertised("127.0.0.1", "192.0.2.1")


def test_a_node_supervisor_refuses_bad_input_in_one_line(tmp_path, byte_data):
    from skiptrain.runtime.agent import AgentOptions, NodeAgent
    from skiptrain.runtime.job import Job

    with socket.socket() as s:                                     # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = NodeAgent(AgentOptions(f"127.0.0.1:{port}", SECRET, tmp_path, wait_s=0.5))
    with pytest.raises(UserError, match=f"no coordinator answered at 127.0.0.1:{port} within 0.5 s"):
        agent.connect()
    job = Job(config={}, data_path=str(byte_data), run_dir=str(tmp_path), phases=[],
              meta={"data_fingerprint": "f" * 64})
    with pytest.raises(UserError, match="is not the job's .*point --data at it"):
        agent.prepare(job)


def test_an_advertised_address_from_which_the_coordinator_is_unreachable_is_refused():
    from skiptrain.runtime.addresses import check_reachable

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        check_reachable("127.0.0.1", "127.0.0.1", port)
        with socket.socket() as closed:      # nothing listens: refused, so the host answered from there (a
            closed.bind(("127.0.0.1", 0))    # store being replaced): the address routes
            check_reachable("127.0.0.2", "127.0.0.1", closed.getsockname()[1], timeout_s=1.0)
        with pytest.raises(AddressError, match="cannot be reached from 127.0.0.2 .*--advertise"):
            check_reachable("127.0.0.2", "192.0.2.1", port, timeout_s=0.5)     # (no route from loopback there)


def test_only_a_nodes_outputs_are_taken(store, tmp_path, capsys):
    import hashlib

    files = {"": b"x", "run.json": b"{}", "join_secret": b"s", "recoveries.jsonl": b"{}\n",
             "phases/train/node0.json": b"{}", "../escape.txt": b"x"}
    received = tmp_path / "received"
    for rel, data in files.items():
        if rel and ".." not in rel:
            (received / "0" / rel).parent.mkdir(parents=True, exist_ok=True)
            (received / "0" / rel).write_bytes(data)
    manifest = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    store.set("out/0", sign(member_key(SECRET, 0), "out/0", json.dumps(manifest)))
    run = tmp_path / "run"
    run.mkdir()
    assert collect_outputs(store, Verifier(SECRET), [0], run, received) == {0: 1}
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == ["phases/train/node0.json"]
    assert capsys.readouterr().err.count("not one of the outputs a node ships") == 5


def test_rows_are_sent_from_a_thread_of_their_own_and_a_slot_never_written_is_skipped(store, tmp_path, monkeypatch):
    import time

    from conftest import wait_for

    from skiptrain.runtime import shipping

    pub = shipping.RowPublisher("127.0.0.1", store.port, member_key(SECRET, 1), 1)
    pub.put(json.dumps({"step": 1}))
    wait_for(lambda: store.check(["metrics/0"]), 10)
    store.add("metrics/n", 1)                           # slot 1 counted, its writer gone before writing it
    pub.put(json.dumps({"step": 3}))
    wait_for(lambda: store.check(["metrics/2"]), 10)
    path = tmp_path / "metrics.jsonl"
    mirror = RowMirror(store, Verifier(SECRET), tmp_path)
    mirror.poll()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1]     # waits for slot 1
    monkeypatch.setattr(shipping, "GAP_S", 0.0)
    time.sleep(0.01)
    mirror.poll()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 3]


def test_a_coordinator_taking_a_live_run_over_mirrors_from_where_its_predecessor_stopped(store, tmp_path):
    """The position read up to is kept in the store, signed: a second mirror on the same store (a
    coordinator that took the run over) takes the rows sent since, each once, and waits on no slot
    its predecessor read and deleted; a position forged without the secret is ignored."""
    path = tmp_path / "metrics.jsonl"
    key = member_key(SECRET, 2)
    first = RowMirror(store, Verifier(SECRET), tmp_path)
    for step in (1, 2, 3):
        publish_row(store, key, 2, json.dumps({"phase": "train", "step": step}))
    first.poll()
    for step in (4, 5):
        publish_row(store, key, 2, json.dumps({"phase": "train", "step": step}))
    second = RowMirror(store, Verifier(SECRET), tmp_path)      # (the first one died here)
    assert second.slots.next == 3
    second.poll()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert not any(store.check([f"metrics/{i}"]) for i in range(5))     # read once, then deleted
    store.set("coord/slots/metrics", "0")                                 # no tag: not the coordinator's
    assert RowMirror(store, Verifier(SECRET), tmp_path).slots.next == 0
    store.set("coord/slots/metrics", sign(member_key(SECRET, -1), "coord/slots/metrics", "5"))
    assert RowMirror(store, Verifier(SECRET), tmp_path).slots.next == 5
