"""Job checkpoints across hosts: writers that share no directory send their parts to the
coordinator's file server (their slots over the store) and the coordinator commits; the result is the checkpoint the same writers commit in one shared
directory (the reference), and nothing forged, tampered or incomplete is ever committed.
In-process stores and file servers only: nothing here starts a process."""

from __future__ import annotations

import json

import pytest
import torch

from skiptrain.checkpoint import store as ckpt_store
from skiptrain.checkpoint.format import CheckpointError
from skiptrain.checkpoint.manager import CheckpointManager
from skiptrain.checkpoint.plan import TensorSpec
from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.runtime.checkpoint_relay import (CheckpointCollector, PartShipper, fetch_checkpoint, open_file_server,
                                                publish_checkpoint)
from skiptrain.runtime.file_channel import FileServer
from skiptrain.runtime.membership import Verifier, coordinator_key, member_key, sign
from skiptrain.runtime.shipping import claim_slot, write_slot

SECRET = "s3cret"
PHASE = "train"


def _tensors(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """What each of two writers holds: its own tensor and a shared one (replicas)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(64, 8, generator=g)
    return {0: {"a": torch.randn(10, 3, generator=g), "s": shared},
            1: {"b": torch.arange(12, dtype=torch.int64), "s": shared.clone()}}


def _specs(held):
    specs = {n: TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for ts in held.values()
             for n, t in ts.items()}
    holders = {n: [r for r in held if n in held[r]] for n in specs}
    return list(specs.values()), holders


def _save(roots, step, held, sinks=None, chunk=256):
    """Writer 1 then writer 0 (the committer) save ``step`` into their roots."""
    specs, holders = _specs(held)
    for r in (1, 0):
        mgr = CheckpointManager(roots[r], rank=r, ranks=[0, 1], chunk_bytes=chunk, clean=False,
                                sink=None if sinks is None else sinks[r])
        mgr.save(step, held[r], {"iteration": step}, specs=specs, holders=holders, rank_state={"node": r},
                 blocking=r == 1 or sinks is not None)
        if r == 0:
            mgr.wait()


def _shippers(store):
    return {r: PartShipper("127.0.0.1", store.port, member_key(SECRET, r), r, PHASE, coord_key=coordinator_key(SECRET))
            for r in (0, 1)}


def _incoming(tmp_path, node, step):
    return tmp_path / "coord" / ".incoming" / str(node) / str(step)


@pytest.fixture
def collector(store, tmp_path):
    """Makes coordinator-side collectors (each with its file server, closed after the test)."""
    opened = []

    def make(keep=3, mirror=None):
        opened.append(open_file_server(store, SECRET, {PHASE: tmp_path / "coord"}))
        return CheckpointCollector(store, Verifier(SECRET), coordinator_key(SECRET), opened[-1], keep, mirror)

    yield make
    for files in opened:
        files.close()


def _same(a, b):
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert sorted(ra.meta.tensors) == sorted(rb.meta.tensors)
    for n in ra.meta.tensors:
        assert torch.equal(ra.read(n), rb.read(n)), n
    assert ra.state == rb.state


def test_relayed_commit_equals_the_shared_directory_commit(store, tmp_path, collector):
    held = _tensors(0)
    ref = tmp_path / "ref"
    _save({0: ref, 1: ref}, 5, held)
    col = collector()
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 5, held, _shippers(store))
    col.poll()
    got = ckpt_store.latest(tmp_path / "coord")
    assert got is not None and got.name == "step-00000005"
    _same(got, ckpt_store.latest(ref))
    assert not list((tmp_path / "n0").glob(".tmp-*")) and not list((tmp_path / "n1").glob(".tmp-*"))
    assert not _incoming(tmp_path, 1, 5).exists()                         # taken, then freed


def test_a_step_with_a_part_missing_is_not_committed_and_is_dropped_by_a_later_one(store, tmp_path, collector):
    held = _tensors(1)
    col = collector()
    sinks = _shippers(store)
    specs, holders = _specs(held)
    mgr0 = CheckpointManager(tmp_path / "n0", rank=0, ranks=[0, 1], chunk_bytes=256, clean=False, sink=sinks[0])
    mgr0.save(3, held[0], {"iteration": 3}, specs=specs, holders=holders, blocking=True)   # writer 1 never sends
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord", warn=False) is None
    assert (tmp_path / "coord" / ".tmp-step-00000003").is_dir()
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 6, held, sinks)
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord").name == "step-00000006"
    assert not (tmp_path / "coord" / ".tmp-step-00000003").exists()


def test_forged_tampered_and_foreign_parts_are_refused(store, tmp_path, capsys, collector):
    held = _tensors(2)
    col = collector()
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 4, held, _shippers(store))
    # before the coordinator reads them: node 1's data bytes are replaced on their way
    (_incoming(tmp_path, 1, 4) / "data-r1.bin").write_bytes(b"garbage")
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord", warn=False) is None
    assert "do not match the signed digest" in capsys.readouterr().err
    # a slot claiming another node's files, and an unsigned commit record
    i = claim_slot(store, "ckpt")
    write_slot(store, member_key(SECRET, 1), 1, "ckpt", i,
               {"phase": PHASE, "step": 4, "kind": "part", "files": {"part-r0.json": "x", "data-r0.bin": "y"}})
    i = claim_slot(store, "ckpt")
    store.set(f"ckpt/{i}", json.dumps({"node": 0, "phase": PHASE, "step": 4, "kind": "commit"}))
    col.poll()
    assert "its own rank's two files only" in capsys.readouterr().err
    assert ckpt_store.latest(tmp_path / "coord", warn=False) is None


def test_a_commit_record_from_another_writer_than_the_lowest_is_refused(store, tmp_path, capsys, collector):
    held = _tensors(3)
    col = collector()
    sinks = _shippers(store)
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 2, held, sinks)
    col.poll()                                             # step 2 commits

    class CommitAsNode1:                                   # node 0's part, but the record signed by node 1
        def part(self, *a):
            sinks[0].part(*a)

        def commit(self, *a):
            sinks[1].commit(*a)

    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 7, held, {0: CommitAsNode1(), 1: sinks[1]})
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord").name == "step-00000002"
    assert "came from node 1, not its lowest writer" in capsys.readouterr().err


def test_published_checkpoint_is_fetched_verified_and_replaced(store, tmp_path):
    held = _tensors(4)
    ref = tmp_path / "ref"
    _save({0: ref, 1: ref}, 5, held)
    key = coordinator_key(SECRET)
    files = FileServer("127.0.0.1", SECRET, {PHASE: ref})
    files.announce(store)
    publish_checkpoint(store, key, files, PHASE, ckpt_store.latest(ref))
    got = fetch_checkpoint(store, key, PHASE, tmp_path / "node")
    _same(got, ckpt_store.latest(ref))
    assert fetch_checkpoint(store, key, "other", tmp_path / "node") is None
    _save({0: ref, 1: ref}, 8, _tensors(5))
    publish_checkpoint(store, key, files, PHASE, ckpt_store.latest(ref))
    assert [p.name for p in (ref / ".published" / "latest").iterdir()] == ["step-00000008"]   # the older one freed
    meta = ref / ".published" / "latest" / "step-00000008" / "metadata.json"
    meta.unlink()
    meta.write_bytes(b"{}")                                                          # tampered
    with pytest.raises(CheckpointError, match="could not fetch"):
        fetch_checkpoint(store, key, PHASE, tmp_path / "node2")
    assert (ref / "step-00000008" / "metadata.json").read_bytes() != b"{}"            # (a link, not the file)
    store.set("ckpt/latest/train", sign(member_key(SECRET, 3), "ckpt/latest/train", json.dumps({"step": 1, "files": {}})))
    with pytest.raises(CheckpointError, match="not signed by the run's coordinator"):
        fetch_checkpoint(store, key, PHASE, tmp_path / "node3")
    files.close()


def test_the_file_server_takes_only_uploads_signed_by_the_node_they_name(tmp_path):
    import urllib.error
    import urllib.request

    from skiptrain.runtime.file_channel import put_file

    files = FileServer("127.0.0.1", SECRET, {PHASE: tmp_path / "root"})
    src = tmp_path / "data-r2.bin"
    src.write_bytes(b"x" * 3000)
    put_file(files.address, member_key(SECRET, 2), 2, PHASE, 7, src)
    assert (files.incoming(PHASE, 2, 7) / src.name).read_bytes() == src.read_bytes()
    with pytest.raises(OSError, match="403"):
        put_file(files.address, member_key(SECRET, 3), 2, PHASE, 7, src)        # another node's key
    with pytest.raises(OSError, match="403"):
        put_file(files.address, member_key("other", 2), 2, PHASE, 7, src)       # another run's secret
    with pytest.raises(OSError, match="404"):
        put_file(files.address, member_key(SECRET, 2), 2, "nophase", 7, src)
    url = f"http://{files.address[0]}:{files.address[1]}"
    for path in ("/in/2/train/7/..", "/pub/latest/train/1/x", "/../etc/passwd"):
        req = urllib.request.Request(url + path, method="PUT" if path.startswith("/in") else "GET", data=b"")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code in (400, 404)
    files.close()


def test_a_step_commits_only_once_the_rows_sent_before_its_parts_are_in_the_run_directory(store, tmp_path, collector):
    from skiptrain.runtime.shipping import RowMirror, publish_row

    col = collector(mirror=RowMirror(store, Verifier(SECRET), tmp_path))
    publish_row(store, member_key(SECRET, 0), 0, json.dumps({"step": 5}))
    slot = claim_slot(store, "metrics")                 # a row counted, not written yet
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 5, _tensors(6), _shippers(store))
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord", warn=False) is None
    write_slot(store, member_key(SECRET, 1), 1, "metrics", slot, {"row": json.dumps({"step": 5, "x": 1})})
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord").name == "step-00000005"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_malformed_slots_from_a_member_are_refused_and_the_collector_goes_on(store, tmp_path, capsys, collector):
    col = collector()
    key = member_key(SECRET, 0)
    for bad in ({"phase": ["x"], "step": 1, "kind": "part"}, {"phase": PHASE, "step": 1, "kind": "commit", "ranks": 5},
                {"phase": PHASE, "step": 1, "kind": "part", "files": "nope"}):
        write_slot(store, key, 0, "ckpt", claim_slot(store, "ckpt"), bad)
    col.poll()
    assert capsys.readouterr().err.count("refused") == 3
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 2, _tensors(7), _shippers(store))
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord").name == "step-00000002"
    assert not any(store.check([f"ckpt/{i}"]) for i in range(int(store.add("ckpt/n", 0))))     # read once, freed
    # a step at or below the newest commit is never committed again (LATEST never goes back)
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 1, _tensors(8), _shippers(store))
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord").name == "step-00000002" and "a newer step is committed" in \
        capsys.readouterr().err


def test_the_checkpoint_a_run_resumed_from_stays_fetchable_after_newer_commits(store, tmp_path, monkeypatch):
    """A node that joins a resumed run late (a rejoin, a new host) still fetches the checkpoint
    the run resumed from, though newer steps were committed and published since."""
    from skiptrain.runtime.checkpoint_relay import fetch_resume_point
    from skiptrain.runtime.job import Job, Phase
    from skiptrain.runtime.membership import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, SECRET)
    ref = tmp_path / "ref"
    _save({0: ref, 1: ref}, 5, _tensors(9))
    key = coordinator_key(SECRET)
    files = FileServer("127.0.0.1", SECRET, {PHASE: ref})
    files.announce(store)
    publish_checkpoint(store, key, files, PHASE, ckpt_store.latest(ref), which="resume")
    _save({0: ref, 1: ref}, 8, _tensors(10))
    publish_checkpoint(store, key, files, PHASE, ckpt_store.latest(ref))
    import shutil

    shutil.copytree(ref / "step-00000005", tmp_path / "expect")
    ckpt_store.prune(ref, 1)                                   # (the resumed-from step is gone from the root)
    job = Job(config={}, data_path="d", run_dir=str(tmp_path / "node"), phases=[Phase(PHASE, {}, iterations=10)],
              resume={"path": str(ref / "step-00000005"), "phase": 0, "iteration": 5, "cursor": 0})
    got = fetch_resume_point(job, store)
    _same(got.resume["path"], tmp_path / "expect")


def test_a_part_that_could_not_be_sent_is_removed_once_a_later_step_commits(store, tmp_path, collector):
    """The slot counter forged to a non-integer makes the shipper's ``add`` fail (its connection
    closes): its uploaded files, which no slot names, go once a later step of the phase commits."""
    from skiptrain.checkpoint.writer import part_name
    from skiptrain.runtime.checkpoint_relay import LOG

    col = collector()
    tmp = tmp_path / "part"
    tmp.mkdir()
    (tmp / part_name(0)).write_bytes(b"x" * 100)
    store.set(f"{LOG}/n", "not a number")
    shipper = _shippers(store)[0]
    shipper.part(7, 0, tmp)
    assert not tmp.exists() and _incoming(tmp_path, 0, 7).is_dir()
    col.poll()                                                # (puts the counter back)
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 9, _tensors(11), _shippers(store))
    col.poll()
    assert ckpt_store.latest(tmp_path / "coord").name == "step-00000009"
    assert not _incoming(tmp_path, 0, 7).exists()


def test_a_coordinator_that_takes_over_serves_what_its_predecessor_published(store, tmp_path, collector):
    """The checkpoint the store still names as the latest stays fetchable from the new
    coordinator's file server (a stage that lost every replica restarts from it)."""
    first = collector()
    _save({0: tmp_path / "n0", 1: tmp_path / "n1"}, 5, _tensors(12), _shippers(store))
    first.poll()
    first.files.close()                                      # (the first coordinator died)
    second = collector()
    got = fetch_checkpoint(store, coordinator_key(SECRET), PHASE, tmp_path / "node")
    _same(got, ckpt_store.latest(tmp_path / "coord"))
    second.files.close()


def test_an_upload_the_server_cannot_store_is_refused_and_leaves_no_partial_file(tmp_path):
    from skiptrain.runtime.file_channel import put_file

    files = FileServer("127.0.0.1", SECRET, {PHASE: tmp_path / "root"})
    (tmp_path / "root").mkdir()
    (files.incoming(PHASE, 2, 7).parent).mkdir(parents=True)
    files.incoming(PHASE, 2, 7).write_text("a file where the step's folder should be")
    src = tmp_path / "data-r2.bin"
    src.write_bytes(b"x" * 3000)
    with pytest.raises(OSError, match="500"):
        put_file(files.address, member_key(SECRET, 2), 2, PHASE, 7, src)
    assert not list(files.incoming(PHASE, 2, 7).parent.rglob("*.part"))
    files.close()
