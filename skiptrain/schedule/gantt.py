"""Gantt charts of timelines (:mod:`.timeline` format), drawn with matplotlib's Agg backend.

:func:`draw_gantt` draws one timeline: one row per node, compute as bars (forward blue,
backward orange, loss red), data-parallel sync as a grey bar, and messages being sent as a thin
green strip under the sender's row.  :func:`draw_side_by_side` puts two timelines (e.g. the
simulator's and the runtime's measured one for the same schedule) one above the other on a
shared time axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .timeline import Event

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "loss": "#C44E52", "sync": "#9A9A9A", "send": "#55A868"}


def _draw(ax, timeline: Sequence[Event], title: str, node_labels: dict[int, str] | None) -> None:
    nodes = sorted({e.node for e in timeline})
    row = {n: i for i, n in enumerate(nodes)}
    bars: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in timeline:
        if e.kind in ("recv",):
            continue
        bars.setdefault((e.kind, e.node), []).append((e.start, max(e.end - e.start, 1e-9)))
    for (kind, node), spans in bars.items():
        y = row[node]
        if kind == "send":
            ax.broken_barh(spans, (y - 0.45, 0.12), facecolors=COLORS["send"], alpha=0.6, linewidth=0)
        elif kind == "sync":
            ax.broken_barh(spans, (y - 0.3, 0.6), facecolors=COLORS["sync"], alpha=0.7, linewidth=0)
        else:
            ax.broken_barh(spans, (y - 0.3, 0.6), facecolors=COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(nodes)))
    ax.set_yticklabels([node_labels.get(n, str(n)) if node_labels else str(n) for n in nodes], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def _legend(fig) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


def draw_gantt(timeline: Sequence[Event], path: str | Path, title: str = "",
               node_labels: dict[int, str] | None = None, dpi: int = 90) -> Path:
    """Write a Gantt PNG of ``timeline`` to ``path`` and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len({e.node for e in timeline})
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.28 * max(n, 1)))
    _draw(ax, timeline, title, node_labels)
    ax.set_xlabel("seconds")
    _legend(fig)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p


def draw_side_by_side(simulated: Sequence[Event], measured: Sequence[Event], path: str | Path,
                      titles: tuple[str, str] = ("simulated", "measured"),
                      node_labels: dict[int, str] | None = None, dpi: int = 90) -> Path:
    """Two timelines of the same schedule on a shared time axis, simulated on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len({e.node for e in list(simulated) + list(measured)})
    h = 1.0 + 0.25 * max(n, 1)
    fig, axes = plt.subplots(2, 1, figsize=(11, 2 * h + 0.6), sharex=True)
    _draw(axes[0], simulated, titles[0], node_labels)
    _draw(axes[1], measured, titles[1], node_labels)
    axes[1].set_xlabel("seconds")
    _legend(fig)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p
