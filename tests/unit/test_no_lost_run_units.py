"""No run is lost: a recovering swarm whose body stage has a single node keeps per-stage
checkpoints by default, so losing that node still ends in a complete, loadable model; SIGTERM to
the launcher stops every process it started and saves the newest complete set of stage checkpoints.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_no_lost_run.py."""

from __future__ import annotations

from skiptrain.config import build_config


PLACEMENT = [[0, 1], [2, 3], [4], [5]]          # the documented 2,2,1,1 layout


def test_single_copy_stages_are_checkpointed_often_under_recover():
    from skiptrain.cli.launch import ckpt_every_for

    cfg = build_config("tiny", overrides=["runtime.recover=true"])
    assert ckpt_every_for(cfg, PLACEMENT, 20) == 2 and ckpt_every_for(cfg, PLACEMENT, 3) == 1
    assert ckpt_every_for(cfg, PLACEMENT, 1000) == 10
    assert ckpt_every_for(cfg, [[0, 1], [2, 3], [4, 5]], 20) == 100          # every body stage replicated
    cfg.checkpoint.every = 1
    assert ckpt_every_for(cfg, PLACEMENT, 20) == 1                            # a shorter interval stands
    assert ckpt_every_for(build_config("tiny"), PLACEMENT, 20) == 100         # no recovery: as configured
