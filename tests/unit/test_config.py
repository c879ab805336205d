import pytest

from skiptrain.config import ConfigError, build_config, parse_overrides, preset_names


def test_presets_exist_and_check():
    assert {"tiny", "small"} <= set(preset_names())
    for name in preset_names():
        cfg = build_config(name)
        assert cfg.model.d_model % cfg.model.n_heads == 0


def test_overrides_are_typed():
    cfg = build_config("tiny", overrides=["model.d_model=128", "train.lr=1e-3", "train.progress=false"])
    assert cfg.model.d_model == 128 and isinstance(cfg.model.d_model, int)
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.train.progress is False


def test_unknown_key_names_key_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        build_config("tiny", overrides=["model.d_modle=128"])
    msg = str(e.value)
    assert "model.d_modle" in msg and "d_model" in msg and "did you mean" in msg


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"unknown section \[modle\]"):
        build_config(overrides={"modle": {"d_model": 1}})


def test_bad_type_and_range():
    with pytest.raises(ConfigError, match="model.n_layers must be an integer"):
        build_config("tiny", overrides=["model.n_layers=four"])
    with pytest.raises(ConfigError, match="train.skip_ratio=1.5 is above its maximum 1.0"):
        build_config("tiny", overrides=["train.skip_ratio=1.5"])
    with pytest.raises(ConfigError, match="data.tokenizer='bpe2' is not allowed; choose one of 'auto', 'byte'"):
        build_config("tiny", overrides=["data.tokenizer=bpe2"])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="not divisible by model.n_heads"):
        build_config("tiny", overrides=["model.d_model=66"])
    with pytest.raises(ConfigError, match="n_stages"):
        build_config("tiny", overrides=["model.n_stages=9"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'smal'.*did you mean 'small'"):
        build_config("smal")


def test_toml_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\nd_model = 96\nn_heads = 4\n[train]\nsteps = 7\n")
    cfg = build_config("tiny", p, ["train.steps=9"])
    assert cfg.model.d_model == 96 and cfg.train.steps == 9
    p.write_text("[model\nd_model = 96\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config("tiny", p)
    with pytest.raises(ConfigError, match="does not exist"):
        build_config("tiny", tmp_path / "missing.toml")


def test_override_syntax():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_overrides(["d_model=3"])


@pytest.mark.parametrize("key", ["train.lr", "train.grad_clip", "train.weight_decay", "runtime.timeout_s"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_floats_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"{key}=.* is not a finite number; give a finite value"):
        build_config("tiny", overrides=[f"{key}={value}"])


def test_non_finite_floats_from_toml_are_refused(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nlr = inf\n")
    with pytest.raises(ConfigError, match="train.lr=inf is not a finite number"):
        build_config("tiny", p)


@pytest.mark.parametrize("k", [0.7, 0.75, 0.9, 0.625])
def test_skip_ratio_that_leaves_no_body_stage_is_refused_with_the_right_bound(k):
    # 4 stages = 3 body stages; round(k * 4) >= 3 skips all of them
    with pytest.raises(ConfigError, match=r"train.skip_ratio=.*no body stage; use a skip ratio below 0.625"):
        build_config("tiny", overrides=[f"train.skip_ratio={k}"])
    assert build_config("tiny", overrides=["train.skip_ratio=0.62"]).train.skip_ratio == 0.62


@pytest.mark.parametrize("override,needle", [
    ("model.n_layers=100000000", "model.n_layers=100000000 is above its maximum 1024"),
    ("runtime.nodes=99999999", "runtime.nodes=99999999 is above its maximum 1024"),
    ("train.micro_batch=" + "9" * 20, "is above its maximum"),
    ("runtime.mb_per_originator=100000000", "runtime.mb_per_originator=100000000 is above its maximum 4096"),
    ("runtime.memory=100000000", "runtime.memory=100000000 is above its maximum 4096"),
    ("runtime.bytes_scale=" + "1" + "0" * 20, "runtime.bytes_scale=100000000000000000000 is above its maximum 65536"),
    ("runtime.time_scale=1e300", r"runtime.time_scale=1e\+300 is above its maximum 1000.0"),
    ("runtime.timeout_s=1e300", r"runtime.timeout_s=1e\+300 is above its maximum 1000000.0"),
    ("runtime.heartbeat_deadline_s=1e300", r"runtime.heartbeat_deadline_s=1e\+300 is above its maximum 1000000.0"),
    ("dp.timeout_s=1e300", r"dp.timeout_s=1e\+300 is above its maximum 1000000.0"),
    (f"runtime.strikes={2**63}", f"runtime.strikes={2**63} is above its maximum 100"),
])
def test_absurd_sizes_are_refused_before_anything_is_allocated(override, needle):
    with pytest.raises(ConfigError, match=needle):
        build_config("tiny", overrides=[override])


@pytest.mark.parametrize("override,needle", [
    ("runtime.s_per_sample_layer=1e308", r"runtime.s_per_sample_layer=1e\+308 is above its maximum 1000000.0"),
    ("runtime.hop_overhead_s=1e300", r"runtime.hop_overhead_s=1e\+300 is above its maximum 1000000.0"),
])
def test_cost_model_times_out_of_range_name_the_config_key(override, needle):
    """Not the cost model's field (``s_per_sample_per_layer``), which no user typed."""
    with pytest.raises(ConfigError, match=needle):
        build_config("tiny", overrides=[override])


def test_an_odd_head_dimension_names_the_keys_that_make_it():
    with pytest.raises(ConfigError, match=r"model.d_model=60 / model.n_heads=4 is a head dimension of 15, which must "
                                          r"be even for rotary embeddings; choose d_model and n_heads"):
        build_config("tiny", overrides=["model.d_model=60", "model.n_heads=4", "model.n_kv_heads=0"])


def test_a_coordinator_wait_shorter_than_four_heartbeats_is_refused_in_one_line():
    from skiptrain.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="coordinator_wait_s=1 is shorter than 4 heartbeats.*at least 2"):
        build_config("tiny", overrides={"runtime": {"coordinator_wait_s": 1.0, "heartbeat_s": 0.5}})
    build_config("tiny", overrides={"runtime": {"coordinator_wait_s": 0.0}}).check()


def test_a_retired_key_loads_from_saved_runs_and_is_refused_when_set():
    """``elastic.nodes`` (the one-process trainer's emulated nodes) is retired: every run saved
    before wrote it, so a saved config loads with it (value ignored) and a TOML with its old
    default loads too; set to anything else it is refused in one line naming the fix."""
    from skiptrain.config import apply_dict, config_from_dict

    saved = build_config("tiny").to_dict()
    saved["elastic"]["nodes"] = 8
    assert config_from_dict(saved).elastic.enabled is False
    assert apply_dict(build_config("tiny"), {"elastic": {"nodes": 0}}, source="cfg.toml").elastic.enabled is False
    with pytest.raises(ConfigError, match="elastic.nodes is retired.*remove it"):
        build_config("tiny", overrides={"elastic": {"nodes": 8}})
