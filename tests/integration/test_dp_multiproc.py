"""Data parallelism on the node runtime: one stage holding the whole model, N replicas, each sync
strategy; replica consistency, an idle replica, malformed payloads and divergence."""

import hashlib
import json

import pytest

from skiptrain.config import build_config
from skiptrain.data.corpus import Document
from skiptrain.data.dataset import write_dataset
from skiptrain.runtime.failure import RuntimeFailure
from skiptrain.runtime.faults import faulty_job
from skiptrain.runtime.job import Job, data_parallel_phase, with_runtime
from skiptrain.runtime.launcher import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpdata")
    text = "".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 13}.\n" for i in range(3000))
    write_dataset(d, [Document("a", text, hashlib.sha256(text.encode()).hexdigest())], tokenizer="byte")
    return d


def _cfg(*ov):
    return build_config("tiny", overrides=["model.n_layers=2", "model.n_stages=1", "train.eval_every=0",
                                           "train.eval_batches=3", "runtime.timeout_s=60", *ov])


def _run(cfg, nodes, data, run_dir, **job):
    """Launch one data-parallel phase; returns (metrics rows, node records)."""
    j = Job(config=with_runtime(cfg.to_dict(), timeout_s=60), data_path=str(data), run_dir=str(run_dir),
            phases=[data_parallel_phase(cfg, "dp", nodes)], **job)
    res = launch(j, timeout_s=240)
    recs = [json.loads((run_dir / "phases" / "dp" / f"node{r}.json").read_text()) for r in range(nodes)]
    return res.phase_metrics("dp"), recs


def _identical(recs) -> bool:
    return len({tuple(r["sync_summary"]["param_hashes"]) for r in recs}) == 1


def test_demo_replicas_identical_with_an_idle_replica(data, tmp_path):
    """4 replicas, 3 micro-batches of 1 sample per step: node 3 never processes one yet stays identical."""
    cfg = _cfg("train.steps=25", "train.micro_batch=1", "train.n_micro=3", "dp.strategy=demo", "dp.topk=4",
               "dp.values=sign1", "dp.indices=u12", "dp.check_every=5")
    rows, recs = _run(cfg, 4, data, tmp_path / "run")
    assert _identical(recs)
    assert all(it["n_processed"] == 0 for it in recs[3]["iterations"])
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 25 and losses[-1] < losses[0] - 0.3, losses
    s = recs[0]["sync_summary"]
    assert s["syncs"] == 25 and s["payload_bytes_per_step"] == s["payload_bytes_per_sync"] > 0
    assert s["received_bytes_per_step"] == 3 * s["payload_bytes_per_step"]
    assert any("val_loss" in r for r in rows)             # validated in the loop after the last step


@pytest.mark.parametrize("strategy", ["allreduce_bf16", "powersgd", "diloco", "sparseloco"])
def test_baselines_stay_identical(data, tmp_path, strategy):
    cfg = _cfg("train.steps=4", "train.micro_batch=2", "train.n_micro=3", f"dp.strategy={strategy}",
               "dp.sync_every=2", "dp.check_every=2")
    _, recs = _run(cfg, 2, data, tmp_path / "run")
    assert _identical(recs)
    assert recs[0]["sync_summary"]["syncs"] == (2 if strategy in ("diloco", "sparseloco") else 4)


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_a_local_step_method_ends_with_identical_replicas_whatever_the_run_length(data, tmp_path, strategy):
    """5 steps with a sync every 2: the last sync is at step 5, not 4 (before, the replicas ended
    apart and the saved model was one replica's local weights)."""
    cfg = _cfg("train.steps=5", "train.micro_batch=2", "train.n_micro=3", f"dp.strategy={strategy}",
               "dp.sync_every=2", "dp.check_every=0")
    _, recs = _run(cfg, 2, data, tmp_path / "run")
    assert _identical(recs)
    assert recs[0]["sync_summary"]["syncs"] == 3


@pytest.mark.parametrize("kind,words", [("payload_nan", "non-finite|scale"), ("payload_index", "out of range|duplicate")])
def test_malformed_peer_payload_is_rejected_naming_the_peer(data, tmp_path, kind, words):
    cfg = _cfg("train.steps=4", "dp.strategy=demo", "dp.topk=4", "dp.values=sign1",
               "dp.indices=u16" if kind == "payload_index" else "dp.indices=u12", "dp.chunk=16")
    with pytest.raises(RuntimeFailure, match=rf"PayloadError: payload from peer rank 1 rejected: .*({words})"):
        _run(cfg, 2, data, tmp_path / "run", **faulty_job({"node": 1, "kind": kind}))


def test_a_member_sending_nan_to_the_dense_all_reduce_is_named_not_its_peers(data, tmp_path):
    """An all-reduce cannot say who sent what: a non-finite sum is done again as an all-gather of
    the contributions, and the sender is blamed (before, NaN weights made a node downstream of
    it look like the culprit)."""
    cfg = _cfg("train.steps=6", "dp.strategy=allreduce")
    with pytest.raises(RuntimeFailure, match=r"BadPayload: node 0: rejected the DP sync: node\(s\) \[1\] sent non-finite"):
        _run(cfg, 2, data, tmp_path / "run", **faulty_job({"node": 1, "kind": "grad_nan", "iteration": 2}))


def test_divergence_is_detected_naming_the_tensor(data, tmp_path):
    cfg = _cfg("train.steps=6", "dp.strategy=demo", "dp.topk=4", "dp.values=sign1", "dp.indices=u12",
               "dp.check_every=2")
    with pytest.raises(RuntimeFailure, match=r"ConsistencyError: .*norm\.weight differs on ranks \[1\]"):
        _run(cfg, 2, data, tmp_path / "run", **faulty_job({"node": 1, "kind": "diverge", "iteration": 2}))
