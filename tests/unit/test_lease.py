"""Leases are timed on the reader's own clock: a replayed or skewed renewal never keeps a node
alive, a node that cannot renew stops before any reader sees its lease end, and the lease adapts
to the renewal round trip within its floor and ceiling."""

from __future__ import annotations

import pytest
from conftest import FakeStore
from hypothesis import given, settings, strategies as st

from skiptrain.runtime.lease import (FENCE_MARGIN_S, RTT_FACTOR, LeaseKeeper, LeaseTable, Renewal, clamp_lease,
                                     parse_renewal)
from skiptrain.runtime.membership import member_key, sign


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_renewal_survives_its_encoding_and_its_tag():
    r = Renewal("ab12", 7, 3, "run", 4.0)
    assert parse_renewal(r.encode()) == r
    assert parse_renewal(sign(member_key("s", 1), "hb/1", r.encode())) == r
    for junk in ("", "12.5:run", "{}", '{"inc":"a","seq":"x","gen":0,"state":"run","lease":1}',
                 '{"inc":"a","seq":1,"gen":0,"state":"run","lease":0}', "[1,2]"):
        assert parse_renewal(junk) is None, junk


def test_the_reader_times_leases_on_its_own_clock_whatever_the_writer_claims():
    clock = Clock()
    table = LeaseTable(3.0, 30.0, clock)
    table.watch(1)
    clock.t += 2.9
    assert not table.expired(1)
    clock.t += 0.2
    assert table.expired(1)                   # admitted, never renewed: one floor after it was watched
    assert table.observe(1, Renewal("a", 1, 0, "run", 3.0)) == "advanced"
    assert not table.expired(1)
    clock.t += 2.0
    assert table.observe(1, Renewal("a", 1, 0, "run", 3.0)) == "same"     # read again: no refresh
    clock.t += 1.1
    assert table.expired(1) and not table.expired(1, margin_s=0.5)


def test_a_replayed_renewal_never_counts_as_one_but_postpones_judgment():
    """A replay proves nothing about the node: it is no renewal (``last`` keeps the newest), and
    a process that writes old values back must not get a healthy node fenced by hiding its
    renewals, so the node is judged one lease after the last sign of tampering."""
    clock = Clock()
    table = LeaseTable(3.0, 30.0, clock)
    table.observe(1, Renewal("a", 5, 0, "run", 3.0))
    clock.t += 2.5
    assert table.observe(1, Renewal("a", 4, 0, "run", 3.0)) == "stale"
    assert table.last[1].seq == 5
    clock.t += 1.0
    assert not table.expired(1)                  # 3.5 s since the renewal, 1.0 s since the replay
    clock.t += 2.1
    assert table.expired(1)                      # a lease after the last replay: judged as silent


def test_a_deleted_or_forged_key_postpones_judgment_only_for_a_node_heard_from():
    clock = Clock()
    table = LeaseTable(3.0, 30.0, clock)
    table.watch(2)
    table.dispute(2)                             # never renewed: nothing to tamper with, judged as usual
    clock.t += 3.1
    assert table.expired(2)
    table.observe(1, Renewal("a", 1, 0, "run", 3.0))
    clock.t += 2.0
    table.dispute(1)
    clock.t += 2.0
    assert not table.expired(1)
    clock.t += 1.1
    assert table.expired(1)


def test_a_reader_that_was_stopped_rearms_every_lease():
    clock = Clock()
    table = LeaseTable(3.0, 30.0, clock)
    table.observe(1, Renewal("a", 1, 0, "run", 3.0))
    table.watch(2)
    clock.t += 9.0                               # the reader itself was stopped for 9 s
    assert table.expired(1) and table.expired(2)
    table.rearm()
    assert not table.expired(1) and not table.expired(2)
    clock.t += 3.1
    assert table.expired(1) and table.expired(2)  # and judged normally a lease later


def test_a_second_incarnation_on_one_identity_is_a_conflict():
    table = LeaseTable(3.0, 30.0, Clock())
    table.observe(2, Renewal("a", 1, 0, "run", 3.0))
    assert table.observe(2, Renewal("b", 99, 0, "run", 3.0)) == "conflict"
    assert table.last[2].inc == "a"


def test_a_node_cannot_claim_a_lease_outside_the_readers_bounds():
    clock = Clock()
    table = LeaseTable(3.0, 10.0, clock)
    table.observe(1, Renewal("a", 1, 0, "run", 1e9))
    assert table.lease_of(1) == 10.0
    table.observe(2, Renewal("a", 1, 0, "run", 0.01))
    assert table.lease_of(2) == 3.0


def test_done_never_expires():
    clock = Clock()
    table = LeaseTable(3.0, 10.0, clock)
    table.observe(1, Renewal("a", 1, 0, "done", 3.0))
    clock.t += 100
    assert not table.expired(1)


def test_the_lease_follows_the_recent_round_trips_within_bounds_and_ignores_one_blip():
    clock = Clock()
    keeper = LeaseKeeper(2.0, 20.0, clock)
    assert keeper.remaining() is None

    def renew(rtt: float) -> None:
        r, sent = keeper.next(0, "run")
        clock.t += rtt
        keeper.acknowledged(r, sent)

    renew(0.01)
    assert keeper.lease_s() == 2.0
    for _ in range(20):
        renew(0.01)
    renew(3.0)                                        # one renewal held up by a 3 s blip
    assert keeper.lease_s() == 2.0
    for _ in range(40):                               # a link that is slow for good
        renew(1.0)
    assert keeper.lease_s() == pytest.approx(RTT_FACTOR * 1.0)
    for _ in range(40):
        renew(10.0)
    assert keeper.lease_s() == 20.0
    assert [keeper.next(0, "run")[0].seq for _ in range(2)] == [103, 104]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 2.0), st.booleans()), min_size=1, max_size=30),
       st.floats(1.0, 5.0), st.floats(0.0, 2.0))
def test_the_writer_stops_before_any_reader_sees_its_lease_end(steps, floor_s, read_delay):
    """Against a simple reference: every acknowledged renewal was read at least ``read_delay``
    after it was sent (the reader's clock starts then); the writer's deadline is always at least
    FENCE_MARGIN_S before the reader's."""
    clock = Clock(0.0)
    keeper = LeaseKeeper(floor_s, 4 * floor_s, clock)
    reader_deadline = None
    for wait, rtt, acked in steps:
        clock.t += wait
        r, sent = keeper.next(0, "run")
        if not acked:
            continue
        clock.t += rtt
        keeper.acknowledged(r, sent)
        read_at = sent + min(read_delay, rtt)           # the store had it no later than the ack came back
        reader_deadline = read_at + clamp_lease(r.lease, floor_s, 4 * floor_s)
    if reader_deadline is None:
        assert keeper.remaining() is None
        return
    writer_deadline = clock.t + keeper.remaining()
    assert writer_deadline <= reader_deadline - FENCE_MARGIN_S + 1e-9


def test_the_coordinator_sees_a_replay_and_a_second_claim_on_one_identity(tmp_path):
    from skiptrain.runtime.fencing import Members, report_exit
    from skiptrain.runtime.membership import Verifier

    clock = Clock()
    key = member_key("s", 3)
    members = Members([], FakeStore(), Verifier("s", tmp_path / "rejected.jsonl"), LeaseTable(3.0, 30.0, clock))
    st = members.store
    st["hb/3"] = sign(key, "hb/3", Renewal("a", 5, 0, "run", 3.0).encode())
    assert members.renew({3}) == {} and members.code(3) is None
    st["hb/3"] = sign(key, "hb/3", Renewal("a", 2, 0, "run", 3.0).encode())
    assert members.renew({3}) == {3: "stale"}
    del st["hb/3"]                                                      # deleted: judged a lease later
    clock.t += 2.0
    assert members.renew({3}) == {} and members.lease_lost(3, 0.0) is None
    clock.t += 3.5
    assert members.lease_lost(3, 0.0) is not None and "no lease renewal for 5.50 s" in members.lease_lost(3, 0.0)
    st["hb/3"] = sign(key, "hb/3", Renewal("b", 9, 0, "run", 3.0).encode())
    assert members.renew({3}) == {3: "conflict"}
    st["hb/3"] = Renewal("a", 99, 0, "run", 3.0).encode()               # unsigned: not node 3's
    assert members.renew({3}) == {}
    report_exit(st, key, 3, -9)
    assert members.code(3) == -9
    report_exit(st, member_key("s", 4), 3, 0)                           # signed by another node: ignored
    assert members.code(3) is None


def test_a_lease_that_ran_out_is_not_revived_by_a_late_renewal():
    """A process stopped past its lease (or a host suspended) that renews as soon as it resumes
    must still stop: the coordinator may have given its place away."""
    clock = Clock()
    keeper = LeaseKeeper(3.0, 30.0, clock)
    r, sent = keeper.next(0, "run")
    keeper.acknowledged(r, sent)
    clock.t += 100.0                                  # stopped (SIGSTOP, suspend) for 100 s
    r, sent = keeper.next(0, "run")
    clock.t += 0.01
    keeper.acknowledged(r, sent)                      # the first renewal after it resumed gets through
    assert keeper.remaining() < 0
    r, sent = keeper.next(0, "run")
    keeper.acknowledged(r, sent)
    assert keeper.remaining() < 0                     # and stays out


def test_committed_iterations_vouch_for_their_generations_nodes_and_older_lines_prove_nothing(tmp_path):
    """A renewal key written back over and over hides a node's renewals from the coordinator;
    an iteration line of the node's generation that appears in the run's metrics (its rank 0
    writes one only after every node of the generation took part) restarts its lease clock."""
    import json

    from skiptrain.runtime.fencing import RowEvidence

    clock = Clock()
    table = LeaseTable(3.0, 30.0, clock)
    table.observe(1, Renewal("a", 5, 0, "run", 3.0))
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"phase": "p", "step": 1, "gen": 2, "loss": 3.0}) + "\n")
    rows = RowEvidence(path)
    assert not rows.new_iteration(2)                                    # (written before: no evidence)
    with open(path, "a") as f:
        f.write(json.dumps({"phase": "p", "step": 2, "gen": 1, "loss": 3.0}) + "\n")       # another generation
        f.write(json.dumps({"phase": "p", "step": 2, "gen": 2, "val_loss": 3.0}) + "\n")   # a validation point
        f.write('{"phase": "p", "step": 3, "gen": 2, "lo')                                 # half written
    assert not rows.new_iteration(2)
    with open(path, "a") as f:
        f.write('ss": 2.9}\n')
    clock.t += 2.5
    assert rows.new_iteration(2)
    table.vouch(1)
    clock.t += 2.5
    assert not table.expired(1) and table.last[1].seq == 5    # 5 s after the renewal, 2.5 s after the line
    clock.t += 0.6
    assert table.expired(1)


class _Supervisor:
    """A supervisor process's handle as the launcher sees it (``Popen``'s part)."""

    def __init__(self):
        self.pid, self.code, self.killed = 4242, None, False

    def poll(self):
        return self.code

    def kill(self):
        self.killed, self.code = True, -9


def test_a_supervised_node_exits_as_its_supervisor_reports_it_signed_else_with_its_supervisor(tmp_path):
    from skiptrain.runtime.fencing import report_exit
    from skiptrain.runtime.node_processes import SupervisedNode
    from skiptrain.runtime.membership import Verifier

    def node(r):
        return SupervisedNode(_Supervisor(), r, st, Verifier("s", tmp_path / "rejected.jsonl"))

    st = FakeStore()
    reported = node(3)
    assert reported.poll() is None and reported.returncode is None and reported.pid == 4242
    report_exit(st, member_key("s", 3), 3, -9)             # its supervisor's report, then it ends
    assert reported.poll() is None                         # (read once the supervisor has ended)
    reported.supervisor.code = 247                         # (-9 as an exit status)
    assert reported.poll() == -9 and reported.wait(timeout=1) == -9

    forged = node(4)
    report_exit(st, member_key("s", 5), 4, 0)              # signed by another node: not node 4's exit
    forged.supervisor.code = 1                             # the supervisor ended without a report
    assert forged.poll() == 1
    killed = node(6)
    killed.kill()                                          # fencing kills the supervisor (the node dies with it)
    assert killed.supervisor.killed and killed.returncode == -9
    clean = node(7)
    clean.supervisor.code = 0                              # exited 0 with no report: it took its node along
    assert clean.poll() == -9
    with pytest.raises(Exception, match="node 8"):
        node(8).wait(timeout=0.05)


def test_a_local_node_whose_last_renewal_says_done_has_finished_before_its_supervisor_ends(tmp_path):
    """Its exit is read once its supervisor ends; a node that finished must not be judged by a
    lease it no longer renews meanwhile (a loaded machine slows the supervisor's exit)."""
    from skiptrain.runtime.fencing import Members
    from skiptrain.runtime.membership import Verifier
    from skiptrain.runtime.node_processes import SupervisedNode

    st, verifier = FakeStore(), Verifier("s", tmp_path / "rejected.jsonl")
    members = Members([SupervisedNode(_Supervisor(), 0, st, verifier)], st, verifier, LeaseTable(3.0, 30.0, Clock()))
    st["hb/0"] = sign(member_key("s", 0), "hb/0", Renewal("a", 1, 0, "run", 3.0).encode())
    members.renew({0})
    assert members.is_child(0) and members.code(0) is None
    st["hb/0"] = sign(member_key("s", 0), "hb/0", Renewal("a", 2, 0, "done", 3.0).encode())
    members.renew({0})
    assert members.code(0) == 0
