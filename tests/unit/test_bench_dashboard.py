"""bench/dashboard_overhead.py: which iterations ran while the page was open."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"
SPEC = importlib.util.spec_from_file_location("bench_dashboard_overhead", BENCH / "dashboard_overhead.py")
bd = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bd)


def test_each_iteration_counts_for_the_window_it_ran_in_and_straddlers_for_none():
    windows = [(100.0, 110.0, False), (110.0, 120.0, True), (120.0, 130.0, False)]
    rows = [{"step": 1, "time": 101.0, "loss": 1.0, "iteration_s": 0.5},      # warm-up: left out
            {"step": 6, "time": 105.0, "loss": 1.0, "iteration_s": 1.0},      # closed
            {"step": 7, "time": 110.5, "loss": 1.0, "iteration_s": 1.0},      # straddles the switch at 110
            {"step": 8, "time": 115.0, "loss": 1.0, "iteration_s": 2.0},      # open
            {"step": 8, "time": 115.1, "val_loss": 1.0},                      # a validation line
            {"step": 9, "time": 140.0, "loss": 1.0, "iteration_s": 1.0}]      # after the last window
    assert bd.split_by_window(rows, windows, warmup=5) == {True: [2.0], False: [1.0]}
