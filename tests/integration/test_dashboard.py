"""Watching a running swarm: the dashboard in headless Chromium, ``skiptrain status --json`` and
the TensorBoard event files, on one 4-node run (``--recover``) in which a node is killed mid-run.

The run, the dashboard and the browser's observations are one module-scoped fixture (CI time);
each test asserts on what it recorded.  Chromium is Debian's ``chromium``: installed with apt-get
when missing (as root), else these tests skip saying so.  The screenshot of the page goes to
``$SKIPTRAIN_ARTIFACTS`` (default ``runs/artifacts/``) as ``dashboard.png``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from skiptrain.runtime.node_processes import node_pids
from skiptrain.watch.tensorboard_log import SCALAR_TAGS, TB_DIR

from conftest import tensorboard_tags, wait_for

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: The issue's bound: the killed node shows fenced in the page within this many seconds of the kill.
FENCED_WITHIN_S = 10.0


def chromium() -> str:
    """Debian's chromium; apt-get installs it when missing (root only), else the test skips."""
    path = shutil.which("chromium")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=900, check=False)
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("the browser test needs Debian's chromium (apt-get install chromium), which is missing "
                    "and could not be installed here")
    return path


def browse(exe: str, url: str, *args: str, budget_ms: int = 2000) -> str:
    """Load ``url`` in a fresh headless Chromium for ``budget_ms`` of virtual time, then do
    ``args`` (default: print the DOM); its stdout."""
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                            *(args or ("--dump-dom",)), url], capture_output=True, text=True, timeout=120)
    return r.stdout


def node_states(dom: str) -> dict[int, str]:
    return {int(n): s for n, s in re.findall(r'class="node" data-node="(\d+)" data-state="(\w+)"', dom)}


def svg_count(dom: str, svg: str, attr: str) -> int:
    m = re.search(rf'<svg id="{svg}" [^>]*data-{attr}="(\d+)"', dom)
    return int(m[1]) if m else -1


def cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "skiptrain.cli", *args], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="module")
def watched(byte_data, tmp_path_factory):
    """A 4-node swarm (stage 0 replicated) with log.tensorboard on, its dashboard, and what a
    browser saw: before the kill of a stage-0 replica and until it showed that node fenced."""
    exe = chromium()
    run = tmp_path_factory.mktemp("watched") / "run"
    launch = cli("launch", "--preset", "tiny", "--data", str(byte_data), "--out", str(run), "--nodes", "4",
                 "--set", "model.n_stages=3", "--set", "runtime.stage_sizes=2,1,1", "--steps", "300", "--recover",
                 "--set", "log.tensorboard=true", "--set", "train.eval_every=50")
    dash = None
    try:
        wait_for(lambda: run.is_dir(), 120)
        dash = cli("dashboard", str(run), "--bind", "127.0.0.1:0")
        url = re.search(r"http://\S+/", dash.stdout.readline())[0]
        swarm = run / "swarm.json"

        def started() -> bool:
            try:
                nodes = json.loads(swarm.read_text())["nodes"]
            except (OSError, ValueError, KeyError):
                return False
            rows = (run / "metrics.jsonl").read_text().count('"loss"') if (run / "metrics.jsonl").exists() else 0
            return len(nodes) == 4 and all(n["status"] == "alive" for n in nodes) and rows >= 10
        wait_for(started, 120)
        before = browse(exe, url)
        stage0 = [n["node"] for n in json.loads(swarm.read_text())["nodes"] if n["stages"] == [0]]
        victim = max(stage0)                       # (a replica of stage 0, not the lowest node)
        os.kill(node_pids(run)[victim], signal.SIGKILL)
        t_kill, after, seen_s = time.time(), "", None
        while time.time() - t_kill < 3 * FENCED_WITHIN_S:
            after = browse(exe, url, budget_ms=1500)
            if node_states(after).get(victim) == "fenced":
                seen_s = time.time() - t_kill
                break
        shot = Path(os.environ.get("SKIPTRAIN_ARTIFACTS", ROOT / "runs" / "artifacts")) / "dashboard.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        browse(exe, url, f"--screenshot={shot}", "--window-size=1400,1250", budget_ms=2500)
        out, _ = launch.communicate(timeout=600)
        live_state = json.loads(urllib.request.urlopen(url + "state.json").read())
        yield {"run": run, "victim": victim, "before": before, "after": after, "seen_s": seen_s, "shot": shot,
               "launch_rc": launch.returncode, "launch_out": out, "url": url, "state": live_state}
    finally:
        for p in (launch, dash):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_the_dashboard_shows_the_swarm_the_kill_the_events_and_the_gantt(watched):
    before, after, victim = watched["before"], watched["after"], watched["victim"]
    assert node_states(before) == {0: "training", 1: "training", 2: "training", 3: "training"}, before[-2000:]
    assert svg_count(before, "gantt-measured", "events") > 0 and svg_count(before, "gantt-simulated", "events") > 0
    assert svg_count(before, "loss-tokens", "points") >= 10
    assert watched["seen_s"] is not None and watched["seen_s"] <= FENCED_WITHIN_S, (watched["seen_s"], after[-3000:])
    states = node_states(after)
    assert states[victim] == "fenced" and sorted(states) == [0, 1, 2, 3]
    assert re.search(rf'<g class="event" data-kind="failed" data-node="{victim}"', after)   # on the loss charts
    assert re.search(rf'<tr data-kind="failed" data-node="{victim}"', after)                # the membership table
    assert svg_count(after, "gantt-measured", "events") > 0
    assert watched["shot"].is_file() and watched["shot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"the killed node showed fenced {watched['seen_s']:.1f} s after the kill; screenshot {watched['shot']}")


def test_status_json_tells_the_same_states_and_events_as_the_dashboard(watched):
    run, victim = watched["run"], watched["victim"]
    assert watched["launch_rc"] == 0, watched["launch_out"][-3000:]
    r = subprocess.run([sys.executable, "-m", "skiptrain.cli", "status", str(run), "--json"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["status"] == "finished"
    assert {n["node"]: n["state"] for n in st["nodes"]} == {n: "fenced" if n == victim else "done" for n in range(4)}
    dash = watched["state"]
    assert [(n["node"], n["state"], n["stages"]) for n in st["nodes"]] == \
        [(n["node"], n["state"], n["stages"]) for n in dash["nodes"]]
    assert st["membership"] == dash["membership"]
    assert [(e["kind"], e["node"]) for e in st["membership"]] == [("failed", victim)]
    summary = json.loads((run / "run.json").read_text())
    assert summary["membership"] == st["membership"]
    assert "membership: 1 event(s)" in watched["launch_out"] and f"node {victim}: failed" in watched["launch_out"]
    text = subprocess.run([sys.executable, "-m", "skiptrain.cli", "status", str(run)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120).stdout
    assert "fenced" in text and "what each idea did" in text and len(text.splitlines()) <= 30


def test_tensorboard_event_files_open_in_tensorboards_reader_with_every_tag(watched):
    scalars, texts = tensorboard_tags(watched["run"] / TB_DIR)
    assert set(SCALAR_TAGS) <= scalars, set(SCALAR_TAGS) - scalars
    assert any(f"node {watched['victim']}: failed" in t for t in texts["membership/text_summary"])
