import json

import numpy as np
import pytest

from skiptrain.data.corpus import read_documents
from skiptrain.data.dataset import TokenDataset, split_document, write_splits
from skiptrain.data.loader import SampleSource, ShardedLoader, shard_indices
from skiptrain.data.tokenizer import BPETokenizer, ByteTokenizer
from skiptrain.errors import DataError

TEXT = "Though this be madness, yet there is method in't.\nWhat's Hecuba to him? — ünïcödé ✓\n"


def test_byte_tokenizer_round_trip():
    t = ByteTokenizer()
    assert t.decode(t.encode(TEXT)) == TEXT
    assert max(t.encode(TEXT)) < 256


def test_bpe_tokenizer_round_trip(tmp_path, bpe_data):
    tok = BPETokenizer.load(bpe_data / "tokenizer.json")
    assert tok.vocab_size <= 512
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert len(tok.encode(TEXT)) < len(TEXT.encode())  # it compresses
    tok.save(tmp_path / "t.json")
    assert BPETokenizer.load(tmp_path / "t.json").encode(TEXT) == tok.encode(TEXT)


def test_dataset_manifest_and_splits(byte_data):
    ds = TokenDataset.open(byte_data)
    m = json.loads((byte_data / "manifest.json").read_text())
    assert m["tokenizer"] == {"kind": "byte", "vocab_size": 256}
    assert len(ds.tokens("train")) == m["tokens"]["train"] > 10 * m["tokens"]["val"] / 2
    assert ds.has_split("ood")
    assert ds.tokenizer.decode(ds.tokens("train")[:40]).startswith("HAMLET")


def test_split_document_is_disjoint_and_complete():
    text = "".join(f"line {i}\n" for i in range(100))
    a, b = split_document(text, 0.1)
    assert a + b == text and b.startswith("line") and 0.05 < len(b) / len(text) < 0.2


def test_missing_and_corrupt_dataset(tmp_path, byte_data):
    with pytest.raises(DataError, match="run `skiptrain prepare --out"):
        TokenDataset.open(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt"):
        TokenDataset.open(bad)
    # truncated token file
    import shutil
    cp = tmp_path / "cp"
    shutil.copytree(byte_data, cp)
    with open(cp / "val.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="truncated"):
        TokenDataset.open(cp)


def test_unreadable_text(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_documents([str(tmp_path / "missing.txt")])
    b = tmp_path / "bin.dat"
    b.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DataError, match="looks binary"):
        read_documents([str(b)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no readable text"):
        read_documents([str(tmp_path / "empty")])


def test_loader_is_deterministic(byte_data):
    ds = TokenDataset.open(byte_data)
    a = SampleSource(ds.tokens("train"), 32, seed=7)
    b = SampleSource(ds.tokens("train"), 32, seed=7)
    xa, ya = a.batch(range(10))
    xb, yb = b.batch(range(10))
    assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    assert np.array_equal(xa[:, 1:], ya[:, :-1])  # targets are inputs shifted by one
    # every window appears exactly once per epoch
    assert sorted(a.window(g) for g in range(a.n)) == list(range(a.n))


def test_loader_resume_and_reshard_no_repeat_no_gap(byte_data):
    ds = TokenDataset.open(byte_data)
    src = SampleSource(ds.tokens("train"), 32, seed=1)
    seen = []
    one = ShardedLoader(src, global_batch=12, rank=0, world=1)
    for _ in range(5):
        seen += one.indices()
        one.next_batch()
    state = one.state_dict()
    # resume under 3 replicas, then 2, from the saved cursor
    for world, steps in ((3, 4), (2, 3)):
        loaders = [ShardedLoader(src, 12, rank=r, world=world) for r in range(world)]
        for ld in loaders:
            ld.load_state_dict(state)
        for _ in range(steps):
            for ld in loaders:
                seen += ld.indices()
                ld.next_batch()
        state = loaders[0].state_dict()
    assert sorted(seen) == list(range(12 * 12))
    # and the samples themselves match a single-replica run over the same cursors
    x_single, _ = src.batch(range(60, 72))
    x_shards = [src.batch(shard_indices(60, 12, r, 3))[0] for r in range(3)]
    got = {tuple(row.tolist()) for x in x_shards for row in x}
    assert got == {tuple(row.tolist()) for row in x_single}


def test_loader_rejects_other_seed(byte_data):
    ds = TokenDataset.open(byte_data)
    ld = ShardedLoader(SampleSource(ds.tokens("train"), 32, seed=1), 4)
    with pytest.raises(DataError, match="same train.seed"):
        ld.load_state_dict({"cursor": 8, "seed": 2})


def _copy_dataset(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_token_ids_outside_the_vocabulary_are_a_clear_error(tmp_path, byte_data):
    d = _copy_dataset(byte_data, tmp_path / "d")
    mf = json.loads((d / "manifest.json").read_text())
    mf["tokenizer"]["vocab_size"] = 100  # byte data holds ids up to 255
    (d / "manifest.json").write_text(json.dumps(mf))
    ds = TokenDataset.open(d)
    with pytest.raises(DataError, match=r"train.bin holds token id \d+ at position \d+, outside the vocabulary of "
                                        r"100.*re-run `skiptrain prepare"):
        ds.tokens("train")


def test_an_empty_validation_split_is_a_clear_error(tmp_path, byte_data):
    d = _copy_dataset(byte_data, tmp_path / "d")
    mf = json.loads((d / "manifest.json").read_text())
    mf["tokens"]["val"] = 0
    (d / "manifest.json").write_text(json.dumps(mf))
    (d / "val.bin").write_bytes(b"")
    ds = TokenDataset.open(d)
    with pytest.raises(DataError, match=r"the 'val' split of data set .* is empty \(0 tokens\); re-run"):
        ds.tokens("val")


def test_a_derived_data_set_holds_its_splits_with_the_base_tokenizer(bpe_data, tmp_path):
    base = TokenDataset.open(bpe_data)
    train = np.asarray(base.tokens("train"))[100:100 + 33 * 8 + 1]
    d = write_splits(tmp_path / "cut", base, {"train": train, "val": base.tokens("val")}, "a cut")
    assert np.array_equal(d.tokens("train"), train) and np.array_equal(d.tokens("val"), base.tokens("val"))
    assert d.vocab_size == base.vocab_size and d.tokenizer.encode("to be or not") == base.tokenizer.encode("to be or not")
    assert not d.has_split("ood") and d.manifest["source"] == "a cut"
    assert SampleSource(d.tokens("train"), 32, seed=1).n == 8


@pytest.mark.parametrize("edit,needle", [
    (lambda m: [m], "holds a JSON list, not an object"),
    (lambda m: {**m, "dtype": "float99"}, "'dtype' is 'float99'"),
    (lambda m: {**m, "tokenizer": "byte"}, "'tokenizer' is 'byte'"),
    (lambda m: {**m, "tokenizer": {"kind": "byte", "vocab_size": "x"}}, "'tokenizer.vocab_size' is 'x'"),
    (lambda m: {**m, "tokenizer": {"kind": "byte", "vocab_size": 0}}, "'tokenizer.vocab_size' is 0"),
    (lambda m: {k: v for k, v in m.items() if k != "tokens"}, "'tokens' is None"),
    (lambda m: {**m, "tokens": {"../train": 5}}, "'tokens' is"),
])
def test_a_manifest_with_wrong_fields_is_one_line_naming_the_field(tmp_path, byte_data, edit, needle):
    d = _copy_dataset(byte_data, tmp_path / "d")
    mf = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(edit(mf)))
    with pytest.raises(DataError, match="re-run `skiptrain prepare --out") as e:
        TokenDataset.open(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_huge_bpe_vocabulary_is_refused_before_the_tokenizer_allocates_it(tmp_path):
    from skiptrain.data.corpus import Document
    from skiptrain.data.dataset import write_dataset

    with pytest.raises(DataError, match="above the largest a model takes"):
        write_dataset(tmp_path / "d", [Document("a", TEXT * 20, "0")], tokenizer="bpe", vocab_size=10 ** 11)
    assert not (tmp_path / "d").exists()


def test_an_interrupted_write_of_a_token_file_leaves_no_tmp_file(tmp_path, byte_data, monkeypatch):
    """Ctrl-C while `prepare` writes a split left a half-written `train.bin.tmp` (296 MB once)."""
    base = TokenDataset.open(byte_data)

    class Interrupted(np.ndarray):
        def tofile(self, path, *a, **k):
            open(path, "wb").write(b"\0" * 1000)
            raise KeyboardInterrupt

    asarray = np.asarray
    monkeypatch.setattr(np, "asarray", lambda v, dtype=None: asarray(v, dtype=dtype).view(Interrupted))
    with pytest.raises(KeyboardInterrupt):
        write_splits(tmp_path / "d", base, {"train": np.arange(10)}, "test")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == []
