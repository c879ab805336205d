"""bench/dp_compression.py and its shared parts (bench/_race.py): the two clocks, the ladder, the coordinate search and the score."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_dp", Path(__file__).parents[2] / "bench" / "dp_compression.py")
dp = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = dp      # the bench's dataclasses look their module up
SPEC.loader.exec_module(dp)
from bench import _race as race  # noqa: E402  (the repository root, on the path once the bench is loaded)


def test_timing_runs_whole_sync_periods_one_of_them_to_warm_up():
    assert race.timing_steps(1, quick=False) == 7 and race.timing_steps(5, quick=False) == 15
    assert race.timing_steps(10, quick=False) == 20 and race.timing_steps(1, quick=True) == 4


def test_both_clocks_of_a_timing_run_skip_its_first_period():
    # 4 nodes, period 2, 6 steps: rows at 10, 11 (warm-up), then 13, 14, 16, 17
    rec = {"time": [10.0, 11.0, 13.0, 14.0, 16.0, 17.0], "cpu_s": [9.0, 9.0, 2.0, 2.0, 2.0, 2.0],
           "summary": {"emulated_link_s": 3.0}}
    c = race.seconds_per_step(rec, period=2, nodes=4, cores=2)
    assert c["machine"] == pytest.approx(6.0 / 4)          # 11 -> 17 over 4 steps
    assert c["link_s"] == pytest.approx(0.5)               # 3 s of emulated links over 6 steps
    assert c["node_cpu_s"] == pytest.approx(0.5)           # 8 CPU-s over 4 steps and 4 nodes
    assert c["own"] == pytest.approx(1.0) and c["host_floor_s"] == pytest.approx(1.0)


def test_rungs_are_fractions_of_the_baseline_wall_clock_in_whole_periods():
    assert race.rung_steps(0.2, baseline_s=1000.0, s_per_step=0.5, period=5) == 400
    assert race.rung_steps(0.15, baseline_s=1000.0, s_per_step=0.4, period=10) == 380   # 375 -> 38 periods
    assert race.rung_steps(0.001, baseline_s=10.0, s_per_step=1.0, period=5) == 5       # at least one period
    # the nearest whole period, but never longer than the baseline's wall-clock: 359.4 steps fit
    assert race.rung_steps(1.0, baseline_s=1214.55, s_per_step=3.3798, period=5) == 355
    assert race.rung_steps(0.65, baseline_s=1214.55, s_per_step=3.3798, period=5) == 235   # 233.6 -> nearest


def test_records_of_another_code_version_are_kept_but_not_reused(tmp_path):
    """A record is reused only by the code that trained it (the skiptrain package's source):
    one trained by other code stays in records.jsonl, and the run is trained again unless the
    caller reuses any code's records."""
    trained = []

    def launch(cfgs, run_dir):
        trained.extend(cfgs)
        return [{"val": [[1, float(len(trained))]]} for _ in cfgs]

    runner = race.Runner(tmp_path, lambda o, s, sd: (tuple(o), s, sd), launch)
    runner.train([(["a=1"], 10, 0)])
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"code": "' in lines[0]
    other = lines[0].replace(race.code_version(), "0" * 12)
    (tmp_path / "records.jsonl").write_text(other + "\n")
    again = race.Runner(tmp_path, lambda o, s, sd: (tuple(o), s, sd), launch)
    again.train([(["a=1"], 10, 0)])
    assert len(trained) == 2 and len((tmp_path / "records.jsonl").read_text().splitlines()) == 2
    reuse = race.Runner(tmp_path, lambda o, s, sd: (tuple(o), s, sd), launch, any_code=True)
    reuse.train([(["a=1"], 10, 0)])
    assert len(trained) == 2


def _rung(steps, val, per_step):
    return {"steps": steps, "val_mean": val, "time_s": {c: steps * per_step[c] for c in dp.CLOCKS}}


def test_time_to_target_is_the_shortest_rung_at_or_below_it():
    per = {"machine": 0.5, "own": 0.1}
    rungs = [_rung(300, 4.80, per), _rung(100, 5.00, per), _rung(200, 4.85, per)]
    assert race.time_to_target(rungs, 4.85) == {"machine": 100.0, "own": 20.0}
    assert race.time_to_target(rungs, 4.9) == {"machine": 100.0, "own": 20.0}
    assert race.time_to_target(rungs, 4.7) == {"machine": None, "own": None}


def test_score_divides_the_baseline_time_by_each_sides():
    per_b, per_s = {"machine": 10.0, "own": 10.0}, {"machine": 0.4, "own": 0.1}
    out = {"sides": {
        "adamw": {"rungs": [_rung(100, 4.9, per_b)], "bytes": {"ratio_payload_vs_fp32": 1.0}, "tuning": {}},
        "sparseloco": {"rungs": [_rung(200, 5.0, per_s), _rung(500, 4.88, per_s)],
                       "bytes": {"ratio_payload_vs_fp32": 1089.6}, "tuning": {}}}}
    s = dp.score(out)
    assert s["baseline_final_val"] == 4.9
    assert s["time_to_baseline_s"]["sparseloco"] == {"machine": 200.0, "own": 50.0}
    assert s["sooner_than_baseline"]["sparseloco"] == {"machine": 5.0, "own": 20.0}
    assert s["sooner_than_baseline"]["adamw"] == {"machine": 1.0, "own": 1.0}
    assert s["ratio_vs_fp32"]["sparseloco"] == 1089.6


class FakeRunner:
    """Final loss = a function of the settings; records every run asked for."""

    def __init__(self, loss):
        self.loss, self.asked = loss, []

    def train(self, runs):
        self.asked += runs
        return [{"val": [[steps, self.loss(ov)]]} for ov, steps, _ in runs]


def test_the_search_takes_each_axis_in_turn_from_the_best_so_far():
    side = race.Side("x", ["base"], {"a": [["a=1"], ["a=2"], ["a=4"]], "H": [["H=5"], ["H=10"]]},
                   start={"a": 1, "H": 0})
    # best a is 4; with a=4 H=10 is better, but with a=2 it is worse: the search must use a=4
    table = {("a=1", "H=5"): 5.0, ("a=2", "H=5"): 4.9, ("a=4", "H=5"): 4.8,
             ("a=1", "H=10"): 5.5, ("a=2", "H=10"): 5.1, ("a=4", "H=10"): 4.7}
    runner = FakeRunner(lambda ov: table[tuple(ov[1:])])
    t = race.tune(runner, side, steps=50)
    assert t["winner"] == ["a=4", "H=10"] and t["choice"] == {"a": 2, "H": 1}
    assert len(t["trials"]) == 4                       # 3 values of a, then H=10 (H=5 at a=4 is known)
    assert all(steps == 50 and seed == 0 for _, steps, seed in runner.asked)


def test_a_learning_rate_that_wins_at_the_edge_of_its_grid_is_followed_past_it():
    side = race.Side("x", ["base"], {"lr": race.lrs(1e-3, 2e-3, 4e-3)}, start={"lr": 1})
    best = {"up": 8e-3, "far": 3e-2, "down": 2.5e-4}

    def loss(where):      # lowest at best[where], rising with the distance in octaves
        return lambda ov: 4.0 + abs(math.log2(float(ov[1].split("=")[1]) / best[where]))
    assert race.tune(FakeRunner(loss("up")), side, 10)["winner"] == ["train.lr=0.008"]
    t = race.tune(FakeRunner(loss("far")), side, 10)     # doubled twice, no further
    assert t["winner"] == ["train.lr=0.016"] and len(t["trials"]) == 5
    t = race.tune(FakeRunner(loss("down")), side, 10)    # halved twice: 5e-4, 2.5e-4
    assert t["winner"] == ["train.lr=0.00025"] and t["grid"]["lr"][0] == "train.lr=0.00025"
    assert side.grid["lr"] == race.lrs(1e-3, 2e-3, 4e-3)   # the side's own grid is left as it was


def test_every_grid_setting_keeps_k_at_1000x_or_more_and_only_h_is_timed():
    side = dp.SIDES["sparseloco"]
    assert [c["H"] for c in dp.timed_choices(side)] == [0, 1]
    for h in side.grid["H"]:
        sync, topk = (int(o.split("=")[1]) for o in h)
        assert topk / sync == 8             # 8 of 4096 coefficients a step: k grows with H
    assert dp.timed_choices(dp.SIDES["adamw"]) == [dp.SIDES["adamw"].start]
