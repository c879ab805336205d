"""Only the run's members can speak in its membership: the store listens on loopback only, and
the coordinator acts only on heartbeats, reports and PIDs signed with a member key; a process that
reaches the store port without the secret can neither get nodes fenced nor get anything signalled.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_membership.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import FakeStore, wait_for
from skiptrain.runtime.lease import Renewal, parse_renewal
from skiptrain.runtime.membership import Verifier, host_store, member_key, open_signed, sign, strip_tag


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                out.append(addr)
    return out


def test_the_store_listens_on_loopback_only():
    store, sock = host_store(1, 5.0)
    assert sock.getsockname()[0] == "127.0.0.1"
    assert _listening_addresses(store.port) == ["0100007F"]     # 127.0.0.1, not 0.0.0.0 / ::
    store.set("k", "v")
    assert store.get("k") == b"v"
    sock.close()


def test_signed_values_verify_only_with_the_writers_key_and_name(tmp_path, capsys):
    k3 = member_key("s3cret", 3)
    beat = Renewal("a1", 4, 0, "run", 3.0).encode()
    raw = sign(k3, "hb/3", beat)
    assert open_signed(k3, "hb/3", raw) == beat and parse_renewal(raw) == Renewal("a1", 4, 0, "run", 3.0)
    assert open_signed(member_key("s3cret", 4), "hb/3", raw) is None      # another node's key
    assert open_signed(member_key("guess", 3), "hb/3", raw) is None       # another secret
    assert open_signed(k3, "hb/4", raw) is None                           # moved to another key
    assert open_signed(k3, "hb/3", beat) is None and strip_tag(raw) == beat
    v = Verifier("s3cret", tmp_path / "rejected.jsonl")
    st = FakeStore({"hb/3": raw, "report/0/3": '{"node": 1}'})
    assert v.read(st, 3, "hb/3") == beat
    assert v.read(st, 3, "report/0/3") is None                            # unsigned: never acted on
    rows = [json.loads(x) for x in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert [r["forged"] for r in rows] == ["report/0/3"]
    assert "ignored a write to report/0/3" in capsys.readouterr().err


def test_nodes_act_only_on_generation_records_the_coordinator_signed():
    from skiptrain.runtime.membership import COORDINATOR
    from skiptrain.runtime.recovery import (GenerationWatch, RecoveryError, generation_record, latest_generation,
                                            publish_generation, read_generation, wait_generation)

    key = member_key("s3cret", COORDINATOR)
    st = FakeStore()
    publish_generation(st, 0, [0, 1, 2], {}, key=key)
    publish_generation(st, 1, [0, 2], {1: "died"}, {"cancelled": []}, key=key)
    assert generation_record(st, 1, key)["alive"] == [0, 2] and read_generation(st, 1, key)["dead"] == {1: "died"}
    plain = json.dumps({"alive": [0], "dead": {}, "t": 0.0})
    for forged in [plain, sign(member_key("s3cret", 0), "gen/2", plain), sign(member_key("guess", COORDINATOR),
                   "gen/2", plain), st["gen/1"], sign(key, "gen/2", "not json"), sign(key, "gen/2", '{"alive": 1}')]:
        st["gen/2"], st["gen"] = forged, "2"                 # unsigned, a node's key, another secret, moved, bad
        assert generation_record(st, 2, key) is None, forged
        assert latest_generation(st, key) == 1
        with pytest.raises(RecoveryError, match="no new membership"):
            wait_generation(st, 1, 0.05, key)
        with pytest.raises(RecoveryError, match="no record signed by the run's coordinator"):
            read_generation(st, 2, key)
    assert generation_record(st, 3, key) is None and latest_generation(FakeStore(), key) == -1
    # the watch neither acts on a forged record nor skips the coordinator's one published after it
    seen: list[int] = []
    w = GenerationWatch(st, 0.01, seen.append, key)
    w.gen = 1
    w.start()
    try:
        time.sleep(0.15)
        assert seen == []
        publish_generation(st, 2, [0], {2: "died"}, key=key)
        wait_for(lambda: seen == [2], seconds=5)
    finally:
        w.stop()
    assert wait_generation(st, 1, 1.0, key)[0] == 2


def test_a_joiner_takes_only_a_signed_job_and_a_signed_placement():
    from skiptrain.runtime.join import (JoinRefused, assign_join, cancel_join, publish_job, read_job,
                                        wait_for_placement)
    from skiptrain.runtime.membership import COORDINATOR
    from skiptrain.runtime.recovery import publish_generation

    st = FakeStore()
    publish_job(st, {"run_dir": "/the/run"}, "s3cret")
    assert read_job(st, "s3cret") == {"run_dir": "/the/run"}
    with pytest.raises(JoinRefused, match="does not verify with this SKIPTRAIN_JOIN_SECRET"):
        read_job(st, "guess")
    with pytest.raises(JoinRefused, match="no join secret"):
        read_job(st, None)
    st["job"] = json.dumps({"run_dir": "/somewhere/else"})       # rewritten by a process without the secret
    with pytest.raises(JoinRefused, match="does not verify"):
        read_job(st, "s3cret")
    key = member_key("s3cret", COORDINATOR)
    st["join/assign/7"] = "3"                                      # unsigned: waited past
    publish_generation(st, 3, [0, 1, 7], {}, {"kind": "join", "join": {"7": 1}}, key=key)
    with pytest.raises(JoinRefused, match="never placed"):
        wait_for_placement(st, 7, "s3cret", 0.1)
    # assigned generation 3, but a failure took that number (the coordinator restarted before it
    # published the join); the restarted one places node 7 in generation 4
    assign_join(st, 7, "s3cret", 3)
    publish_generation(st, 3, [0, 1], {2: "died"}, key=key)

    def replace():
        time.sleep(0.1)
        publish_generation(st, 4, [0, 1, 7], {}, {"kind": "join", "join": {"7": 1}}, key=key)
        assign_join(st, 7, "s3cret", 4)
    th = threading.Thread(target=replace)
    th.start()
    g, rec = wait_for_placement(st, 7, "s3cret", 5.0)
    th.join()
    assert g == 4 and rec["join"] == {"7": 1} and rec["alive"] == [0, 1, 7]
    # a join the coordinator cancelled ends the wait at once, whatever assignment is there
    cancel_join(st, 7, "s3cret", "the run ended before its nodes took this join up")
    t0 = time.time()
    with pytest.raises(JoinRefused, match="join cancelled by the coordinator: the run ended"):
        wait_for_placement(st, 7, "s3cret", 30.0)
    assert time.time() - t0 < 5


def test_a_joiner_accepts_only_a_join_result_the_coordinator_signed():
    from skiptrain.runtime.join import JoinRefused, node_join, read_result, set_result

    forged = FakeStore({"join/nonce/7": "ab" * 32, "join/result/7": "ok"})   # written by a process without the secret
    with pytest.raises(JoinRefused, match="refused by the coordinator"):
        node_join(forged, 7, "s3cret", timeout_s=1.0)
    real = FakeStore({"join/nonce/7": "ab" * 32})
    set_result(real, 7, "s3cret", True)
    node_join(real, 7, "s3cret", timeout_s=1.0)                               # admitted
    assert read_result("s3cret", 7, real["join/result/7"]) == "ok"
    assert read_result("s3cret", 8, real["join/result/7"]) is None           # not movable to another node
    hello = open_signed(member_key("s3cret", 7), "join/hello/7", real["join/hello/7"])   # signed, and no PID in it
    assert "pid" not in json.loads(hello)


def _outsider(store):
    """A second client of ``store``: a process that reached its port without the run's secret."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def test_counters_are_read_and_raised_without_add_so_a_forged_value_closes_no_connection(store):
    """``add`` on a value that is not an integer fails on the store server, which then closes the
    caller's connection for good: the coordinator never calls it on a key anyone can set."""
    from skiptrain.runtime.membership import MAX_NODE_IDS, raise_count, read_count
    from skiptrain.runtime.recovery import current_generation

    outsider = _outsider(store)
    assert read_count(store, "nodes/next") is None
    raise_count(store, "nodes/next", 4)
    assert outsider.add("nodes/next", 1) == 5                   # a node takes id 4 as before
    raise_count(store, "nodes/next", 3)                         # never lowered
    assert read_count(store, "nodes/next") == 5
    for forged in ("x", "-3", "9" * 30, str(MAX_NODE_IDS + 1)):
        outsider.set("nodes/next", forged)
        assert read_count(store, "nodes/next", MAX_NODE_IDS) is None, forged
    raise_count(store, "nodes/next", 6, MAX_NODE_IDS)           # a forged value is replaced
    assert read_count(store, "nodes/next") == 6
    outsider.set("gen", "zz")
    assert current_generation(store) == -1
    outsider.delete_key("gen")
    t0 = time.monotonic()
    assert current_generation(store) == -1 and time.monotonic() - t0 < 1.0     # no blocking read
    store.set("alive", "yes")
    assert store.get("alive") == b"yes"                         # the connection still works


def test_a_log_reader_skips_a_forged_slot_counter_and_keeps_its_connection(store, tmp_path):
    from skiptrain.runtime.shipping import SlotReader, claim_slot, write_slot

    reader = SlotReader(store, Verifier("s", tmp_path / "rejected.jsonl"), "metrics")
    key = member_key("s", 2)
    outsider = _outsider(store)
    write_slot(outsider, key, 2, "metrics", claim_slot(outsider, "metrics"), {"row": "a"})
    assert [p["row"] for _, p in reader.poll()] == ["a"]
    outsider.set("metrics/n", "not a number")
    assert reader.poll() == []
    assert store.get("metrics/n") == b"1"                       # put back, so writers can count on again
    write_slot(outsider, key, 2, "metrics", claim_slot(outsider, "metrics"), {"row": "b"})
    assert [p["row"] for _, p in reader.poll()] == ["b"]


def test_a_deleted_peer_key_never_holds_up_this_nodes_renewals(store):
    """``multi_get`` waits for a missing key up to the store's timeout; a heartbeat that read a
    deleted key that way stopped renewing its own lease (and its node fenced itself)."""
    from skiptrain.runtime.failure import Heartbeat

    failures = []
    for n in (1, 2):
        store.set(f"hb/{n}", Renewal("a", 1, 0, "run", 5.0).encode())
    hb = Heartbeat(store, 0, 3, 0.05, 5.0, on_failure=lambda n, why: failures.append(n))
    hb.start()
    hb.arm()
    try:
        _outsider(store).delete_key("hb/2")
        seq = hb.keeper.seq
        wait_for(lambda: hb.keeper.seq >= seq + 10, seconds=3.0)
    finally:
        hb.stop()
    assert failures == []


def test_the_store_calls_a_coordinator_gone_only_after_its_signed_counter_stood_still_for_the_wait():
    """Timed on the store's own clock from the last change it saw; an unsigned value, or one
    signed with another key, is no sign of life; before any sign, nothing is judged; 0 = never."""
    from skiptrain.runtime.store import ALIVE_KEY, CoordinatorWatch

    key, now = member_key("s", -1), [100.0]
    watch = CoordinatorWatch(key, 10.0, clock=lambda: now[0])
    assert not watch.gone(None)
    now[0] = 500.0
    assert not watch.gone(None)                                   # never seen: not judged
    assert not watch.gone(sign(key, ALIVE_KEY, "a:1"))
    now[0] = 509.0
    assert not watch.gone(sign(key, ALIVE_KEY, "a:1"))
    assert not watch.gone(sign(key, ALIVE_KEY, "a:2"))            # (a change at 509)
    now[0] = 518.0
    assert not watch.gone("a:3")                                  # unsigned: no sign of life
    assert not watch.gone(sign(member_key("s", 3), ALIVE_KEY, "a:4"))   # a node's key: none either
    now[0] = 519.5
    assert watch.gone(sign(key, ALIVE_KEY, "a:2"))
    forever = CoordinatorWatch(key, 0.0, clock=lambda: now[0])
    forever.gone(sign(key, ALIVE_KEY, "a:1"))
    now[0] = 1e9
    assert not forever.gone(None)


def test_a_store_process_this_coordinator_did_not_start_is_asked_to_stop_never_killed(store, monkeypatch):
    """(A coordinator that took a run over knows its store's PID from store.json only.)"""
    import os

    from skiptrain.runtime import outputs
    from skiptrain.runtime.store import STOP_KEY

    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(outputs, "pid_running", lambda pid: True)
    monkeypatch.setattr(outputs.time, "sleep", lambda s: None)
    t = [0.0]
    monkeypatch.setattr(outputs.time, "time", lambda: t.__setitem__(0, t[0] + 1.0) or t[0])
    outputs.stop_store(os.getpid(), store, "s")
    assert killed == [] and open_signed(member_key("s", -1), STOP_KEY, store.get(STOP_KEY).decode()) == "1"


def test_coordinator_resume_takes_over_only_the_live_store_of_its_own_run(store):
    """``skiptrain coordinator --resume``: this run's store alive at --bind is taken over; another
    run's, or one that does not verify with the secret, is one line naming the fix; nothing
    listening there means resuming from the checkpoint."""
    import socket

    from skiptrain.runtime.join import publish_job
    from skiptrain.runtime.membership import MAX_NODE_IDS, raise_count
    from skiptrain.runtime.store import live_run

    raise_count(store, "nodes/next", 0, MAX_NODE_IDS)      # (as a coordinator publishes a run for its nodes)
    publish_job(store, {"meta": {"run_id": "abc"}}, "s")
    assert live_run("127.0.0.1", store.port, "s", "abc") is True
    with pytest.raises(RuntimeError, match="serves another run .*another --bind"):
        live_run("127.0.0.1", store.port, "s", "xyz")
    with pytest.raises(RuntimeError, match="does not verify"):
        live_run("127.0.0.1", store.port, "wrong", "abc")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        assert live_run("127.0.0.1", free.getsockname()[1], "s", "abc") is False


def test_a_store_counts_a_node_ended_by_its_signed_exit_report_though_a_late_renewal_says_run(store):
    """(The nodes' last renewal may be overwritten by one in flight; the exit report cannot be.)"""
    from skiptrain.runtime.fencing import report_exit
    from skiptrain.runtime.lease import LeaseTable
    from skiptrain.runtime.membership import MAX_NODE_IDS, raise_count
    from skiptrain.runtime.store import run_ended

    raise_count(store, "nodes/next", 2, MAX_NODE_IDS)
    for r in (0, 1):
        store.set(f"hb/{r}", sign(member_key("s", r), f"hb/{r}", Renewal(f"i{r}", 3, 0, "run", 5.0).encode()))
    leases = LeaseTable(600.0, 600.0)
    report_exit(store, member_key("s", 0), 0, 7)
    store.set("exit/1", json.dumps({"code": 0}))                   # unsigned: not node 1's
    assert not run_ended(store, leases, "s")
    report_exit(store, member_key("s", 1), 1, 0)
    assert run_ended(store, leases, "s")
