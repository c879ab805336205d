"""The parts of a fair race that every race bench shares (bench/dp_compression.py,
bench/flagship.py): contenders with a small grid and a ladder of lengths, a records cache of
trained runs, the two clocks of a timed run, the coordinate search, the rungs of the ladder, the
time to the baseline's final loss, and the tables and picture of a race.

A race's output ``out`` holds ``out["sides"][name]`` with ``label``, ``clock`` (seconds per step on
each of :data:`CLOCKS`), ``tuning`` and ``rungs`` (see :func:`rung`); the baseline is one side
whose single rung is the target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

#: "machine": every node process sharing this machine's cores; "own": each node its own compute
CLOCKS = ("machine", "own")


@dataclass
class Side:
    """One contender: its fixed overrides, its grid (axis name -> list of override lists; the
    first value of each axis is where the search starts) and its ladder of lengths."""
    label: str
    base: list[str]
    grid: dict[str, list[list[str]]]
    ladder: tuple[float, ...] = ()       # fractions of the steps that fit in the baseline's wall-clock
    tune_at: float = 1.0                 # the fraction the grid is searched at (the target length)
    start: dict[str, int] = field(default_factory=dict)  # axis -> index of the starting value

    def settings(self, choice: dict[str, int]) -> list[str]:
        return self.base + [o for axis, values in self.grid.items() for o in values[choice[axis]]]


def lrs(*rates: float) -> list[list[str]]:
    """A learning-rate axis of a grid."""
    return [[f"train.lr={x:g}"] for x in rates]


# ---- running ----------------------------------------------------------------------------------

def code_version() -> str:
    """The version of the code that trains a run: 12 hex digits of the SHA-256 over the skiptrain
    package's Python sources (path and bytes, in path order); documents and benches do not count."""
    root = Path(__file__).resolve().parents[1] / "skiptrain"
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


class Runner:
    """Trains runs (``(overrides, steps, seed)``) as phases of one launch and keeps every record
    in ``records.jsonl`` of the work folder, so that a run is never trained twice for the same
    key by the same code.  ``config(overrides, steps, seed)`` builds a run's config;
    ``launch(cfgs, run_dir)`` trains them (one launch folder each call) and returns their records
    in order.  Each record carries :func:`code_version`; one of other code (or of none) stays in
    the file but is not reused unless ``any_code`` (said in one line), and then only where
    ``any_code_ok(key)`` holds (a bench keeps timed runs to the code that timed them)."""

    def __init__(self, folder: Path, config: Callable, launch: Callable, any_code: bool = False,
                 any_code_ok: Callable[[str], bool] = lambda key: True):
        self.folder, self.config, self.launch = folder, config, launch
        self.path = folder / "records.jsonl"
        self.code = code_version()
        self.recs = {}
        other = 0
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    d = json.loads(line)
                    if d.get("code") == self.code or (any_code and any_code_ok(d["key"])):
                        self.recs[d["key"]] = d["rec"]
                    else:
                        other += 1
        if other:
            print(f"[race] {other} record(s) in {self.path} were trained by other code than this ({self.code}); "
                  "they are kept, not reused (--any-code reuses them)", flush=True)
        self.launches = 0

    @staticmethod
    def key(overrides: list[str], steps: int, seed: int) -> str:
        return json.dumps([sorted(overrides), steps, seed])

    def train(self, runs: list[tuple[list[str], int, int]]) -> list[dict]:
        """The records of ``runs``, training (in one launch) those not recorded yet."""
        todo = [r for r in dict.fromkeys((tuple(o), s, sd) for o, s, sd in runs) if self.key(*r) not in self.recs]
        if todo:
            self.launches += 1
            run_dir = self.folder / f"launch{self.launches:03d}-{time.strftime('%H%M%S')}"
            while run_dir.exists():     # (a kept folder's earlier launch of the same second)
                run_dir = run_dir.with_name(run_dir.name + "b")
            recs = self.launch([self.config(list(o), s, sd) for o, s, sd in todo], run_dir)
            for (o, s, sd), rec in zip(todo, recs):
                self.recs[self.key(list(o), s, sd)] = rec
                with self.path.open("a") as f:
                    f.write(json.dumps({"key": self.key(list(o), s, sd), "code": self.code, "rec": rec}) + "\n")
                val = rec["val"][-1][1] if rec["val"] else float("nan")
                print(f"  trained {s:5d} steps seed {sd}: val {val:.4f}  {' '.join(o)}", flush=True)
        return [self.recs[self.key(list(o), s, sd)] for o, s, sd in runs]


# ---- timing -----------------------------------------------------------------------------------

def timing_steps(period: int, quick: bool) -> int:
    """Whole periods: one to warm up, then at least 6 steps (quick: 3)."""
    need = 3 if quick else 6
    return period * (1 + max(1, math.ceil(need / period)))


def machine_seconds(rec: dict, period: int) -> float:
    """This machine's seconds per step of a timed run: the wall seconds between its iteration
    lines over its whole periods after the first."""
    t = rec["time"]
    return (t[-1] - t[period - 1]) / (len(t) - period)


def seconds_per_step(rec: dict, period: int, nodes: int, cores: int) -> dict:
    """Both clocks of one linked timing run, over its whole periods after the first: this
    machine's (wall seconds between iteration lines) and own compute (emulated link seconds per
    step plus one node's CPU seconds per step); and this machine's CPU floor per step."""
    t, cpu = rec["time"], rec["cpu_s"]
    n = len(t) - period
    link = rec["summary"]["emulated_link_s"] / len(t)
    node_cpu = sum(cpu[period:]) / n / nodes
    return {"machine": machine_seconds(rec, period), "own": link + node_cpu, "link_s": link, "node_cpu_s": node_cpu,
            "host_floor_s": node_cpu * nodes / cores, "steps": len(t)}


# ---- tuning -----------------------------------------------------------------------------------

def final_val(rec: dict) -> float:
    return rec["val"][-1][1]


def tune(runner, side: Side, steps: int, follow: int = 2) -> dict:
    """Coordinate search over ``side.grid`` at ``steps``, first seed: each axis in turn, the
    others held at their best so far.  A learning rate that wins at an edge of its grid is
    followed past it (doubled or halved, at most ``follow`` times), so no side is judged at a
    rate its grid cut short.  Returns the trials, the winning settings and choice (indices into
    the grid as searched, which ``grid`` lists)."""
    grid = {a: list(v) for a, v in side.grid.items()}
    side = dataclasses.replace(side, grid=grid)
    choice, trials = dict(side.start), {}

    def run(cands):
        recs = runner.train([(side.settings(c), steps, 0) for c in cands])
        for c, r in zip(cands, recs):
            trials[json.dumps(side.settings(c))] = {"settings": side.settings(c)[len(side.base):], "val": final_val(r)}
        return min(zip(cands, recs), key=lambda cr: final_val(cr[1]))[0]

    for axis, values in grid.items():
        choice = run([{**choice, axis: i} for i in range(len(values))])
        for _ in range(follow if axis == "lr" else 0):
            edge = {0: 0.5, len(values) - 1: 2.0}.get(choice[axis])
            if edge is None:
                break
            lr = float(values[choice[axis]][0].split("=")[1]) * edge
            values.insert(0 if edge < 1 else len(values), [f"train.lr={lr:g}"])
            best = choice if edge > 1 else {**choice, axis: choice[axis] + 1}
            choice = run([best, {**choice, axis: 0 if edge < 1 else len(values) - 1}])
    return {"steps": steps, "grid": {a: [" ".join(v) for v in vs] for a, vs in grid.items()},
            "trials": list(trials.values()), "winner": side.settings(choice)[len(side.base):], "choice": choice}


def untuned(side: Side) -> dict:
    """The tuning record of a side raced at its starting settings."""
    return {"winner": side.settings(side.start)[len(side.base):], "choice": dict(side.start), "trials": []}


# ---- the race ---------------------------------------------------------------------------------

def rung_steps(fraction: float, baseline_s: float, s_per_step: float, period: int) -> int:
    """Steps of a rung: ``fraction`` of the steps that fit in the baseline's wall-clock, the
    nearest whole number of periods, but never more than fit (a rung is never longer than the
    baseline's wall-clock), and at least one period."""
    fit = int(baseline_s / s_per_step / period) * period
    return max(period, min(fit, round(fraction * baseline_s / s_per_step / period) * period))


def rung(runner, settings: list[str], steps: int, seeds: int, clock: dict, fraction: float | None) -> dict:
    """One rung of a ladder (or the baseline's run): every seed trained, placed on both clocks."""
    recs = runner.train([(settings, steps, s) for s in range(seeds)])
    vals = [final_val(r) for r in recs]
    return {"fraction": fraction, "steps": steps, "val_seeds": vals, "val_mean": statistics.mean(vals),
            "time_s": {c: steps * clock[c] for c in CLOCKS},
            "curves": [r["val"] for r in recs]}


def time_to_target(rungs: list[dict], target: float) -> dict:
    """Per clock: the seconds of the shortest rung whose mean final loss is <= ``target`` (None:
    no rung reached it)."""
    hit = [r for r in sorted(rungs, key=lambda r: r["steps"]) if r["val_mean"] <= target]
    return {c: (hit[0]["time_s"][c] if hit else None) for c in CLOCKS}


def time_to_baseline(out: dict, baseline: str) -> dict:
    """Adds the baseline's final loss, and per side and clock the time to it and how many times
    sooner than the baseline (``time_to_baseline_s``, ``sooner_than_baseline``)."""
    target = out["sides"][baseline]["rungs"][0]["val_mean"]
    base_t = out["sides"][baseline]["rungs"][0]["time_s"]
    out["baseline_final_val"] = target
    out["time_to_baseline_s"], out["sooner_than_baseline"] = {}, {}
    for n, s in out["sides"].items():
        t = time_to_target(s["rungs"], target)
        out["time_to_baseline_s"][n] = t
        out["sooner_than_baseline"][n] = {c: (base_t[c] / t[c] if t[c] else None) for c in CLOCKS}
    out["tuning"] = {n: s["tuning"] for n, s in out["sides"].items()}
    return out


# ---- output -----------------------------------------------------------------------------------

def print_baseline(out: dict, baseline: str, unit: str) -> None:
    """The baseline's length and final validation loss (mean over its seeds)."""
    print(f"\nbaseline: {out['baseline_steps']} {unit}, final val {out['baseline_final_val']:.4f} (mean of "
          f"{len(out['sides'][baseline]['rungs'][0]['val_seeds'])} seeds)")


def print_rungs(out: dict) -> None:
    print(f"\n{'side':12s} {'rung':>5s} {'steps':>6s} {'val (mean)':>10s} {'per seed':>26s} {'s here':>8s} {'s own':>8s}")
    for n, s in out["sides"].items():
        for r in s["rungs"]:
            f = "-" if r["fraction"] is None else f"{r['fraction']:.3g}"
            seeds = " ".join(f"{v:.4f}" for v in r["val_seeds"])
            print(f"{n:12s} {f:>5s} {r['steps']:6d} {r['val_mean']:10.4f} {seeds:>26s} "
                  f"{r['time_s']['machine']:8.0f} {r['time_s']['own']:8.0f}")


def print_tuning(out: dict) -> None:
    print("\ntuning (first seed, final val at the side's target length, or at each rung's):")
    for n, tu in out["tuning"].items():
        for tu1 in tu.get("per_rung", [tu]):
            for t in tu1["trials"]:
                print(f"  {n:12s} {tu1.get('steps', '-')!s:>5s} steps  {t['val']:.4f}  {' '.join(t['settings'])}")


def plot_race(out: dict, path: str, titles: tuple[str, str], xlabel: str) -> None:
    """Validation loss against seconds on both clocks: every rung of every side, first seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90, sharey=True)
    for ax, c, title in zip(axes, CLOCKS, titles):
        for n, s in out["sides"].items():
            color = None
            for r in s["rungs"]:
                per = r["time_s"][c] / r["steps"]
                line, = ax.plot([st * per for st, _ in r["curves"][0]], [v for _, v in r["curves"][0]], "-", lw=1.1,
                                color=color, label=n if color is None else None)
                color = line.get_color()
                ax.plot([r["time_s"][c]], [r["val_mean"]], "o", ms=4, color=color)
        ax.axhline(out["baseline_final_val"], color="k", lw=0.8, ls=":", label="baseline final")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("validation loss")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
