"""A run directory: what a training run leaves behind, and how to open it again.

    RUN_DIR/config.toml        the full, checked configuration
    RUN_DIR/tokenizer.json     the data set's tokenizer (absent for the byte tokenizer)
    RUN_DIR/model.safetensors  the latest model weights, by global parameter name
    RUN_DIR/metrics.jsonl      one JSON object per logged step (and per validation)
    RUN_DIR/loss.png           the loss curve
    RUN_DIR/run.json           summary: step, tokens, final validation loss, data set

``model.safetensors`` carries the SHA-256 of its tensors (names, dtypes, shapes and bytes) in its
safetensors metadata under ``skiptrain.sha256``; :func:`load_weights` (used by ``eval`` and
``generate``) recomputes it and refuses a file that does not match.

A directory that already holds a run is never trained into again by accident: ``train --out``
refuses it unless ``--resume`` continues it or ``--overwrite`` replaces it (:func:`claim_run_dir`).
A run directory has one writer at a time: the command that trains into it holds an exclusive
``flock`` on the directory (the kernel releases it however the process ends), and any other
process that would write it is refused in one line before it touches anything.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint.weights import WEIGHTS, WeightsError, load_weights, save_weights_file
from ..config import Config, ConfigError, config_from_dict, load_toml, save_toml
from ..data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from ..errors import UserError
from ..model import StagedLM

class RunError(UserError):
    """A run directory that is missing or incomplete."""


__all__ = ["RunError", "WeightsError", "claim_run_dir", "run_dir_writer", "load_run", "load_weights", "prepare_run_dir",
           "save_weights", "save_weights_file", "write_summary"]


#: What a run (single-process or swarm) writes into its directory; ``--overwrite`` removes these.
RUN_ENTRIES = ("config.toml", "tokenizer.json", WEIGHTS, WEIGHTS + ".tmp", "metrics.jsonl", "loss.png",
               "run.json", "checkpoints", "parts", "phases", "logs", "recoveries.jsonl",
               "lost_stages.json", "join.json", "join_secret", "rejected_writes.jsonl", "job.json",
               "store.json", "errors", "interrupted.json", "schedule.json", "gantt.png", "elastic.jsonl",
               "elastic_cache")
#: Entries whose presence means the directory holds a run.
RUN_MARKERS = ("config.toml", WEIGHTS, "metrics.jsonl", "run.json", "checkpoints")


@contextmanager
def run_dir_writer(out: str | Path):
    """Be the one writer of run directory ``out`` (made if missing) inside this block, or raise
    :class:`RunError`.  The lock is the kernel's (``flock`` on the directory itself, so no file
    is added): it is released however this process ends.  A directory this block made and left
    empty is removed again (a refused command leaves nothing)."""
    out = Path(out)
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise RunError(f"cannot write the run directory {str(out)!r}: {e.strerror}; pass an --out you can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunError(f"{str(out)!r} is being written by another skiptrain process; wait for it to end, or pass "
                       "another --out") from None
    except OSError:                 # a file system without flock (some NFS mounts): no lock to take
        pass
    try:
        yield
    finally:
        if made and not any(out.iterdir()):
            out.rmdir()
        os.close(fd)


def claim_run_dir(out: str | Path, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse to train into a directory that holds a run, unless resuming it or told to replace it.

    With ``overwrite`` the run's entries (:data:`RUN_ENTRIES`) are deleted; other files stay.
    """
    out = Path(out)
    found = [m for m in RUN_MARKERS if (out / m).exists()]
    if not found or resume:
        return
    if not overwrite:
        raise RunError(f"{str(out)!r} already holds a run ({', '.join(found)}); continue it with --resume, "
                       "replace it with --overwrite, or pass another --out")
    for name in RUN_ENTRIES:
        p = out / name
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        except OSError as e:
            raise RunError(f"--overwrite could not remove {p}: {e.strerror}; remove it by hand") from None


def prepare_run_dir(out: str | Path, cfg: Config, data_dir: str | Path | None) -> Path:
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_toml(cfg, out / "config.toml")
        if data_dir is not None and (Path(data_dir) / BPETokenizer.FILE).is_file():
            shutil.copyfile(Path(data_dir) / BPETokenizer.FILE, out / BPETokenizer.FILE)
    except OSError as e:
        raise RunError(f"cannot write the run directory {str(out)!r}: {e.strerror}; pass a writable --out") from None
    return out


def save_weights(model: StagedLM, out: str | Path) -> None:
    """Write the model's weights with their checksum into ``out/model.safetensors``, atomically."""
    save_weights_file(model.state_dict(), Path(out) / WEIGHTS)


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
    state = load_weights(d / WEIGHTS)
    fix = "restore the run's own config.toml, or pass the run directory these weights belong to"
    shapes = [(n, list(state[n].shape), list(t.shape)) for n, t in model.state_dict().items()
              if n in state and state[n].shape != t.shape]
    if shapes:
        n, stored, want = shapes[0]
        raise RunError(f"{d / WEIGHTS} does not match config.toml: {n} is {stored} in the weights, config.toml "
                       f"makes it {want}; {fix}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RunError(f"{d / WEIGHTS} does not match config.toml (missing {missing[:3]}, unexpected "
                       f"{unexpected[:3]}); {fix}")
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
    """``run.json``: strict JSON, a number that is not finite (no step trained, a diverged
    loss) written as ``null``."""
    Path(out, "run.json").write_text(json.dumps(_finite(summary), indent=1, allow_nan=False))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
