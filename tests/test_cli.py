"""Smoke tests of the command line: prepare, train, eval, generate, and one-line errors."""

import json
import subprocess
import sys

import pytest

from skiptrain.cli import main

from conftest import OOD_TEXTS, TRAIN_TEXTS


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "skiptrain.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    data, run = d / "data", d / "run"
    assert main(["prepare", "--text", *TRAIN_TEXTS, "--ood-text", *OOD_TEXTS, "--tokenizer", "bpe",
                 "--vocab-size", "400", "--out", str(data)]) == 0
    assert main(["train", "--preset", "tiny", "--data", str(data), "--steps", "6", "--out", str(run),
                 "--quiet", "--skip-ratio", "0.25"]) == 0
    return data, run


def test_prepare_train_outputs(trained):
    data, run = trained
    m = json.loads((data / "manifest.json").read_text())
    assert m["tokenizer"]["kind"] == "bpe" and m["tokens"]["ood"] > 0
    for f in ("config.toml", "metrics.jsonl", "loss.png", "model.safetensors", "tokenizer.json", "run.json"):
        assert (run / f).is_file(), f
    assert "vocab_size = 400" in (run / "config.toml").read_text()


def test_eval_json_and_drop(trained, tmp_path):
    data, run = trained
    assert main(["eval", str(run), "--data", str(data), "--json", str(tmp_path / "full.json"), "--batches", "2"]) == 0
    full = json.loads((tmp_path / "full.json").read_text())
    assert set(full) >= {"val_loss", "perplexity"} and full["route"] == [1, 2, 3]
    assert main(["eval", str(run), "--drop-fraction", "0.34", "--seed", "1", "--batches", "2",
                 "--json", str(tmp_path / "drop.json")]) == 0
    drop = json.loads((tmp_path / "drop.json").read_text())
    assert len(drop["route"]) == 2 and drop["val_loss"] != full["val_loss"]
    assert main(["eval", str(run), "--split", "ood", "--drop-stages", "2", "--batches", "2",
                 "--json", str(tmp_path / "ood.json")]) == 0
    assert json.loads((tmp_path / "ood.json").read_text())["route"] == [1, 3]


def test_bad_drop_stages_is_a_one_line_error(trained):
    _, run = trained
    r = run_cli("eval", str(run), "--drop-stages", "a,b")
    assert r.returncode == 2 and "expected body-stage numbers" in r.stderr and "Traceback" not in r.stderr


def test_generate(trained, capsys):
    _, run = trained
    assert main(["generate", str(run), "--prompt", "HAMLET.", "--tokens", "12"]) == 0
    assert capsys.readouterr().out.startswith("HAMLET.")


@pytest.mark.parametrize("args,needle", [
    (["train", "--preset", "tiny", "--data", "/nonexistent/data", "--out", "/tmp/x"], "skiptrain prepare --out"),
    (["train", "--preset", "tiny", "--set", "model.d_modle=3", "--out", "/tmp/x"], "did you mean 'd_model'"),
    (["prepare", "--text", "/nonexistent.txt", "--out", "/tmp/x"], "does not exist"),
    (["eval", "/nonexistent/run"], "is not a run directory"),
    (["train", "--preset", "tiny", "--nodes", "6", "--resume", "--out", "/tmp/x"], "--resume works with the single-process trainer only"),
])
def test_errors_are_one_line_with_a_fix(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
