"""bench/dp_compression.py: the clock on emulated links and the time to a target loss."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("bench_dp", Path(__file__).parents[2] / "bench" / "dp_compression.py")
dp = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(dp)


def _rec(step_s, val):
    return {"step_s": step_s, "val": val}


def test_clock_adds_the_link_seconds_of_every_step():
    assert dp.clock(_rec([1.0, 2.0, 0.5], []), 10.0) == [11.0, 23.0, 33.5]


def test_time_to_is_the_clock_at_the_first_validation_point_at_or_below_the_target():
    rec = _rec([1.0] * 4, [[2, 6.0], [3, 5.0], [4, 4.0]])
    assert dp.time_to(rec, 1.0, 5.0) == 6.0       # step 3 reaches 5.0: 3 x (1 + 1)
    assert dp.time_to(rec, 0.0, 3.9) is None      # never reached


def test_seconds_to_adamw_final_per_seed():
    recs = {("adamw_allreduce", "steps", 4): [_rec([1.0] * 4, [[4, 5.0]])],
            ("m", "steps", 4): [_rec([0.5] * 4, [[2, 5.5], [4, 4.9]])],
            ("m", "long", 8): [_rec([0.5] * 8, [[2, 5.5], [4, 5.2], [6, 4.8], [8, 4.5]])]}
    assert dp.seconds_to(recs, "adamw_allreduce", 4, 10.0, 5.0) == [44.0]
    assert dp.seconds_to(recs, "m", 4, 0.0, 5.0) == [2.0]          # the 4-step run reaches it first
    assert dp.seconds_to(recs, "m", 4, 0.0, 4.6) == [4.0]          # only the long run does
    assert dp.seconds_to(recs, "m", 4, 0.0, 4.0) == [None]


def test_short_link_runs_cover_whole_sync_periods():
    assert dp.shaped_steps("adamw_allreduce") == 3 and dp.shaped_steps("diloco_h10") == 10
    assert dp.shaped_steps("sparseloco_h5_k40") == 5 and dp.shaped_steps("sparseloco_h2_k16") == 4
