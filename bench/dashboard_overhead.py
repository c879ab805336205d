"""What watching a run costs it: the median iteration time of the 9-node demo swarm with the
dashboard open against the same run without it (target: within 2%).

Each repetition launches the demo's swarm (``skiptrain demo``'s settings: 9 nodes, stages
3/2/2/2, planned skip routes on emulated geo12 links' plan, int8 activations, DeMo, freezing,
checkpoints; the `small` preset on the tests' byte-level excerpts) twice, alternately: once
alone, once with ``skiptrain dashboard`` serving its run directory and a client that fetches the
page, its script and style once and ``/state.json`` every second, as the open page does (the
browser itself is on the user's machine; ``--browser`` also keeps a headless Chromium open on the
page on this machine, the worst case).  The swarm's own writers for watching (``swarm.json``,
``live_node<r>.json``) run in both: they are part of every run.  The figure is the ratio of the
median ``iteration_s`` (``metrics.jsonl``, the first ``--warmup`` iterations left out) over all
repetitions of each kind, with the dashboard process's CPU seconds.

Everything goes to a temporary directory that is deleted at the end (``--keep DIR`` keeps it).

    python bench/dashboard_overhead.py [--quick] [--json PATH] [--reps N] [--steps N] [--browser] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


class PageClient:
    """Fetches what the open page fetches: its files once, then ``/state.json`` every second."""

    def __init__(self, url: str):
        self.url, self.stop, self.fetches = url, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        for f in ("", "app.js", "style.css"):
            urllib.request.urlopen(self.url + f).read()
        while not self.stop.wait(1.0):
            urllib.request.urlopen(self.url + "state.json").read()
            self.fetches += 1


def watch(run: Path, browser: bool):
    """Start the dashboard on ``run`` (once it exists), the page client and optionally Chromium."""
    while not run.is_dir():
        time.sleep(0.1)
    dash = cli("dashboard", str(run), "--bind", "127.0.0.1:0")
    url = re.search(r"http://\S+/", dash.stdout.readline())[0]
    client = PageClient(url)
    client.thread.start()
    chrome = None
    if browser:
        profile = tempfile.mkdtemp(prefix="dash-bench-chromium-")
        chrome = subprocess.Popen([shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
                                   "--no-first-run", "--disable-background-networking", "--disable-sync",
                                   f"--user-data-dir={profile}", "--remote-debugging-port=0", url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return dash, client, chrome


def one_run(data: Path, run: Path, steps: int, watched: bool, browser: bool, warmup: int) -> dict:
    sets = [x for o in DEMO_SWARM for x in ("--set", o)]
    t0 = time.time()
    launch = cli("launch", "--preset", "small", "--data", str(data), "--out", str(run), "--steps", str(steps), *sets)
    dash = client = chrome = None
    if watched:
        dash, client, chrome = watch(run, browser)
    out, _ = launch.communicate()
    if launch.returncode != 0:
        raise SystemExit(f"[bench] the swarm failed:\n{out[-3000:]}")
    res = {"watched": watched, "wall_s": round(time.time() - t0, 1)}
    if watched:
        res["dashboard_cpu_s"] = round(cpu_s(dash.pid), 2)
        res["state_fetches"] = client.fetches
        client.stop.set()
        for p in (dash, chrome):
            if p is not None:
                p.kill()
                p.wait()
    its = [r["iteration_s"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r and r["step"] > warmup]
    res.update(iterations=its, median_iteration_s=statistics.median(its))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repetitions of 20 iterations (else 3 of 40)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=5, help="first iterations of each run left out")
    ap.add_argument("--browser", action="store_true", help="also keep a headless Chromium open on the page")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--keep", default=None, help="keep the runs in this directory")
    args = ap.parse_args()
    reps = args.reps or (2 if args.quick else 3)
    steps = args.steps or (20 if args.quick else 40)
    runs = []
    with work_dir(args.keep, "dash-bench-") as work:
        data = excerpt_data(work)
        for rep in range(reps):
            for watched in ((False, True) if rep % 2 == 0 else (True, False)):
                name = f"{'watched' if watched else 'alone'}{rep}"
                r = one_run(data, work / name, steps, watched, args.browser, args.warmup)
                runs.append({"name": name, **r})
                print(f"[bench] {name}: median iteration {r['median_iteration_s']:.4f} s, wall {r['wall_s']} s"
                      + (f", dashboard {r['dashboard_cpu_s']} CPU s, {r['state_fetches']} state fetches" if watched else ""),
                      flush=True)
    alone = statistics.median([x for r in runs if not r["watched"] for x in r["iterations"]])
    seen = statistics.median([x for r in runs if r["watched"] for x in r["iterations"]])
    dash_cpu = sum(r["dashboard_cpu_s"] for r in runs if r["watched"])
    dash_wall = sum(r["wall_s"] for r in runs if r["watched"])
    out = {"reps": reps, "steps": steps, "warmup": args.warmup, "browser": args.browser, "nodes": 9,
           "median_iteration_alone_s": alone, "median_iteration_watched_s": seen, "overhead": seen / alone - 1,
           "dashboard_cpu_fraction_of_one_core": dash_cpu / dash_wall,
           "runs": [{k: v for k, v in r.items() if k != "iterations"} for r in runs]}
    print("\n| run | median iteration (s) | wall (s) | dashboard CPU (s) |\n| --- | ---: | ---: | ---: |")
    for r in runs:
        print(f"| {r['name']} | {r['median_iteration_s']:.4f} | {r['wall_s']} | {r.get('dashboard_cpu_s', '-')} |")
    print(f"\n| figure | value |\n| --- | ---: |\n| median iteration, no dashboard | {alone:.4f} s |\n"
          f"| median iteration, dashboard open{' + headless Chromium' if args.browser else ''} | {seen:.4f} s |\n"
          f"| overhead (target <= 2%) | {100 * out['overhead']:+.2f}% |\n"
          f"| dashboard process CPU, share of one core | {100 * out['dashboard_cpu_fraction_of_one_core']:.2f}% |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
