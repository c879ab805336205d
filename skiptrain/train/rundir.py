"""A run directory: what a training run leaves behind, and how to open it again.

    RUN_DIR/config.toml        the full, checked configuration
    RUN_DIR/tokenizer.json     the data set's tokenizer (absent for the byte tokenizer)
    RUN_DIR/model.safetensors  the latest model weights, by global parameter name
    RUN_DIR/metrics.jsonl      one JSON object per logged step (and per validation)
    RUN_DIR/loss.png           the loss curve
    RUN_DIR/run.json           summary: step, tokens, final validation loss, data set
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import Config, ConfigError, config_from_dict, load_toml, save_toml
from ..data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from ..errors import UserError
from ..model import StagedLM

WEIGHTS = "model.safetensors"


class RunError(UserError):
    """A run directory that is missing or incomplete."""


def prepare_run_dir(out: str | Path, cfg: Config, data_dir: str | Path | None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_toml(cfg, out / "config.toml")
    if data_dir is not None and (Path(data_dir) / BPETokenizer.FILE).is_file():
        shutil.copyfile(Path(data_dir) / BPETokenizer.FILE, out / BPETokenizer.FILE)
    return out


def save_weights(model: StagedLM, out: str | Path) -> None:
    """Write the weights atomically (temporary file, fsync, rename)."""
    path = Path(out) / WEIGHTS
    tmp = path.with_suffix(".tmp")
    save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def load_run(run_dir: str | Path) -> tuple[Config, StagedLM, Tokenizer]:
    """Config, model with the run's latest weights, and tokenizer of a finished (or stopped) run."""
    d = Path(run_dir)
    if not (d / "config.toml").is_file():
        raise RunError(f"{str(d)!r} is not a run directory (no config.toml); pass the --out of a `skiptrain train` run")
    try:
        cfg = config_from_dict(load_toml(d / "config.toml"))
    except ConfigError as e:
        raise RunError(f"{d / 'config.toml'}: {e}") from None
    if not (d / WEIGHTS).is_file():
        raise RunError(f"{str(d)!r} has no {WEIGHTS}: the run has not saved weights yet")
    model = StagedLM(cfg.model, seed=cfg.train.seed)
    try:
        state = load_file(str(d / WEIGHTS))
    except Exception as e:  # safetensors raises its own error type on corrupt headers
        raise RunError(f"{d / WEIGHTS} is corrupt ({e}); retrain or restore it from a checkpoint") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RunError(f"{d / WEIGHTS} does not match config.toml (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if (d / BPETokenizer.FILE).is_file():
        tok: Tokenizer = BPETokenizer.load(d / BPETokenizer.FILE)
    elif cfg.model.vocab_size == ByteTokenizer.vocab_size:
        tok = ByteTokenizer()
    else:
        raise RunError(f"{str(d)!r} has no {BPETokenizer.FILE} for its {cfg.model.vocab_size}-token vocabulary; "
                       "copy tokenizer.json from the data directory into the run directory")
    model.eval()
    return cfg, model, tok


def write_summary(out: str | Path, summary: dict) -> None:
    Path(out, "run.json").write_text(json.dumps(summary, indent=1))
