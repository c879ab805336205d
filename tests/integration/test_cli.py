"""Smoke tests of the command line: prepare, train, eval, generate, and one-line errors.

The units (no process started) are in tests/unit/test_cli_units.py."""

import subprocess
import sys

import pytest

from unit.test_cli_units import trained  # noqa: F401 (a fixture)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "skiptrain.cli", *args], capture_output=True, text=True)


def test_bad_drop_stages_is_a_one_line_error(trained):  # noqa: F811
    _, run = trained
    r = run_cli("eval", str(run), "--drop-stages", "a,b")
    assert r.returncode == 2 and "expected body-stage numbers" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["train", "--preset", "tiny", "--data", "/nonexistent/data", "--out", "/tmp/x"], "skiptrain prepare --out"),
    (["train", "--preset", "tiny", "--set", "model.d_modle=3", "--out", "/tmp/x"], "did you mean 'd_model'"),
    (["prepare", "--text", "/nonexistent.txt", "--out", "/tmp/x"], "does not exist"),
    (["eval", "/nonexistent/run"], "is not a run directory"),
    (["train", "--preset", "tiny", "--nodes", "6", "--resume", "--out", "/tmp/x-none"], "--resume: no committed checkpoint under"),
    (["train", "--preset", "tiny", "--resume", "--overwrite", "--out", "/tmp/x-none"],
     "--resume continues the run in --out and --overwrite replaces it: pass one of them"),
    (["launch", "--resume", "--overwrite", "--out", "/tmp/x-none"], "pass one of them"),
    (["launch", "--join-secret-file", "/tmp/x-secret", "--out", "/tmp/x-none"], "drop the flag, or add --join"),
])
def test_errors_are_one_line_with_a_fix(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
