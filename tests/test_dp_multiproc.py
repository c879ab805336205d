"""Multi-process data-parallel tests: gloo on 127.0.0.1, spawned replicas of the tiny model."""

import hashlib

import pytest

from skiptrain.config import build_config
from skiptrain.data.corpus import Document
from skiptrain.data.dataset import write_dataset
from skiptrain.runtime.dataparallel import HarnessError, run_data_parallel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpdata")
    text = "".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 13}.\n" for i in range(3000))
    write_dataset(d, [Document("a", text, hashlib.sha256(text.encode()).hexdigest())], tokenizer="byte")
    return d


def _cfg(*ov):
    return build_config("tiny", overrides=["model.n_layers=2", "model.n_stages=2", "train.eval_every=0",
                                           "train.eval_batches=3", *ov])


def test_demo_replicas_identical_with_an_idle_replica(data):
    """4 replicas, 3 samples per step: rank 3 never processes a micro-batch yet stays identical."""
    cfg = _cfg("train.steps=25", "train.micro_batch=1", "train.n_micro=3", "dp.strategy=demo", "dp.topk=4",
               "dp.values=sign1", "dp.indices=u12", "dp.check_every=5")
    r = run_data_parallel(cfg, 4, data, timeout_s=240)
    assert len({tuple(h) for h in r["all_hashes"]}) == 1
    assert r["losses_mean"][-1] < r["losses_mean"][0] - 0.3
    s = r["summary"]
    assert s["syncs"] == 25 and s["payload_bytes_per_step"] == s["payload_bytes_per_sync"] > 0
    assert s["received_bytes_per_step"] == 3 * s["payload_bytes_per_step"]


@pytest.mark.parametrize("strategy", ["allreduce_bf16", "powersgd", "diloco"])
def test_baselines_stay_identical(data, strategy):
    cfg = _cfg("train.steps=4", "train.micro_batch=2", "train.n_micro=3", f"dp.strategy={strategy}",
               "dp.sync_every=2", "dp.check_every=2")
    r = run_data_parallel(cfg, 2, data, timeout_s=240)
    assert len({tuple(h) for h in r["all_hashes"]}) == 1
    assert r["summary"]["syncs"] == (2 if strategy == "diloco" else 4)


@pytest.mark.parametrize("kind,words", [("nan", "non-finite|scale"), ("index", "out of range|duplicate")])
def test_malformed_peer_payload_is_rejected_naming_the_peer(data, kind, words):
    cfg = _cfg("train.steps=4", "dp.strategy=demo", "dp.topk=4", "dp.values=sign1",
               "dp.indices=u16" if kind == "index" else "dp.indices=u12", "dp.chunk=16")
    with pytest.raises(HarnessError, match=rf"PayloadError: payload from peer rank 1 rejected: .*({words})"):
        run_data_parallel(cfg, 2, data, fault={"rank": 1, "kind": kind}, timeout_s=240)


def test_divergence_is_detected_naming_the_tensor(data):
    cfg = _cfg("train.steps=6", "dp.strategy=demo", "dp.topk=4", "dp.values=sign1", "dp.indices=u12",
               "dp.check_every=2")
    with pytest.raises(HarnessError, match=r"ConsistencyError: .*norm\.weight differs on ranks \[1\]"):
        run_data_parallel(cfg, 2, data, fault={"rank": 1, "kind": "diverge", "step": 2}, timeout_s=240)
