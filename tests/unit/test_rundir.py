"""Run directories: no run is overwritten by accident, LATEST fallbacks are loud, weights are checksummed."""

import json
import shutil

import pytest

from skiptrain.checkpoint import store
from skiptrain.cli import main
from skiptrain.checkpoint.weights import CHECKSUM_KEY, WEIGHTS, load_weights, save_weights_file

TINY = ["--preset", "tiny", "--quiet", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
        "--set", "checkpoint.every=1", "--set", "checkpoint.keep=5"]


def one_line_error(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory, byte_data):
    out = tmp_path_factory.mktemp("rundir") / "run"
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def test_training_into_an_existing_run_is_refused_and_changes_nothing(run_copy, byte_data, capsys):
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    ckpts = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    one_line_error(capsys, ["train", *TINY, "--data", str(byte_data), "--steps", "3", "--out", str(run_copy)],
                   "already holds a run (config.toml, model.safetensors, metrics.jsonl, run.json, checkpoints); "
                   "continue it with --resume, replace it with --overwrite")
    assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ckpts


def test_overwrite_replaces_the_run_and_resume_continues_it(run_copy, byte_data, capsys):
    (run_copy / "notes.txt").write_text("mine")
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "1", "--out", str(run_copy),
                 "--overwrite"]) == 0
    assert [s for s, _ in store.list_committed(run_copy / "checkpoints")] == [1]  # the old run's step 2 is gone
    assert json.loads((run_copy / "run.json").read_text())["step"] == 1
    assert (run_copy / "notes.txt").read_text() == "mine"  # not a run entry: kept
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "2", "--out", str(run_copy),
                 "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((run_copy / "run.json").read_text())["step"] == 2


@pytest.mark.parametrize("content,problem", [(b"", "is empty"), (b"step-99999999\n", "names 'step-99999999'"),
                                             (b"\xff\xfe", "is unreadable")])
def test_a_damaged_latest_is_a_loud_warning_naming_the_step_used(run_copy, capsys, content, problem):
    root = run_copy / "checkpoints"
    (root / "LATEST").write_bytes(content)
    assert store.latest(root).name == "step-00000002"
    err = capsys.readouterr().err
    assert problem in err and "using the newest committed checkpoint step-00000002 (step 2) instead" in err
    (root / "LATEST").write_text("step-00000001\n")
    assert store.latest(root).name == "step-00000001" and capsys.readouterr().err == ""


def test_resume_with_an_empty_latest_says_which_step_it_continues_from(run_copy, byte_data, capsys):
    (run_copy / "checkpoints" / "LATEST").write_text("")
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "3", "--out", str(run_copy),
                 "--resume"]) == 0
    cap = capsys.readouterr()
    assert "LATEST is empty; using the newest committed checkpoint step-00000002 (step 2)" in cap.err
    assert "at step 2" in cap.out


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's bytes; the header stays valid
    path.write_bytes(bytes(data))


def test_weights_carry_a_checksum_that_eval_and_generate_verify(run_copy, capsys):
    state = load_weights(run_copy / WEIGHTS)  # verifies
    assert state and capsys.readouterr().err == ""
    _flip_last_byte(run_copy / WEIGHTS)
    for argv in (["eval", str(run_copy), "--batches", "1"], ["generate", str(run_copy), "--tokens", "3"]):
        one_line_error(capsys, argv, "model.safetensors fails its checksum")


def test_resume_from_a_checkpoint_already_at_the_last_step_is_refused_and_changes_nothing(run_copy, byte_data, capsys):
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    one_line_error(capsys, ["train", *TINY, "--data", str(byte_data), "--steps", "2", "--out", str(run_copy),
                            "--resume"], "step-00000002 is at step 2, the run has 2 steps; pass --steps N with N > 2")
    one_line_error(capsys, ["train", *TINY, "--data", str(byte_data), "--steps", "1", "--out", str(run_copy),
                            "--resume", str(run_copy / "checkpoints" / "step-00000001")], "is at step 1")
    assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()} == before


def test_a_config_toml_that_does_not_fit_the_weights_is_one_line(run_copy, capsys):
    cfg = run_copy / "config.toml"
    cfg.write_text(cfg.read_text().replace("d_model = 64", "d_model = 128"))
    for argv in (["eval", str(run_copy), "--batches", "1"], ["generate", str(run_copy), "--tokens", "3"]):
        one_line_error(capsys, argv, "model.safetensors does not match config.toml: tok_emb.weight is [256, 64] "
                                     "in the weights, config.toml makes it [256, 128]; restore the run's own")


def test_eval_json_into_an_unwritable_place_is_one_line(run_copy, capsys):
    for bad in (run_copy / "config.toml" / "e.json", run_copy / "checkpoints"):
        one_line_error(capsys, ["eval", str(run_copy), "--batches", "1", "--json", str(bad)], "cannot write --json")


def test_export_writes_a_checksummed_file_from_verified_shards(run_copy, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "exp"
    assert main(["export", str(run_copy / "checkpoints"), "--format", "skiptrain", "--out", str(out)]) == 0
    with safe_open(str(out / WEIGHTS), "pt") as f:
        assert CHECKSUM_KEY in f.metadata()
    assert load_weights(out / WEIGHTS).keys() == load_weights(run_copy / WEIGHTS).keys()
    shard = next((run_copy / "checkpoints" / "step-00000002").glob("data-*.bin"))
    _flip_last_byte(shard)
    assert main(["export", str(run_copy / "checkpoints"), "--format", "skiptrain", "--out", str(tmp_path / "x")]) == 2
    assert "checksum" in capsys.readouterr().err.lower()


def test_weights_without_a_checksum_are_read_with_a_warning(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    assert load_weights(tmp_path / "w.safetensors")["a"].sum() == 2
    assert "carries no checksum" in capsys.readouterr().err
    save_weights_file({"a": torch.ones(2), "e": torch.zeros(0)}, tmp_path / "v.safetensors")
    assert load_weights(tmp_path / "v.safetensors")["e"].numel() == 0


def test_a_full_disk_during_training_is_one_line_and_keeps_the_last_checkpoint(tmp_path, byte_data, capsys,
                                                                               monkeypatch):
    import os

    real = store.write_file

    def full_after_step_1(path, data, durable=True):
        if str(path).endswith("metadata.json") and "step-00000001" not in str(path):
            raise OSError(28, os.strerror(28), str(path))
        return real(path, data, durable)

    monkeypatch.setattr(store, "write_file", full_after_step_1)
    out = tmp_path / "run"
    err = one_line_error(capsys, ["train", *TINY, "--data", str(byte_data), "--steps", "3", "--out", str(out)],
                         "failed: No space left on device")
    assert f"the last committed checkpoint is {out / 'checkpoints' / 'step-00000001'}" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["LATEST", "step-00000001"]
    monkeypatch.undo()
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out and json.loads((out / "run.json").read_text())["step"] == 3


def test_non_finite_weights_are_refused(tmp_path):
    import torch

    save_weights_file({"a": torch.tensor([1.0, float("nan")])}, tmp_path / "w.safetensors")
    with pytest.raises(Exception, match=r"holds non-finite weights \(a\): the run diverged; retrain with a lower"):
        load_weights(tmp_path / "w.safetensors")


def test_a_second_writer_of_a_run_directory_is_refused_and_changes_nothing(run_copy, byte_data, capsys):
    from skiptrain.train.rundir import run_dir_writer

    before = {p.name: p.stat().st_mtime_ns for p in run_copy.iterdir()}
    with run_dir_writer(run_copy):                  # (as another process's lock: a lock of its own open file)
        for argv in (["train", *TINY, "--data", str(byte_data), "--steps", "4", "--out", str(run_copy), "--resume"],
                     ["train", *TINY, "--data", str(byte_data), "--steps", "2", "--out", str(run_copy), "--overwrite"],
                     ["coordinator", "--bind", "127.0.0.1:1", "--out", str(run_copy), "--join-secret-file",
                      str(run_copy / "s"), "--resume"]):
            one_line_error(capsys, argv, "is being written by another skiptrain process; wait for it to end")
    assert {p.name: p.stat().st_mtime_ns for p in run_copy.iterdir()} == before
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "3", "--out", str(run_copy), "--resume"]) == 0


def test_a_refused_command_leaves_no_run_directory_behind(tmp_path, capsys):
    out = tmp_path / "new"
    one_line_error(capsys, ["train", *TINY, "--data", str(tmp_path / "missing"), "--out", str(out)], "missing")
    assert not out.exists()


def test_a_resume_from_an_older_checkpoint_starts_a_branch_that_later_resumes_continue(run_copy, byte_data, capsys):
    """Resumed from step 1 of a run at step 2 with another lr: step 2 of the earlier branch moves
    aside, the new branch writes its own steps and LATEST follows them, metrics.jsonl marks the
    branch, and a plain --resume then continues the new branch (not the earlier one's step 2)."""
    from skiptrain.checkpoint.reader import CheckpointReader

    ck = run_copy / "checkpoints"
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "3", "--out", str(run_copy),
                 "--resume", str(ck / "step-00000001"), "--set", "train.lr=1e-5"]) == 0
    assert "a new branch of the run: resumed from" in capsys.readouterr().err
    (branch,) = ck.glob("branch-*-after-1")
    assert [p.name for p in branch.iterdir()] == ["step-00000002"]
    assert store.latest(ck).name == "step-00000003"
    assert CheckpointReader(ck / "step-00000002").state["config"]["train"]["lr"] == 1e-5     # the new branch's own
    rows = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    marks = [r for r in rows if "branch" in r]
    assert len(marks) == 1 and marks[0]["step"] == 1 and str(branch) in marks[0]["branch"]
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "4", "--out", str(run_copy), "--resume",
                 "--set", "train.lr=1e-5"]) == 0
    assert "from" in capsys.readouterr().out and store.latest(ck).name == "step-00000004"
    steps = [r["step"] for r in map(json.loads, (run_copy / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]


def test_a_run_of_zero_steps_writes_strict_json(tmp_path, byte_data):
    out = tmp_path / "zero"
    assert main(["train", *TINY, "--data", str(byte_data), "--steps", "0", "--out", str(out)]) == 0
    summary = json.loads((out / "run.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in run.json"))
    assert summary["val_loss"] is None and summary["step"] == 0


def test_a_resume_on_another_data_set_of_the_same_vocabulary_is_refused(run_copy, tmp_path, capsys):
    from conftest import TRAIN_TEXTS

    other = tmp_path / "other"
    assert main(["prepare", "--text", TRAIN_TEXTS[0], "--tokenizer", "byte", "--out", str(other)]) == 0
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    one_line_error(capsys, ["train", *TINY, "--data", str(other), "--steps", "4", "--out", str(run_copy), "--resume"],
                   "was trained on another data set than")
    assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()} == before


def test_a_swarm_resume_under_another_model_width_is_one_line_before_any_node_starts(run_copy, byte_data, capsys):
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    one_line_error(capsys, ["launch", "--preset", "tiny", "--data", str(byte_data), "--steps", "4", "--out",
                            str(run_copy), "--resume", "--nodes", "4", "--set", "model.d_model=96"],
                   "does not fit this model config (")
    assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()} == before


def test_train_resume_takes_the_runs_own_config_as_launch_resume_does(tmp_path, byte_data):
    from skiptrain.checkpoint.reader import CheckpointReader

    out = tmp_path / "lr"
    assert main(["train", *TINY, "--set", "train.lr=0.0123", "--data", str(byte_data), "--steps", "2",
                 "--out", str(out)]) == 0
    assert main(["train", "--quiet", "--data", str(byte_data), "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert CheckpointReader(out / "checkpoints" / "step-00000003").state["config"]["train"]["lr"] == 0.0123
