"""bench/flagship.py: the ladder with its equal-tokens rung, the clocks of a pipeline timing run,
the figures at equal time and tokens, and what the events run counts."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_flagship", Path(__file__).parents[2] / "bench" / "flagship.py")
fl = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = fl
SPEC.loader.exec_module(fl)


def test_the_ladder_starts_at_the_baselines_tokens_then_its_fractions_in_whole_periods():
    side = fl.Side("f", [], {}, ladder=(0.5, 1.0))
    # baseline 150 iterations x 10 s = 1500 s; flagship 3 s an iteration: 500 fit
    assert fl.ladder(side, 150, 1500.0, 3.0, 5) == [(pytest.approx(0.3), 150), (0.5, 250), (1.0, 500)]
    # a fraction landing on the equal-tokens length is one rung, not two
    side = fl.Side("f", [], {}, ladder=(0.3, 1.0))
    assert [st for _, st in fl.ladder(side, 150, 1500.0, 3.0, 5)] == [150, 500]
    # the nearest whole period, but no rung longer than the baseline's wall-clock: 1214.55 s / 3.3798 s = 359.4
    side = fl.Side("f", [], {}, ladder=(0.65, 1.0))
    assert [st for _, st in fl.ladder(side, 150, 1214.55, 3.3798, 5)] == [150, 235, 355]


def test_pipeline_clocks_skip_the_warm_up_period_and_take_the_simulator_as_own_compute():
    rec = {"time": [0.0, 5.0, 8.0, 11.0, 14.0, 17.0], "cpu_s": [9.0, 9.0, 4.0, 4.0, 4.0, 4.0],
           "payload_bytes": [10, 10, 12, 12, 12, 12], "overruns": 3}
    c = fl.pipeline_clock(rec, period=2, nodes=8, cores=2, sim_s=2.5)
    assert c["machine"] == pytest.approx(3.0)                  # 5 -> 17 over 4 iterations
    assert c["own"] == c["simulated_s"] == 2.5
    assert c["host_floor_s"] == pytest.approx(2.0) and c["node_cpu_s"] == pytest.approx(0.5)
    assert c["payload_bytes"] == 12 and c["overruns"] == 3


def _rung(steps, val, per):
    return {"steps": steps, "val_mean": val, "fraction": None, "time_s": {c: steps * per[c] for c in fl.CLOCKS}}


def _race_out():
    base = {"machine": 10.0, "own": 9.0}
    flag = {"machine": 4.0, "own": 3.0}
    return {"baseline_steps": 100, "sides": {
        "baseline": {"clock": base, "rungs": [_rung(100, 5.0, base)], "tuning": {}},
        "flagship": {"clock": flag, "rungs": [_rung(100, 5.1, flag), _rung(125, 4.98, flag), _rung(250, 4.8, flag)],
                     "tuning": {}}}}


def test_score_reads_every_figure_on_both_clocks():
    out = fl.score(_race_out())
    assert out["iteration_speedup"] == {"machine": 2.5, "own": 3.0}
    # the 125-iteration rung reaches 5.0: 500 s against 1000 s here, 375 s against 900 s on own compute
    assert out["speedup_to_baseline_loss"] == {"machine": 2.0, "own": pytest.approx(2.4)}
    # at the baseline's 1000 s the 250-iteration rung (1000 s) fits; at its 900 s own, 250 x 3 = 750 s fits
    assert out["equal_time_loss_ratio"] == {"machine": pytest.approx(0.96), "own": pytest.approx(0.96)}
    assert out["equal_tokens_loss_ratio"] == pytest.approx(1.02)
    rows = {r["figure"]: r for r in fl.figures({**out})}
    assert rows["iteration_speedup"]["met"] is False and rows["iteration_speedup"]["own"] == 3.0
    assert rows["speedup_to_baseline_loss"]["met"] and rows["equal_tokens_loss_ratio"]["met"]


def test_no_rung_reaching_the_baseline_is_reported_not_invented():
    out = _race_out()
    for r in out["sides"]["flagship"]["rungs"]:
        r["val_mean"] += 1.0
    out = fl.score(out)
    assert out["speedup_to_baseline_loss"] == {"machine": None, "own": None}
    row = [r for r in fl.figures(out) if r["figure"] == "speedup_to_baseline_loss"][0]
    assert row["machine"] is None and row["met"] is False


def test_equal_time_takes_the_longest_rung_that_fits():
    per = {"machine": 2.0, "own": 1.0}
    rungs = [_rung(100, 5.0, per), _rung(200, 4.9, per), _rung(400, 4.7, per)]
    assert fl.equal_time_ratio(rungs, 400.0, "machine", 5.0) == pytest.approx(4.9 / 5.0)
    assert fl.equal_time_ratio(rungs, 400.0, "own", 5.0) == pytest.approx(4.7 / 5.0)
    assert fl.equal_time_ratio(rungs, 100.0, "machine", 5.0) is None


def test_overrides_are_flattened_with_config_spelling():
    assert fl.flat({"train": {"lr": 0.002, "progress": False}, "elastic": {"enabled": True}}) == [
        "train.lr=0.002", "train.progress=false", "elastic.enabled=true"]


def test_freezing_log_is_split_per_phase_by_its_steps(tmp_path):
    rows = [{"step": 5, "frozen_after": 0}, {"step": 10, "frozen_after": 2}, {"step": 5, "frozen_after": 0},
            {"step": 10, "frozen_after": 0}]
    (tmp_path / "elastic.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert fl.frozen_by_phase(tmp_path, 2) == [2, 0]
    assert fl.frozen_by_phase(tmp_path, 3) == [None, None, None]     # cannot be told apart
    assert fl.frozen_by_phase(tmp_path / "none", 2) == [None, None]


def test_events_come_in_order_on_body_replicas():
    faults, plan = fl.event_script(150, [[0, 1], [2, 3, 4], [5, 6], [7]])
    assert [(f["kind"], f["node"], f["iteration"]) for f in faults] == [("kill", 4, 22), ("hang", 6, 38)]
    assert 38 < plan["join_after"] < plan["whole_kill_after"] <= 150


def test_samples_lost_and_repeated_over_committed_iterations(tmp_path):
    d = tmp_path / "phases" / "train"
    d.mkdir(parents=True)
    (d / "samples_node0.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"iteration": 0, "samples": [0, 1]}, {"iteration": 1, "samples": [2, 2]})))
    assert fl.sample_check(tmp_path, 2, 2) == (1, 1)


def test_a_try_replaces_the_flagships_overrides_by_key_spelled_as_the_grid_spells_them():
    base = ["train.skip_ratio=0.33", "dp.topk=8", "train.lr=0.004"]
    out = fl.with_overrides(base, ["train.lr=1e-3", "dp.topk=32", "dp.strategy=sparseloco"])
    assert sorted(out) == sorted(["train.skip_ratio=0.33", "dp.topk=32", "train.lr=0.001", "dp.strategy=sparseloco"])
    # the same run the race's grid would train has the same records key
    assert fl.Runner.key(fl.with_overrides(base, ["train.lr=0.002"]), 365, 0) == fl.Runner.key(
        base[:2] + fl.lrs(2e-3)[0], 365, 0)
