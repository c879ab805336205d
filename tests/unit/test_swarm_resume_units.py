"""A swarm job survives a crash: whole-job checkpoints, exact resume, resume under other layouts.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_swarm_resume.py."""

from __future__ import annotations

import pytest

from skiptrain.checkpoint.format import CheckpointError
from skiptrain.runtime.job_checkpoint import check_root_writable, is_weight_name, replica_name, resume_point


def test_checkpoint_names_and_resume_points(tmp_path):
    assert replica_name(0, "layers.1.mlp.w1.weight") == "layers.1.mlp.w1.weight"
    assert replica_name(2, "sync.momentum_coeffs.embed.weight") == "replica2.sync.momentum_coeffs.embed.weight"
    assert is_weight_name("layers.0.attn.wq.weight") and is_weight_name("embed.weight")
    assert not any(is_weight_name(n) for n in ("optim.step.embed.weight", "sync.anchor.x", "replica1.embed.weight"))
    with pytest.raises(CheckpointError, match="no committed checkpoint at"):
        resume_point(tmp_path)


def test_a_checkpoint_root_a_node_cannot_write_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError) as e:
        check_root_writable(blocker / "ckpt", 3)
    msg = str(e.value)
    assert "node 3 cannot write the checkpoint root" in msg and "checkpoint.dir" in msg and "\n" not in msg
