"""Checkpoints for the single-process trainer: what is saved, when, and exact resumption.

A :class:`TrainerCheckpoints` is owned by :class:`skiptrain.train.trainer.Trainer`.  It saves
(asynchronously) every ``checkpoint.every`` steps and when ``fit`` finishes, keeping the newest
``checkpoint.keep`` under ``checkpoint.dir`` (default ``RUN_DIR/checkpoints``).  Saved state:

* tensors: model parameters by global name, AdamW state as ``optim.{key}.{name}``;
* JSON: ``step``, the full ``config``, ``data`` (the loader's global sample cursor), ``rng``
  (the route ``random.Random`` state and torch's CPU generator state), ``optimizer`` groups,
  ``placement`` (every stage on this one process) and ``freeze`` (no frozen layers yet);
  the learning-rate schedule is a pure function of ``step``, so it needs nothing else.

:func:`restore_trainer` puts all of it back, so ``--resume`` continues with the same loss curve
as an uninterrupted run (tested).  A corrupt latest checkpoint raises CheckpointCorruptError
offering the previous committed one, which ``--resume PATH`` accepts.  Lines of
``metrics.jsonl`` logged after the restored step (by the interrupted run) are dropped.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError
from .manager import CheckpointManager
from .store import atomic_write, start_branch
from .state import decode_random, decode_torch_rng, encode_random, encode_torch_rng


def checkpoint_root(trainer) -> Path:
    c = trainer.cfg.checkpoint
    if c.dir:
        return Path(c.dir)
    if trainer.out is None:
        raise CheckpointError("checkpoints need a run directory (--out) or checkpoint.dir")
    return Path(trainer.out) / "checkpoints"


def trainer_state(trainer) -> dict[str, Any]:
    S = trainer.cfg.model.n_stages
    return {
        "step": trainer.step,
        "config": trainer.cfg.to_dict(),
        "data": trainer.loader.state_dict(),
        "data_fingerprint": trainer.ds.fingerprint(),
        "rng": {"routes": encode_random(trainer.route_rng), "torch": encode_torch_rng(torch.get_rng_state())},
        "placement": {"stages": {str(s): [0] for s in range(S)},
                      "partition": trainer.model.partition.to_list()},
        "freeze": {"frozen_layers": 0},
    }


class TrainerCheckpoints:
    def __init__(self, trainer):
        self.cfg = trainer.cfg.checkpoint
        self.root = checkpoint_root(trainer)
        self.manager = CheckpointManager(self.root, keep=self.cfg.keep)
        self.stalls: list[float] = []

    def save(self, trainer) -> float:
        stall = self.manager.save_training(trainer.step, trainer.model, trainer.opt, trainer_state(trainer),
                                           layout={"n_stages": trainer.cfg.model.n_stages, "replicas": 1},
                                           overlap=self.cfg.overlap)
        self.stalls.append(stall)
        return stall

    def after_step(self, trainer) -> None:
        if self.cfg.every and trainer.step % self.cfg.every == 0:
            self.save(trainer)

    def finish(self, trainer, completed: bool) -> None:
        """At the end of ``fit``: the final save (if enabled and the run completed), then wait.

        When ``fit`` is failing (``completed=False``) an error of the pending background save is
        not raised over the original exception; that save simply stays uncommitted.
        """
        try:
            if completed and self.cfg.final:
                self.save(trainer)
        finally:
            try:
                self.manager.close()
            except Exception:
                if completed:
                    raise


def restore_trainer(trainer, path: str | Path | None = None) -> Path:
    """Load the latest checkpoint (or ``path``) into ``trainer``; returns the checkpoint used."""
    src = Path(path) if path is not None else checkpoint_root(trainer)
    reader = CheckpointManager.restore(src, trainer.model, trainer.opt)
    st = reader.state
    check_same_data(st.get("data_fingerprint"), ((st.get("config") or {}).get("data") or {}).get("path"),
                    reader.path, trainer.ds)
    trainer.step = reader.step
    trainer.loader.load_state_dict(st["data"])
    if "rng" in st:             # (a swarm's checkpoint keeps RNG per node: the trainer's stays as seeded)
        decode_random(st["rng"]["routes"], trainer.route_rng)
        torch.set_rng_state(decode_torch_rng(st["rng"]["torch"]))
    if trainer.out is not None:
        truncate_metrics(Path(trainer.out) / "metrics.jsonl", trainer.step)
        begin_branch(checkpoint_root(trainer), reader.path, reader.step, Path(trainer.out) / "metrics.jsonl")
    return reader.path


def begin_branch(root: Path, source: Path, step: int, metrics: Path) -> None:
    """A resume from step ``step`` (checkpoint ``source``) of a run whose ``root`` holds newer
    steps starts a new branch (:func:`~skiptrain.checkpoint.store.start_branch`): said once,
    and marked in ``metrics`` by a line at ``step`` naming where the earlier branch went."""
    moved = start_branch(root, step)
    if moved is None:
        return
    note = f"resumed from {source}; the later steps of the earlier branch moved to {moved}"
    print(f"skiptrain: a new branch of the run: {note}", file=sys.stderr, flush=True)
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": step, "time": round(time.time(), 3), "branch": note}) + "\n")


def check_same_data(saved: str | None, was: str | None, path, ds) -> None:
    """Refuse to resume checkpoint ``path`` (trained on the data set of fingerprint ``saved``, at
    ``was``) on another data set ``ds`` (by :meth:`~skiptrain.data.dataset.TokenDataset.fingerprint`):
    its data cursor is a position in that data set.  Checkpoints from before fingerprints pass."""
    if saved and saved != ds.fingerprint():
        was = was or "the run's data set"
        raise CheckpointError(f"--resume: the checkpoint {path} was trained on another data set than {ds.path} "
                              f"(fingerprint {saved[:12]}, not {ds.fingerprint()[:12]}); resume it with the data "
                              f"set it was trained on ({was})")


def truncate_metrics(path: Path, step: int, position=None) -> None:
    """Drop metric lines logged after ``step`` (by the run that was interrupted), atomically;
    ``position(row)``: where a line falls against ``step`` (default: its ``step``)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if (position(row) if position else row.get("step", 0)) > step:
                continue
        except ValueError:
            continue  # a torn last line from a killed run
        keep.append(line)
    atomic_write(path, ("\n".join(keep) + "\n" if keep else "").encode())
