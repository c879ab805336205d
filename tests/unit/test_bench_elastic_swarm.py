"""bench/elastic_swarm.py: how far the unfrozen run strays from the guard's projection."""

import importlib.util
import math
from pathlib import Path

from skiptrain.config import build_config
from skiptrain.optim import lr_clock

BENCH = Path(__file__).parents[2] / "bench"
SPEC = importlib.util.spec_from_file_location("bench_elastic_swarm", BENCH / "elastic_swarm.py")
es = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(es)

CFG = build_config("tiny", overrides={"train": {"steps": 200, "warmup_steps": 20, "lr": 1e-3}})


def _log(first_freeze: int) -> list[dict]:
    out = [{"step": s, "action": "warmup", "frozen_before": 0, "val_loss": None} for s in (10, 20)]
    out += [{"step": s, "action": "hold", "frozen_before": 0, "val_loss": 4.0} for s in range(30, first_freeze, 10)]
    out.append({"step": first_freeze, "action": "freeze", "frozen_before": 0, "val_loss": 4.0})
    out.append({"step": first_freeze, "action": "transition", "frozen_before": 0})
    return out + [{"step": first_freeze + 10, "action": "undo", "frozen_before": 1, "val_loss": 4.0}]


def _static(fn) -> dict:
    return {"static": [{"step": s, "val_loss": fn(s)} for s in range(10, 201, 10)]}


def test_a_run_on_the_projections_own_curve_never_strays_above_it():
    on_fit = _static(lambda s: 5.0 - 0.2 * math.log(lr_clock(s, CFG.train)))
    r = es.guard_projection_error(CFG, on_fit, _log(50), guard_ref=4)
    assert r["ref_steps"] == [30, 40, 50]
    assert abs(r["max_excess"]) < 1e-9 and abs(r["first_check"]) < 1e-9


def test_a_run_that_levels_off_strays_above_the_projection_more_the_longer_it_goes():
    level = _static(lambda s: 5.0 - 0.2 * math.log(lr_clock(min(s, 40), CFG.train)))
    r = es.guard_projection_error(CFG, level, _log(40), guard_ref=4)
    assert r["ref_steps"] == [30, 40] and r["at_step"] == 200
    assert 0 < r["first_check"] < r["max_excess"]
    ex = [r["excess_by_step"][str(s)] for s in range(50, 201, 10)]
    assert ex == sorted(ex) and r["first_check"] == ex[0]


def test_no_freeze_no_figure():
    assert es.guard_projection_error(CFG, _static(lambda s: 4.0), [], guard_ref=4) is None


def test_the_swarm_guard_takes_the_benchs_reference_points_and_windows():
    from argparse import Namespace

    args = Namespace(alpha=0.5, swarm_check_every=10, tol=0.2, start_window=3, stable_windows=2, guard_tol=0.005,
                     guard_confirm=1, guard_min_ref=2, swarm_guard_windows=16, swarm_cache="on",
                     swarm_cache_share="location", swarm_prefill_min_gain=1.0, swarm_prefill_hold=1)
    e = es.elastic_settings(args, micro_batch=1)
    assert e["guard_ref"] == es.GUARD_REF and e["guard_batches"] == 16
    assert es.elastic_settings(args, micro_batch=4)["guard_batches"] == 4
    build_config("tiny", overrides={"elastic": e})        # a valid elastic section
