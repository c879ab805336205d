"""Checkpoint format, plan, save/load round trips, corruption detection, keep-last-k, LATEST.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_checkpoint.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skiptrain.checkpoint import store
from skiptrain.checkpoint.format import (METADATA_FILE, CheckpointCorruptError, CheckpointError,
                                         CheckpointFormatError, CheckpointMeta)
from skiptrain.checkpoint.manager import CheckpointManager, specs_of
from skiptrain.checkpoint.plan import TensorSpec, plan_save
from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.config import build_config
from skiptrain.model.transformer import StagedLM


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.f32": torch.randn(37, 11, generator=g),
        "b.bf16": torch.randn(5, 64, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(300, generator=g).to(torch.float16),
        "d.i64": torch.randint(-10**12, 10**12, (7, 3), generator=g),
        "e.scalar": torch.tensor(3.25),
        "f.bool": torch.rand(9, generator=g) > 0.5,
        "g.empty": torch.empty(0, 4),
        "h.big": torch.randn(1000, 33, generator=g),
    }


def _save(root, tensors, step=1, keep=0, chunk=1 << 12, state=None):
    mgr = CheckpointManager(root, keep=keep, chunk_bytes=chunk)
    mgr.save(step, tensors, state or {"step": step}, blocking=True)
    return root / f"step-{step:08d}"


def test_round_trip_all_dtypes_bit_identical(tmp_path):
    t = _state()
    path = _save(tmp_path, t, state={"hello": [1, 2]})
    r = CheckpointReader(tmp_path)
    assert r.path == path and r.step == 1 and r.state == {"hello": [1, 2]}
    got = r.read_many(t)
    for n in t:
        assert got[n].dtype == t[n].dtype and got[n].shape == t[n].shape
        assert torch.equal(got[n].view(-1).view(torch.uint8) if got[n].numel() else got[n],
                           t[n].reshape(-1).view(torch.uint8) if t[n].numel() else t[n]), n
    # the big tensor was cut into several row blocks, each with its own checksum
    assert len(r.meta.tensors["h.big"].shards) > 1
    assert r.verify() == sum(x.numel() * x.element_size() for x in t.values())


def test_read_in_place_and_shape_mismatch(tmp_path):
    t = _state()
    _save(tmp_path, t)
    r = CheckpointReader(tmp_path)
    dst = torch.zeros(37, 11)
    ptr = dst.data_ptr()
    r.read("a.f32", out=dst)
    assert dst.data_ptr() == ptr and torch.equal(dst, t["a.f32"])
    with pytest.raises(CheckpointError, match="stored float32"):
        r.read("a.f32", out=torch.zeros(11, 37))
    with pytest.raises(CheckpointError, match="close names"):
        r.read("a.f33")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=12),
       st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(64, 2000))
def test_plan_covers_each_byte_once_and_balances(shapes, groups, chunk):
    """Each tensor is held by one 'stage' whose replicas are a disjoint rank set."""
    rank_sets, r0 = [], 0
    for n in groups:
        rank_sets.append(list(range(r0, r0 + n)))
        r0 += n
    specs = [TensorSpec(f"t{i}", "float32", s) for i, s in enumerate(shapes)]
    holders = {s.name: rank_sets[i % len(rank_sets)] for i, s in enumerate(specs)}
    plan = plan_save(specs, holders, chunk_bytes=chunk)
    again = plan_save(list(reversed(specs)), dict(reversed(list(holders.items()))), chunk_bytes=chunk)
    assert plan.assignments == again.assignments  # independent of input order: every node agrees
    covered = {s.name: [] for s in specs}
    for rank, items in plan.assignments.items():
        for it in items:
            assert rank in holders[it.name]
            covered[it.name].append((it.byte_start, it.nbytes))
    for s in specs:
        spans = sorted(covered[s.name])
        pos = 0
        for start, n in spans:
            assert start == pos
            pos += n
        assert pos == s.nbytes
    # balance within each replica set: greedy LPT keeps max - min within the largest piece
    loads = plan.bytes_per_rank()
    for rs in rank_sets:
        pieces = [it.nbytes for r in rs for it in plan.items(r)]
        if pieces:
            assert max(loads[r] for r in rs) - min(loads[r] for r in rs) <= max(pieces)


def test_bit_flip_detected_names_file_tensor_and_previous(tmp_path):
    t = _state()
    _save(tmp_path, t, step=1)
    t2 = {k: v.clone() for k, v in t.items()}
    p2 = _save(tmp_path, t2, step=2)
    r = CheckpointReader(p2)
    shard = r.meta.tensors["a.f32"].shards[0]
    with open(p2 / shard.file, "r+b") as f:
        f.seek(shard.byte_offset + 17)
        b = f.read(1)
        f.seek(shard.byte_offset + 17)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError) as ei:
        CheckpointReader(tmp_path).verify()
    e = ei.value
    assert e.file == shard.file and e.tensor == "a.f32"
    assert e.previous and e.previous.endswith("step-00000001")
    assert "checksum mismatch" in str(e) and "step-00000001" in str(e) and "a.f32" in str(e)
    # the tensor beside it still loads; the previous checkpoint verifies
    assert torch.equal(r.read("h.big"), t["h.big"])
    CheckpointReader(e.previous).verify()


def test_truncated_and_missing_data_file(tmp_path):
    t = _state()
    p = _save(tmp_path, t, chunk=1 << 20)
    r = CheckpointReader(p)
    fname = r.meta.tensors["h.big"].shards[-1].file
    size = os.path.getsize(p / fname)
    os.truncate(p / fname, size - 100)
    with pytest.raises(CheckpointCorruptError, match="truncated") as ei:
        CheckpointReader(p).verify()
    assert ei.value.file == fname and ei.value.tensor is not None
    assert ei.value.previous is None and "no older committed checkpoint" in str(ei.value)
    (p / fname).unlink()
    with pytest.raises(CheckpointCorruptError, match="missing"):
        CheckpointReader(p).read("a.f32")


def test_metadata_corruption_and_versions(tmp_path):
    _save(tmp_path, _state(), step=1)
    p = _save(tmp_path, _state(), step=2)
    raw = (p / METADATA_FILE).read_bytes()
    (p / METADATA_FILE).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointCorruptError, match="not valid JSON") as ei:
        CheckpointReader(p)
    assert ei.value.previous.endswith("step-00000001")
    body = json.loads(raw)
    body["step"] = 3  # a silent edit: caught by the metadata checksum
    (p / METADATA_FILE).write_text(json.dumps(body))
    with pytest.raises(CheckpointCorruptError, match="metadata checksum"):
        CheckpointReader(p)
    for change, msg in [({"version": 99}, "format version 99"), ({"format": "other"}, "not a skiptrain")]:
        b = dict(json.loads(raw), **change)
        (p / METADATA_FILE).write_text(json.dumps(b))
        with pytest.raises(CheckpointFormatError, match=msg):
            CheckpointReader(p)
    meta = CheckpointMeta.decode(raw, str(p))
    meta.tensors["a.f32"].dtype = "complex32"
    with pytest.raises(CheckpointFormatError, match="unknown dtype"):
        CheckpointMeta.decode(meta.encode(), str(p))


def test_keep_last_k_latest_and_stale_cleanup(tmp_path):
    t = _state()
    mgr = CheckpointManager(tmp_path, keep=2, chunk_bytes=1 << 12)
    for step in range(1, 6):
        for v in t.values():
            if v.dtype.is_floating_point and v.numel():
                v.fill_(step)
        mgr.save(step, t, {"step": step})
    mgr.close()
    assert [s for s, _ in store.list_committed(tmp_path)] == [4, 5]
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000005"
    assert float(CheckpointReader(tmp_path).read("a.f32")[0, 0]) == 5.0
    # a half-written save and a half-deleted one are ignored, then cleaned by the next manager
    (tmp_path / ".tmp-step-00000006").mkdir()
    (tmp_path / ".tmp-step-00000006" / "data-r0.bin").write_bytes(b"xx")
    (tmp_path / ".trash-step-00000003-1").mkdir()
    assert store.latest(tmp_path).name == "step-00000005"
    # LATEST pointing nowhere (crash between rename and pointer update): newest committed wins
    (tmp_path / "LATEST").write_text("step-00000009\n")
    assert store.latest(tmp_path).name == "step-00000005"
    CheckpointManager(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000004", "step-00000005"]
    # saving an already committed step again is a no-op
    mgr = CheckpointManager(tmp_path, keep=2)
    before = (tmp_path / "step-00000005" / METADATA_FILE).stat().st_mtime_ns
    mgr.save(5, t, {"step": 5}, blocking=True)
    assert (tmp_path / "step-00000005" / METADATA_FILE).stat().st_mtime_ns == before


def test_background_error_is_raised_and_nothing_committed(tmp_path, monkeypatch):
    import skiptrain.checkpoint.manager as M

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    mgr = CheckpointManager(tmp_path)
    monkeypatch.setattr(M, "write_part", boom)
    mgr.save(1, _state(), {})
    with pytest.raises(CheckpointError, match="step 1 failed: No space left on device; nothing of it was kept "
                                              "and no checkpoint was committed yet"):
        mgr.wait()
    assert store.latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        CheckpointReader(tmp_path)


def test_model_and_adamw_restore_bit_identical(tmp_path):
    cfg = build_config("tiny")
    m = StagedLM(cfg.model, seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randint(0, 256, (2, 64))
    for _ in range(2):
        _, loss = m(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    mgr = CheckpointManager(tmp_path, chunk_bytes=1 << 14)
    mgr.save_training(2, m, opt, {"step": 2}, blocking=True)
    names = CheckpointReader(tmp_path).names()
    assert "optim.exp_avg.layers.0.attn.wq.weight" in names and "optim.step.head.weight" in names
    m2 = StagedLM(cfg.model, seed=7)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5.0)
    CheckpointManager.restore(tmp_path, m2, opt2)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"][0]["lr"] == 1e-3
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    # the same step on both continues identically
    for mm, oo in ((m, opt), (m2, opt2)):
        _, loss = mm(x, x)
        loss.backward()
        oo.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_specs_of_names_dtypes():
    s = specs_of({"x": torch.zeros(2, 3, dtype=torch.bfloat16)})
    assert s == [TensorSpec("x", "bfloat16", (2, 3))]


def test_overlapped_snapshot_is_taken_before_the_next_optimizer_step(tmp_path, monkeypatch):
    """overlap=True copies in the background; optimizer.step() waits for it (pre-hook), so the
    checkpoint holds the values at save time, not a mix with the next step."""
    import time

    from skiptrain.checkpoint.snapshot import HostSnapshot

    slow_take = HostSnapshot.take

    def take(self, tensors):  # a slow copy, so an unguarded step would certainly overtake it
        time.sleep(0.2)
        return slow_take(self, tensors)

    monkeypatch.setattr(HostSnapshot, "take", take)
    cfg = build_config("tiny")
    m = StagedLM(cfg.model, seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 64))

    def grads():
        opt.zero_grad()
        _, loss = m(x, x)
        loss.backward()

    grads()
    opt.step()
    mgr = CheckpointManager(tmp_path, keep=5)
    for k in range(1, 3):
        grads()
        saved = {n: t.clone() for n, t in m.state_dict().items()}
        saved_avg = {id(p): opt.state[p]["exp_avg"].clone() for p in m.parameters()}
        mgr.save_training(k, m, opt, {"step": k}, overlap=True)
        opt.step()  # mutates everything at once: must wait for the snapshot first
        assert not torch.equal(m.state_dict()["head.weight"], saved["head.weight"])
        mgr.wait()
        r = CheckpointReader(tmp_path / f"step-{k:08d}")
        for n, t in r.read_many(list(saved)).items():
            assert torch.equal(t, saved[n]), n
        for n, p in m.named_parameters():
            assert torch.equal(r.read(f"optim.exp_avg.{n}"), saved_avg[id(p)])
    assert mgr.wait_snapshot() == 0.0  # nothing pending after the saves


@pytest.mark.parametrize("errno_,text", [(28, "No space left on device"), (30, "Read-only file system")])
def test_an_io_error_during_a_save_is_one_line_naming_the_last_checkpoint_and_leaves_no_tmp(
        tmp_path, monkeypatch, errno_, text):
    import os

    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(), {}, blocking=True)
    real = store.write_file

    def fail_on_metadata(path, data, durable=True):  # after the data file is written
        if str(path).endswith(METADATA_FILE):
            raise OSError(errno_, os.strerror(errno_), str(path))
        return real(path, data, durable)

    monkeypatch.setattr(store, "write_file", fail_on_metadata)
    mgr.save(2, _state(), {})
    with pytest.raises(CheckpointError) as e:
        mgr.wait()
    msg = str(e.value)
    assert "\n" not in msg and f"step 2 failed: {text}" in msg
    assert f"the last committed checkpoint is {tmp_path / 'step-00000001'}" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000001"]  # no .tmp-step-*


def test_an_unwritable_checkpoint_root_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="cannot use the checkpoint directory .*: Not a directory"):
        CheckpointManager(tmp_path / "file" / "ckpt")


def test_a_part_checksummed_on_the_helper_thread_records_what_one_checksummed_in_line_does(tmp_path, monkeypatch):
    """Large parts are checksummed on a helper thread while they are written, small ones in line:
    both give the same shard records, and the data verifies."""
    from skiptrain.checkpoint import writer
    from skiptrain.checkpoint.format import checksum

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(64 + i, 33, generator=g) for i in range(5)}
    plan = plan_save(specs_of(tensors), None, chunk_bytes=4096)
    buffers = {n: t.numpy().tobytes() for n, t in tensors.items()}
    records = {}
    for name, limit in (("inline", 1 << 40), ("helper", 0)):
        monkeypatch.setattr(writer, "CRC_THREAD_BYTES", limit)
        records[name] = writer.write_part(tmp_path / name, 1, 0, plan, buffers)
    assert records["inline"]["shards"] == records["helper"]["shards"]
    data = (tmp_path / "helper" / ".tmp-step-00000001" / records["helper"]["file"]).read_bytes()
    shards = [s for ss in records["helper"]["shards"].values() for s in ss]
    assert len(shards) > len(tensors)          # chunked: several shards per tensor
    for s in shards:
        assert s["crc32"] == checksum(data[s["byte_offset"]: s["byte_offset"] + s["nbytes"]])


def test_a_save_with_non_finite_values_is_never_committed_and_latest_stays(tmp_path):
    """A diverged run: the step whose tensors hold NaN (on one writer of two) is refused at the
    commit, its directory removed, LATEST keeps naming the last good step, which the line names;
    the next finite save commits again."""
    from skiptrain.checkpoint import store as ckpt_store
    from skiptrain.checkpoint.manager import CheckpointManager
    from skiptrain.checkpoint.plan import TensorSpec

    root = tmp_path / "ck"
    specs = [TensorSpec("a", "float32", (4,)), TensorSpec("b", "float32", (4,))]
    holders = {"a": [0], "b": [1]}

    def save(step, b):
        for r, held in ((1, {"b": b}), (0, {"a": torch.ones(4)})):
            mgr = CheckpointManager(root, rank=r, ranks=[0, 1], clean=False)
            mgr.save(step, held, {"iteration": step}, specs=specs, holders=holders, blocking=True)
        return mgr.refused                     # (the committer's: for its caller to say)

    save(1, torch.zeros(4))
    (err,) = save(2, torch.tensor([0.0, float("nan"), 1.0, float("inf")]))
    assert ckpt_store.latest(root).name == "step-00000001"
    assert not (root / "step-00000002").exists() and not list(root.glob(".tmp-*"))
    assert "checkpoint step 2 not committed: 1 tensor(s) hold NaN or infinite values (b)" in err
    assert "step-00000001 stays the newest good checkpoint" in err
    save(3, torch.zeros(4))
    assert ckpt_store.latest(root).name == "step-00000003"
