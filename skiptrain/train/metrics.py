"""Metrics as JSON lines, and the loss-curve plot drawn from them."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per line; flushed on every write so a crash loses nothing logged."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._f = open(self.path, "a" if append else "w")

    def write(self, **row) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path, live: bool = False) -> list[dict]:
    """The rows of a metrics file.  ``live``: the run may be writing it (a missing file is no
    rows; a line that is not a JSON object, such as the half-written last one, is skipped)."""
    if live and not Path(path).is_file():
        return []
    rows = []
    for line in Path(path).read_text(errors="replace" if live else "strict").splitlines():
        if not line.strip():
            continue
        if not live:
            rows.append(json.loads(line))
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def plot_loss(metrics_path: str | Path, png_path: str | Path, title: str = "skiptrain",
              baseline: float | None = None) -> None:
    """Training loss (per step) and validation loss (per evaluation) against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label="unigram baseline")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
