"""The weights file of a run directory: ``model.safetensors`` with a checksum of its tensors.

The SHA-256 over every tensor's name, dtype, shape and bytes (in name order) travels in the
safetensors metadata under ``skiptrain.sha256``; :func:`load_weights` recomputes it and refuses a
file that does not match, or one holding non-finite weights (a diverged run).  Writes are atomic
(temporary file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import UserError

WEIGHTS = "model.safetensors"
CHECKSUM_KEY = "skiptrain.sha256"


class WeightsError(UserError):
    """A weights file that cannot be written, read or trusted; the message says what to do."""


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_weights_file(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write ``state`` with its checksum atomically (temporary file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    state = {n: t.detach().contiguous() for n, t in state.items()}
    try:
        save_file(state, str(tmp), metadata={"format": "pt", CHECKSUM_KEY: weights_digest(state)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise WeightsError(f"cannot write {path}: {e.strerror}; free disk space or make {path.parent} "
                       "writable (the run's checkpoints, if any, are unaffected)") from None


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, after checking the checksum its metadata carries.

    A file without a checksum (written by an older skiptrain) is read with a warning on stderr.
    """
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            state = {n: f.get_tensor(n) for n in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise WeightsError(f"{path} is corrupt or unreadable ({e}); rebuild it from a checkpoint "
                       f"(skiptrain export {path.parent} --format skiptrain --out DIR) or retrain") from None
    want = meta.get(CHECKSUM_KEY)
    if want is None:
        print(f"skiptrain: warning: {path} carries no checksum; its weights are not verified", file=sys.stderr)
    elif weights_digest(state) != want:
        raise WeightsError(f"{path} fails its checksum (the weights were changed or damaged after they were "
                       f"written); rebuild it from a checkpoint (skiptrain export {path.parent} --format skiptrain "
                       "--out DIR) or retrain")
    bad = sorted(n for n, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if bad:
        raise WeightsError(f"{path} holds non-finite weights ({bad[0]}{' and more' if len(bad) > 1 else ''}): the run "
                       "diverged; retrain with a lower train.lr")
    return state
