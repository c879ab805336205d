"""Property tests: whatever a user types (NaN, inf, negatives, huge numbers, odd encodings, missing
or unusable paths), the result is a config / a run, or one clear error line, never a traceback.

The CLI is driven in-process through :func:`skiptrain.cli.main`; runs are 1-2 steps of the tiny
preset, and ``max_examples`` is small, so the file stays within seconds on two cores."""

from __future__ import annotations

import contextlib
import io
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from skiptrain.cli import main
from skiptrain.config import Config, ConfigError, build_config

ODD = ["nan", "NaN", "inf", "-inf", "-0", "1e400", "-1e400", "-1", "0", "1", "0.5", "3.5", "1_000", "0x10", "1e3",
       "", " ", "true", "False", "\u00e9", "\x00", "\u0663", "\uff11", "1e-400", "9" * 30, "-" + "9" * 30,
       "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "1,2", "[1]", "{}"]
VALUES = st.one_of(st.sampled_from(ODD), st.floats().map(repr), st.integers(-2**80, 2**80).map(str),
                   st.text(max_size=6))
ALL_FIELDS = sorted(f"{sec}.{name}" for sec, d in Config().to_dict().items() for name in d)
# fields that keep a 1-2 step tiny run cheap whatever finite value they take
CHEAP = ["train.lr", "train.grad_clip", "train.skip_ratio", "train.weight_decay", "train.beta1", "train.beta2",
         "train.min_lr_frac", "train.warmup_steps", "train.seed", "train.max_swaps", "train.eval_every",
         "checkpoint.every", "checkpoint.keep", "model.rope_theta", "model.norm_eps", "model.init_std",
         "data.tokenizer", "checkpoint.overlap"]


def _finite_floats(cfg: Config) -> bool:
    return all(math.isfinite(v) for sec in cfg.to_dict().values() for v in sec.values() if isinstance(v, float))


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(ALL_FIELDS), value=VALUES)
def test_any_config_value_gives_a_checked_config_or_a_one_line_error(key, value):
    try:
        cfg = build_config("tiny", overrides=[f"{key}={value}"])
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg
        return
    assert _finite_floats(cfg)


def cli(argv: list[str]) -> tuple[int, list[str]]:
    """(exit status, stderr lines that are not warnings) of ``skiptrain ARGV`` run in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:          # argparse: usage line + one error line, status 2
            rc = e.code
    lines = [x for x in err.getvalue().splitlines() if x.strip() and "warning:" not in x]
    return rc, lines


def check_outcome(rc: int, lines: list[str], command: str) -> None:
    event(f"{command} exit status {rc}")
    assert rc in (0, 2), (rc, lines)
    if rc == 2:
        errors = [x for x in lines if not x.startswith("usage:") and not x.startswith(" ")]
        assert len(errors) == 1 and f"{command}: error:" in errors[0], lines
        assert "Traceback" not in "\n".join(lines)


@pytest.fixture(scope="module")
def places(tmp_path_factory, byte_data):
    d = tmp_path_factory.mktemp("places")
    (d / "a_file").write_text("x")
    (d / "empty").mkdir()
    (d / "bad.toml").write_bytes(b"[train]\nlr = \xff\xfe\n")
    return {"data": str(byte_data), "missing": str(d / "nope"), "file": str(d / "a_file"),
            "empty": str(d / "empty"), "under_file": str(d / "a_file" / "sub"), "bad_toml": str(d / "bad.toml")}


TRAIN_ODD = {"steps": st.sampled_from(["-1", "0", "x", "1.5", "", "1e3"]),
             "data": st.sampled_from(["missing", "file", "empty"]),
             "out": st.sampled_from(["existing", "under_file"]),
             "config": st.sampled_from(["missing", "bad_toml", "file"]),
             "resume": st.just(True)}


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(CHEAP), value=VALUES, odd=st.sampled_from(["none", "none", "set", *TRAIN_ODD]),
       data=st.data())
def test_train_with_any_input_is_a_run_or_one_error_line(places, key, value, odd, data):
    """One thing at a time is odd (a --set value, the steps, a path, --resume), the rest is sound."""
    bad = data.draw(TRAIN_ODD[odd]) if odd in TRAIN_ODD else None
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        if odd == "out" and bad == "existing":
            run.mkdir()
            (run / "config.toml").write_text("")
        outp = places["under_file"] if bad == "under_file" else str(run)
        argv = ["train", "--preset", "tiny", "--quiet", "--data", places[bad] if odd == "data" else places["data"],
                "--steps", bad if odd == "steps" else "2", "--out", outp, "--set", "train.eval_batches=1"]
        if odd == "set":
            argv += ["--set", f"{key}={value}"]
        if odd == "config":
            argv += ["--config", places[bad]]
        if odd == "resume":
            argv.append("--resume")
        rc, lines = cli(argv)
        check_outcome(rc, lines, "train")
        if rc == 0:
            assert (run / "run.json").is_file() and (run / "model.safetensors").is_file()
        else:
            assert odd != "none", lines


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, byte_data):
    run = tmp_path_factory.mktemp("prop_run") / "run"
    assert main(["train", "--preset", "tiny", "--quiet", "--data", str(byte_data), "--steps", "1", "--out", str(run),
                 "--set", "train.eval_batches=1"]) == 0
    return run


SAMPLE_ODD = {"batches": st.sampled_from(["-1", "0", "x", "1e9"]),
              "split": st.sampled_from(["test", "ood "]),
              "tokens": st.sampled_from(["-1", "10001", "1e3", "x", "1000000000000"]),
              "temperature": st.sampled_from(["-1", "nan", "inf", "x"]),
              "drop": st.sampled_from(["0", "9", "a,b", "-1"]),
              "fraction": st.sampled_from(["nan", "1.5", "-1", "inf", "x"]),
              "run": st.sampled_from(["missing", "file", "empty"])}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=st.sampled_from(["eval", "generate"]), odd=st.sampled_from(["none", *SAMPLE_ODD]), data=st.data())
def test_eval_and_generate_with_any_input_give_a_result_or_one_error_line(trained_run, places, cmd, odd, data):
    bad = data.draw(SAMPLE_ODD[odd]) if odd in SAMPLE_ODD else None
    argv = [cmd, places[bad] if odd == "run" else str(trained_run)]
    if cmd == "eval":
        argv += ["--batches", bad if odd == "batches" else "1", "--split", bad if odd == "split" else "val"]
    else:
        argv += ["--tokens", bad if odd == "tokens" else "3", "--temperature", bad if odd == "temperature" else "0.8"]
    if odd == "drop":
        argv += ["--drop-stages", bad]
    if odd == "fraction":
        argv += ["--drop-fraction", bad]
    rc, lines = cli(argv)
    check_outcome(rc, lines, cmd)
    used = {"eval": {"batches", "split"}, "generate": {"tokens", "temperature"}}[cmd] | {"drop", "fraction", "run"}
    if odd == "none":
        assert rc == 0, lines
    elif odd in used:
        assert rc == 2, (odd, bad)


def test_a_config_file_that_is_not_utf8_is_a_one_line_error(places):
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        build_config("tiny", places["bad_toml"])


def test_a_config_path_that_is_a_directory_says_so(places):
    with pytest.raises(ConfigError, match="is a directory; pass a TOML file"):
        build_config("tiny", places["empty"])


def test_a_diverging_run_is_one_error_line_and_its_weights_are_refused(tmp_path, byte_data):
    run = tmp_path / "run"
    rc, lines = cli(["train", "--preset", "tiny", "--quiet", "--data", str(byte_data), "--steps", "2", "--out",
                     str(run), "--set", "train.lr=1e30", "--set", "train.grad_clip=0", "--set", "train.warmup_steps=0",
                     "--set", "train.eval_batches=1"])
    assert rc == 2 and len(lines) == 1 and "training diverged" in lines[0], lines
    if (run / "model.safetensors").is_file():
        rc, lines = cli(["eval", str(run), "--batches", "1"])
        assert rc == 2 and len(lines) == 1 and "diverged" in lines[0], lines
    shutil.rmtree(run, ignore_errors=True)


LAUNCH_ODD = st.sampled_from([
    ["--nodes", "-1"], ["--nodes", "0"], ["--nodes", "99999999"], ["--nodes", "x"],
    ["--recover", "--heartbeat-deadline", "nan"], ["--recover", "--heartbeat-deadline", "-1"],
    ["--recover", "--strikes", "0"], ["--recover", "--ckpt-every", "-1"], ["--recover", "--drift-threshold", "inf"],
    ["--set", "runtime.stage_sizes=a,b"], ["--set", "runtime.stage_sizes=0,0,0,4"], ["--set", "runtime.stage_sizes=9,9"],
    ["--topology", "nope"], ["--takeover"], ["--restartable"], ["--skip-ratio", "0.7"], ["--set", "runtime.timeout_s=nan"],
])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(odd=LAUNCH_ODD)
def test_launch_with_a_bad_argument_is_one_error_line_and_starts_nothing(places, odd):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = ["launch", "--data", places["data"], "--steps", "1", "--out", str(out)]
        argv += ["--nodes", "4"] if "--nodes" not in odd else []
        rc, lines = cli(argv + odd)
        check_outcome(rc, lines, "launch")
        assert rc == 2 and not (out / "job.json").exists(), (odd, lines)


@pytest.mark.parametrize("seed,needle", [("-1", "train.seed=-1 is below its minimum 0"),
                                         ("9" * 23, "is above its maximum 4294967295")])
def test_a_seed_the_generators_do_not_take_is_one_error_line(places, tmp_path, seed, needle):
    rc, lines = cli(["train", "--preset", "tiny", "--quiet", "--data", places["data"], "--steps", "1", "--out",
                     str(tmp_path / "run"), "--seed", seed])
    assert rc == 2 and len(lines) == 1 and "train: error:" in lines[0] and needle in lines[0], lines
