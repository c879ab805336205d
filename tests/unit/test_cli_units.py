"""Smoke tests of the command line: prepare, train, eval, generate, and one-line errors.

Here the units, which start no process; the tests that start processes are in
tests/integration/test_cli.py."""

import json

import pytest

from skiptrain.cli import main

from conftest import OOD_TEXTS, TRAIN_TEXTS


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


def test_generate(trained, capsys):
    _, run = trained
    assert main(["generate", str(run), "--prompt", "HAMLET.", "--tokens", "12"]) == 0
    assert capsys.readouterr().out.startswith("HAMLET.")


def one_line_error(capsys, argv, needle):
    """``main(argv)`` fails with exit status 2 and exactly one stderr line containing ``needle``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    return err[0]


@pytest.mark.parametrize("argv,needle", [
    (["--tokens", "1000000000000"], "--tokens 1000000000000 is outside 0..10000"),
    (["--tokens", "-1"], "--tokens -1 is outside 0..10000"),
    (["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0"),
    (["--seed", "9" * 23], "is outside -2**63..2**64-1 (what a torch generator takes)"),
    (["--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")], "--prompt holds bytes that are not UTF-8 text"),
])
def test_generate_refuses_huge_or_bad_requests_at_once(trained, capsys, argv, needle):
    _, run = trained
    one_line_error(capsys, ["generate", str(run), *argv], needle)


def test_generate_at_a_temperature_too_small_for_float32_samples_the_most_likely_tokens(trained, capsys):
    _, run = trained
    for t in ("1e-300", "1e-37"):
        assert main(["generate", str(run), "--prompt", "HAMLET.", "--tokens", "5", "--temperature", t]) == 0
        assert capsys.readouterr().out == (main(["generate", str(run), "--prompt", "HAMLET.", "--tokens", "5",
                                                 "--temperature", "0"]), capsys.readouterr().out)[1]


def test_generate_streams_the_same_tokens_as_the_model_samples(trained):
    import torch

    from skiptrain.train.generate import sample_tokens, stream_text
    from skiptrain.train.rundir import load_run

    _, run = trained
    _, model, tok = load_run(run)
    ids = tok.encode("HAMLET.")
    ref = model.generate(torch.tensor([ids]), 10, generator=torch.Generator().manual_seed(3))[0, len(ids):].tolist()
    stream = sample_tokens(model, ids, 10, generator=torch.Generator().manual_seed(3))
    assert next(stream) == ref[0]  # the first token exists before the other nine are sampled
    pieces: list[str] = []
    text = stream_text(tok, stream, pieces.append)
    assert len(pieces) > 1 and text == "".join(pieces) == tok.decode(ref[1:])


def test_stream_text_holds_back_split_characters():
    from skiptrain.data.tokenizer import ByteTokenizer
    from skiptrain.train.generate import stream_text

    pieces: list[str] = []
    ids = list("é!".encode())  # 2 bytes + 1
    assert stream_text(ByteTokenizer(), ids, pieces.append) == "é!" and pieces == ["é", "!"]


def test_eval_with_zero_batches_is_a_clear_error(trained, capsys):
    _, run = trained
    one_line_error(capsys, ["eval", str(run), "--batches", "0"], "--batches 0: evaluate at least 1 micro-batch")


def test_a_model_too_large_for_this_machine_is_refused_before_allocation(capsys, tmp_path):
    one_line_error(capsys, ["train", "--preset", "tiny", "--set", "model.d_model=65536", "--set", "model.n_heads=256",
                            "--set", "model.n_kv_heads=0", "--set", "model.n_layers=1024", "--out", str(tmp_path / "r"),
                            "--data", str(tmp_path)], "does not fit this machine")
    assert not (tmp_path / "r").exists()


def test_prepare_into_an_unwritable_place_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    one_line_error(capsys, ["prepare", "--text", *TRAIN_TEXTS, "--tokenizer", "byte", "--out", str(tmp_path / "f" / "d")],
                   "cannot write the data directory")


def test_the_demo_summary_says_what_each_idea_did(tmp_path):
    """The demo's closing lines, read from a swarm run directory: routes, activation bytes on
    slow links, layers frozen, checkpoints."""
    from skiptrain.cli.train import DEMO_SWARM, demo_summary
    from skiptrain.config import build_config, save_toml
    from skiptrain.runtime.job import build_cost, build_schedule, build_topology

    cfg = build_config("small", overrides=DEMO_SWARM)
    save_toml(cfg, tmp_path / "config.toml")
    topo = build_topology(cfg, cfg.runtime.nodes)
    build_schedule(cfg, "planner", topo, build_cost(cfg, s_per_sample_layer=0.01), dp_sync=False) \
        .save(tmp_path / "schedule.json")
    (tmp_path / "elastic.jsonl").write_text(
        '{"step": 20, "action": "transition", "frozen_before": 0, "frozen_after": 2, "counts": [3, 2, 3]}\n')
    lines = demo_summary(tmp_path)
    assert "k=0.33" in lines[0] and "geo12" in lines[0]
    assert "carry int8" in lines[1] and not lines[1].startswith("  activations:   0 of")
    assert "iteration 20: 0 -> 2 layers frozen" in lines[2]
    assert "0 kept" in lines[3]


@pytest.mark.parametrize("err,needle", [
    (13, "cannot use 'DATA/manifest.json': Permission denied; give this user access to it (chmod / chown)"),
    (28, "cannot use 'DATA/manifest.json': No space left on device; free disk space there"),
])
def test_a_permission_or_full_disk_error_anywhere_is_one_line(trained, capsys, monkeypatch, err, needle):
    """Python 3.11's Path.is_file() raises PermissionError for a path in a directory this user cannot
    search, so it arises anywhere a path is looked at; root is never refused, so the test raises the
    OS error where the data set is opened."""
    import os

    from skiptrain.data.dataset import TokenDataset

    def unreadable(path):
        raise OSError(err, os.strerror(err), "DATA/manifest.json")

    _, run = trained
    monkeypatch.setattr(TokenDataset, "open", unreadable)
    one_line_error(capsys, ["eval", str(run), "--batches", "1"], needle)


def test_a_bad_ood_text_path_names_ood_text_not_text(capsys, tmp_path):
    one_line_error(capsys, ["prepare", "--text", *TRAIN_TEXTS, "--ood-text", str(tmp_path / "nope.txt"),
                            "--tokenizer", "byte", "--out", str(tmp_path / "d")],
                   "does not exist; pass existing files or folders to --ood-text")


@pytest.mark.parametrize("argv,name", [
    (["train", "--preset", "tiny", "--data", "DATA", "--steps", "1", "--out", ""], "--out"),
    (["train", "--preset", "tiny", "--nodes", "4", "--data", "DATA", "--steps", "1", "--out", ""], "--out"),
    (["launch", "--data", "DATA", "--steps", "1", "--out", ""], "--out"),
    (["launch", "--data", "DATA", "--steps", "1", "--out", "OUT", "--json", ""], "--json"),
    (["prepare", "--text", *TRAIN_TEXTS, "--tokenizer", "byte", "--out", ""], "--out"),
    (["export", "RUN", "--out", ""], "--out"),
    (["ckpt", "reshard", "RUN", "", "--stages", "2"], "DST"),
    (["eval", "RUN", "--batches", "1", "--json", ""], "--json"),
    (["simulate", "--methods", "planner", "--json", ""], "--json"),
    (["simulate", "--methods", "planner", "--gantt", ""], "--gantt"),
    (["simulate", "--methods", "planner", "--schedule-out", ""], "--schedule-out"),
    (["demo", "--out", ""], "--out"),
])
def test_an_empty_path_to_write_is_refused_and_nothing_is_written_here(trained, capsys, monkeypatch, tmp_path,
                                                                        argv, name):
    """``--out ""`` (an unset shell variable) is not the current directory: one line, nothing written."""
    data, run = trained
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    sub = {"DATA": str(data), "RUN": str(run), "OUT": str(tmp_path / "out")}
    one_line_error(capsys, [sub.get(a, a) for a in argv], f'{name} "" is an empty path; pass the path to write to')
    assert not list(here.iterdir()) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("override,needle", [
    ("runtime.mb_per_originator=100000000", "runtime.mb_per_originator=100000000 is above its maximum 4096"),
    ("runtime.memory=100000000", "runtime.memory=100000000 is above its maximum 4096"),
    ("runtime.bytes_scale=100000000000000000000", "is above its maximum 65536"),
    ("runtime.time_scale=1e300", "runtime.time_scale=1e+300 is above its maximum 1000.0"),
])
@pytest.mark.parametrize("cmd", [["launch", "--nodes", "4"], ["train", "--nodes", "4"]])
def test_a_swarm_with_absurd_runtime_scales_is_refused_before_it_starts(trained, capsys, tmp_path, cmd, override,
                                                                        needle):
    """Absurd runtime scales are one line before any node starts: a hundred million micro-batches per
    originator would be planned for hours, a hundred million memory credits fit no node, 1e20 emulated
    bytes per byte and 1e300 emulated seconds per second make nonsense runs (endless waits on
    emulated links)."""
    data, _ = trained
    out = tmp_path / "run"
    one_line_error(capsys, [*cmd, "--preset", "tiny", "--data", str(data), "--steps", "1", "--out", str(out),
                            "--set", override], needle)
    assert not out.exists()


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--methods", "planner", "--max-evals", "0", "--json", "FILE/x.json"],
     "cannot write --json 'FILE/x.json': 'FILE' is a file, not a directory"),
    (["simulate", "--methods", "planner", "--max-evals", "0", "--schedule-out", "DIR"],
     "cannot write --schedule-out 'DIR': it is a directory; pass a file path"),
    (["simulate", "--methods", "planner", "--max-evals", "0", "--gantt", "/proc/skiptrain-gantt.png"],
     "cannot write --gantt '/proc/skiptrain-gantt.png': No such file or directory"),
    (["simulate", "--methods", "planner", "--max-evals", "0", "--gantt", "chart.xyz"],
     "--gantt 'chart.xyz': the file type is given by its suffix, one of .png, .svg, .pdf; name it e.g. 'chart.png'"),
    (["launch", "--preset", "tiny", "--nodes", "4", "--data", "DATA", "--steps", "1", "--out", "OUT", "--json", "DIR"],
     "cannot write --json 'DIR': it is a directory"),
    (["eval", "RUN", "--batches", "1", "--json", "FILE/r.json"], "'FILE' is a file, not a directory"),
])
def test_an_output_file_that_cannot_be_written_is_refused_before_any_work(trained, capsys, monkeypatch, tmp_path,
                                                                          argv, needle):
    """An output file under a file, that is a directory, in a place that cannot be written, or
    of an image type the chart cannot have: one line before the command plans or trains anything
    (the launch's run directory is not even created)."""
    data, run = trained
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("not a directory")
    (tmp_path / "DIR").mkdir()
    sub = {"DATA": str(data), "RUN": str(run), "OUT": str(tmp_path / "out")}
    one_line_error(capsys, [sub.get(a, a) for a in argv], needle)
    assert not (tmp_path / "out").exists()


def test_a_split_shorter_than_one_sample_is_named_with_its_data_set(capsys, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("Hello there, friend. This is a very short text indeed, with few tokens in it at all.\n")
    assert main(["prepare", "--text", str(text), "--tokenizer", "byte", "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["train", "--preset", "tiny", "--data", str(tmp_path / "d"), "--steps", "1", "--out",
                            str(tmp_path / "r")],
                   f"the 'val' split of data set {tmp_path / 'd'} has 7 tokens, fewer than one sample of 65")


def test_prepare_into_a_run_directory_is_refused(trained, capsys):
    _, run = trained
    one_line_error(capsys, ["prepare", "--text", *TRAIN_TEXTS, "--tokenizer", "byte", "--out", str(run)],
                   f"--out {str(run)!r} holds a training run")


def test_prepare_over_a_data_set_asks_for_overwrite_and_changes_nothing(capsys, tmp_path):
    d = tmp_path / "d"
    assert main(["prepare", "--text", *TRAIN_TEXTS, "--tokenizer", "byte", "--out", str(d)]) == 0
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    capsys.readouterr()
    one_line_error(capsys, ["prepare", "--text", TRAIN_TEXTS[0], "--tokenizer", "byte", "--out", str(d)],
                   "already holds a prepared data set; replace it with --overwrite")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert main(["prepare", "--text", TRAIN_TEXTS[0], "--tokenizer", "byte", "--out", str(d), "--overwrite"]) == 0
    assert {p.name: p.read_bytes() for p in d.iterdir()} != before
