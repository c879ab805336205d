"""Property tests: whatever a user types (NaN, inf, negatives, huge numbers, odd encodings, missing
or unusable paths), the result is a config / a run, or one clear error line, never a traceback.

The CLI is driven in-process through :func:`skiptrain.cli.main`; runs are 1-2 steps of the tiny
preset, and ``max_examples`` is small, so the file stays within seconds on two cores.

The units (no process started) are in tests/unit/test_bad_input_properties_units.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from unit.test_bad_input_properties_units import VALUES, check_outcome, cli, places


# fields that keep a 1-2 step tiny run cheap whatever finite value they take
CHEAP = ["train.lr", "train.grad_clip", "train.skip_ratio", "train.weight_decay", "train.beta1", "train.beta2",
         "train.min_lr_frac", "train.warmup_steps", "train.seed", "train.max_swaps", "train.eval_every",
         "checkpoint.every", "checkpoint.keep", "model.rope_theta", "model.norm_eps", "model.init_std",
         "data.tokenizer", "checkpoint.overlap"]


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
