"""What watching a run costs it: the median iteration time of the 9-node demo swarm while the
dashboard page is open against the same run while it is closed (target: within 2%).

The swarm is ``skiptrain demo``'s (9 nodes, stages 3/2/2/2, planned skip routes for geo12, int8
activations on slow links, DeMo, freezing, checkpoints every 25 iterations), the `small` preset on
the tests' byte-level excerpts.  ``skiptrain dashboard`` serves its run directory for the whole
run; a client opens and closes the page every ``--window`` seconds (closed first): while open it
fetches what the page fetches, its files once and ``/state.json`` every second (the browser itself
is normally on the user's machine; ``--browser`` also runs a headless Chromium on the page, on
this machine, while it is open: the worst case).  Each iteration of ``metrics.jsonl`` (the first
``--warmup`` left out) counts for the window it ran in, from its end time and ``iteration_s``; one
that straddles a switch counts for neither.  Alternating within one run compares the same phases
of the run (freezing changes the iteration time as the run goes) on the same process placement;
separate runs of this machine differ by several percent from each other.  The swarm's own writers
for watching (``swarm.json``, ``live_node<r>.json``) run all the time: they are part of every run.
Reported: per run and over all runs, the median iteration with the page open and closed, their
ratio, and the dashboard process's CPU seconds.

The runs go to ``runs/bench/dash-bench/<date-time>`` (``--keep DIR``: there instead), and stay.

    python bench/dashboard_overhead.py [--quick] [--json PATH] [--reps N] [--steps N] [--window S] [--browser] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._data import excerpt_data  # noqa: E402
from bench._workdir import work_dir  # noqa: E402
from skiptrain.cli.train import DEMO_SWARM  # noqa: E402
from skiptrain.train.metrics import read_metrics  # noqa: E402


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "skiptrain.cli", *args], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Page:
    """Opens and closes the page every ``window_s`` seconds (closed first) until stopped; while
    open it fetches what the page fetches (and with ``browser`` a headless Chromium shows it)."""

    def __init__(self, url: str, window_s: float, browser: bool):
        self.url, self.window_s, self.browser = url, window_s, browser
        self.stop, self.fetches, self.windows = threading.Event(), 0, []    # windows: (start, end, open)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        opened = False
        while not self.stop.is_set():
            t0 = time.time()
            chrome = self.open_browser() if opened else None
            if opened:
                for f in ("", "app.js", "style.css"):
                    urllib.request.urlopen(self.url + f).read()
            while not self.stop.is_set() and time.time() < t0 + self.window_s:
                if opened:
                    urllib.request.urlopen(self.url + "state.json").read()
                    self.fetches += 1
                self.stop.wait(1.0)
            if chrome is not None:            # (Chromium and every process it started)
                os.killpg(chrome.pid, signal.SIGKILL)
                chrome.wait()
            self.windows.append((t0, time.time(), opened))
            opened = not opened

    def open_browser(self):
        if not self.browser:
            return None
        profile = tempfile.mkdtemp(prefix="dash-bench-chromium-")
        return subprocess.Popen([shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
                                 "--no-first-run", "--disable-background-networking", "--disable-sync",
                                 f"--user-data-dir={profile}", "--remote-debugging-port=0", self.url],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def split_by_window(rows: list[dict], windows: list[tuple], warmup: int) -> dict[bool, list[float]]:
    """``iteration_s`` of the training rows after ``warmup``, by whether the page was open for the
    whole iteration (rows straddling a switch, or outside every window, are left out)."""
    out: dict[bool, list[float]] = {True: [], False: []}
    for r in rows:
        if "loss" not in r or r["step"] <= warmup:
            continue
        end = r["time"]
        start = end - r["iteration_s"] - 0.05
        for w0, w1, opened in windows:
            if w0 <= start and end <= w1:
                out[opened].append(r["iteration_s"])
                break
    return out


def one_run(data: Path, run: Path, steps: int, window_s: float, browser: bool, warmup: int) -> dict:
    sets = [x for o in DEMO_SWARM for x in ("--set", o)]
    t0 = time.time()
    launch = cli("launch", "--preset", "small", "--data", str(data), "--out", str(run), "--steps", str(steps), *sets)
    while not run.is_dir():
        time.sleep(0.1)
    dash = cli("dashboard", str(run), "--bind", "127.0.0.1:0")
    page = Page(re.search(r"http://\S+/", dash.stdout.readline())[0], window_s, browser)
    page.thread.start()
    out, _ = launch.communicate()
    page.stop.set()
    page.thread.join()
    dash_cpu = cpu_s(dash.pid)
    dash.kill()
    dash.wait()
    if launch.returncode != 0:
        raise SystemExit(f"[bench] the swarm failed:\n{out[-3000:]}")
    by = split_by_window(read_metrics(run / "metrics.jsonl"), page.windows, warmup)
    open_s = sum(w1 - w0 for w0, w1, o in page.windows if o)
    return {"wall_s": round(time.time() - t0, 1), "open": by[True], "closed": by[False],
            "median_open_s": statistics.median(by[True]), "median_closed_s": statistics.median(by[False]),
            "dashboard_cpu_s": round(dash_cpu, 2), "page_open_s": round(open_s, 1), "state_fetches": page.fetches}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 run of 60 iterations (else 2 of 100)")
    ap.add_argument("--reps", type=int, default=None, help="runs")
    ap.add_argument("--steps", type=int, default=None, help="iterations per run")
    ap.add_argument("--window", type=float, default=10.0, help="seconds the page stays open, then closed")
    ap.add_argument("--warmup", type=int, default=5, help="first iterations of each run left out")
    ap.add_argument("--browser", action="store_true", help="also run a headless Chromium on the page while open")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--keep", default=None, help="keep the runs in this directory")
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 2)
    steps = args.steps or (60 if args.quick else 100)
    runs = []
    with work_dir(args.keep, "dash-bench-") as work:
        data = excerpt_data(work)
        for rep in range(reps):
            r = one_run(data, work / f"run{rep}", steps, args.window, args.browser, args.warmup)
            runs.append({"name": f"run{rep}", **r})
            print(f"[bench] run{rep}: median iteration {r['median_open_s']:.4f} s open ({len(r['open'])}), "
                  f"{r['median_closed_s']:.4f} s closed ({len(r['closed'])}); dashboard {r['dashboard_cpu_s']} CPU s "
                  f"in {r['wall_s']} s", flush=True)
    opened = statistics.median([x for r in runs for x in r["open"]])
    closed = statistics.median([x for r in runs for x in r["closed"]])
    cpu, wall = sum(r["dashboard_cpu_s"] for r in runs), sum(r["wall_s"] for r in runs)
    out = {"reps": reps, "steps": steps, "window_s": args.window, "warmup": args.warmup, "browser": args.browser,
           "nodes": 9, "median_iteration_closed_s": closed, "median_iteration_open_s": opened,
           "overhead": opened / closed - 1, "dashboard_cpu_fraction_of_one_core": cpu / wall, "runs": runs}
    page = "page open" + (" + headless Chromium" if args.browser else "")
    print("\n| run | iterations open / closed | median open (s) | median closed (s) | open / closed | "
          "dashboard CPU (s) | wall (s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        print(f"| {r['name']} | {len(r['open'])} / {len(r['closed'])} | {r['median_open_s']:.4f} | "
              f"{r['median_closed_s']:.4f} | {r['median_open_s'] / r['median_closed_s']:.4f} | "
              f"{r['dashboard_cpu_s']} | {r['wall_s']} |")
    print(f"\n| figure | value |\n| --- | ---: |\n| median iteration, page closed | {closed:.4f} s |\n"
          f"| median iteration, {page} | {opened:.4f} s |\n"
          f"| overhead (target <= 2%) | {100 * out['overhead']:+.2f}% |\n"
          f"| dashboard process CPU, share of one core over the runs | {100 * out['dashboard_cpu_fraction_of_one_core']:.2f}% |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
