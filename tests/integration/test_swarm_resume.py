"""A swarm job survives a crash: whole-job checkpoints, exact resume, resume under other layouts.

The units (no process started) are in tests/unit/test_swarm_resume_units.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import launch_in_a_process, metrics_lines, processes_of_run, wait_for
from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.checkpoint.weights import load_weights
from skiptrain.config import build_config
from skiptrain.data.dataset import TokenDataset
from skiptrain.data.loader import SampleSource
from skiptrain.model.transformer import StagedLM
from skiptrain.runtime.job import Job, build_cost, build_schedule, build_topology, phase_for
from skiptrain.runtime.job_checkpoint import load_node_state, resume_point
from skiptrain.runtime.launcher import launch
from skiptrain.runtime.recovery import trained_samples


ITERS = 20


def _cfg(dp: dict | None = None, nodes: int = 6, sizes: str = "2,2,1,1", every: int = 2):
    """The tiny model, k=0 (every micro-batch through every stage), checkpoints every ``every``."""
    return build_config("tiny", overrides={
        "model": {"n_stages": len(sizes.split(","))},
        "runtime": {"nodes": nodes, "stage_sizes": sizes, "mb_per_originator": 2, "timeout_s": 20},
        "train": {"steps": ITERS, "warmup_steps": 2}, "checkpoint": {"every": every}, "dp": dp or {}})


def _job(cfg, data: Path, run: Path, iterations: int = ITERS, resume: dict | None = None) -> Job:
    cfg.model.vocab_size = TokenDataset.open(data).vocab_size
    topo = build_topology(cfg, cfg.runtime.nodes)
    cost = build_cost(cfg, s_per_sample_layer=0.001)
    sched = build_schedule(cfg, "full_pipeline", topo, cost)
    return Job(config=cfg.to_dict(), data_path=str(data), run_dir=str(run),
               phases=[phase_for(cfg, sched, topo, cost, "train", iterations, save_weights=True)], resume=resume)


def _kill_everything(launcher, run: Path) -> None:
    os.kill(launcher.pid, signal.SIGKILL)
    for pid in processes_of_run(run):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=30)
    wait_for(lambda: processes_of_run(run) == [], 30)


@pytest.mark.slow
@pytest.mark.parametrize("dp", [{}, {"strategy": "demo", "chunk": 16, "topk": 4}], ids=["allreduce", "demo"])
def test_a_crashed_job_resumes_exactly(byte_data, tmp_path, dp):
    """6 nodes (2/2/1/1, k=0), a checkpoint every 2 iterations: the launcher and every node are
    SIGKILLed at a random moment of the first 10 iterations; ``resume`` continues to 20 and ends
    with the parameters of an uninterrupted 20-iteration run; no sample is lost or repeated."""
    ref = tmp_path / "ref"
    launch(_job(_cfg(dp), byte_data, ref), timeout_s=300)
    run = tmp_path / "run"
    run.mkdir()
    launcher = launch_in_a_process(_job(_cfg(dp), byte_data, run).save(tmp_path / "job.json"))
    wait_for(lambda: (run / "checkpoints" / "LATEST").exists(), 180)
    rng = random.Random(os.getpid())
    target = rng.randint(2, 9)                     # a random moment before iteration 10 ends
    wait_for(lambda: metrics_lines(run) >= target, 120)
    time.sleep(rng.uniform(0.0, 0.3))
    _kill_everything(launcher, run)
    start = resume_point(run / "checkpoints")
    assert 2 <= start["iteration"] < ITERS and start["iteration"] % 2 == 0
    res = launch(_job(_cfg(dp), byte_data, run, resume=start), timeout_s=300)
    assert [r["step"] for r in res.phase_iterations("train")][-1] == ITERS
    a, b = load_weights(ref / "model.safetensors"), load_weights(run / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run differs from the uninterrupted one by {worst:.3g}"
    gb = 4 * 8        # 2 originators x 2 micro-batches x micro_batch 8
    per_it = trained_samples(run / "phases" / "train")
    assert sorted(per_it) == list(range(ITERS))
    assert sorted(i for s in per_it.values() for i in s) == list(range(ITERS * gb))


def _first_loss_after(run: Path, it: int) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return next(r["loss"] for r in rows if r["step"] == it + 1)


def _fresh_loss(ckpt: str, cfg, data: Path, cursor: int, gb: int) -> float:
    """The saved weights' mean loss on training samples ``cursor .. cursor + gb``."""
    model = StagedLM(cfg.model, seed=123)
    load_node_state(ckpt, model)
    src = SampleSource(TokenDataset.open(data).tokens("train"), cfg.model.seq_len, seed=cfg.train.seed)
    mb = cfg.train.micro_batch
    with torch.no_grad():
        losses = [model(*src.batch(range(c, c + mb)))[1].item() for c in range(cursor, cursor + gb, mb)]
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_a_checkpoint_resumes_under_other_layouts(byte_data, tmp_path):
    """The 6-node (4-stage) checkpoint resumes on 4 nodes with 3 stages and on 1 node: the first
    loss after resuming is the saved weights' loss on that batch, and the loss goes on falling."""
    run = tmp_path / "run"
    launch(_job(_cfg(), byte_data, run, iterations=4), timeout_s=300)
    start = resume_point(run / "checkpoints")
    assert start["iteration"] == 4 and start["cursor"] == 4 * 32
    ckpt = str(shutil.copytree(start["path"], tmp_path / "saved" / "step-00000004"))   # the resumed run prunes
    reader = CheckpointReader(ckpt)
    assert reader.names("optim.exp_avg.") and reader.state["data"]["cursor"] == 128

    cfg3 = _cfg(nodes=4, sizes="2,1,1")
    cfg3.train.steps = 10
    res = launch(_job(cfg3, byte_data, run, iterations=10, resume=start), timeout_s=300)
    cfg3.model.vocab_size = TokenDataset.open(byte_data).vocab_size
    losses = [r["loss"] for r in res.phase_iterations("train") if r["step"] > 4]
    assert len(losses) == 6
    assert losses[0] == pytest.approx(_fresh_loss(ckpt, cfg3, byte_data, 128, 2 * 2 * 8), abs=2e-4)
    assert sum(losses[-2:]) / 2 < losses[0]

    from skiptrain.train.trainer import Trainer

    cfg1 = build_config("tiny", overrides={"train": {"steps": 10, "warmup_steps": 2, "n_micro": 4},
                                           "checkpoint": {"every": 0, "final": False}})
    t = Trainer(cfg1, None, dataset=TokenDataset.open(byte_data))
    t.resume(ckpt)
    assert t.step == 4 and t.loader.cursor == 128
    first = t.train_step().loss
    assert first == pytest.approx(_fresh_loss(ckpt, t.cfg, byte_data, 128, t.loader.global_batch), abs=1e-4)
    later = [t.train_step().loss for _ in range(5)]
    assert sum(later[-2:]) / 2 < first
