"""Multi-host bench: one run across emulated hosts (a network namespace, PID and UTS namespace per
host, on one bridge), started with the commands a user types, with the faults a real network has.

Set-up: a coordinator (``skiptrain coordinator --bind``) on host 0 and one ``skiptrain node`` per
host 1..N (N = 6; each with its own work directory: no file system is shared; each host's
uplink shaped to 100 Mbit/s with ``tc`` HTB), the ``tiny``
preset on a byte-level data set of the test excerpts, the planner's schedule, leases of 5 s
(``--heartbeat-deadline 5``), renewals every 0.25 s.  Host 1 runs with its wall
clock 60 s ahead for the whole run (``time.time`` shifted in its Python processes:
libfaketime cannot skew a Python 3.11 process here, see :mod:`skiptrain.runtime.host_swarm`).

Per seed, two runs of the same job: one without events (the reference loss), one with, in order,
each after the swarm is back at full strength:

1. the N hosts are started in random order within 10 s;
2. ``kill -9`` of a node process;
3. a 2 s link blip;
4. a 20 s partition of one host;
5. ``SIGSTOP`` of a node process for 20 s;
6. a fresh host (N + 1) starts ``skiptrain node`` mid-run;
7. ``kill -9`` of the coordinator's process alone (its host, and the run's store process, live
   on): the nodes train on, and 6 s later a new ``skiptrain coordinator --resume`` on the same
   address takes the live run over;
8. ``kill -9`` of the coordinator's host (every process there, the store too), and once every
   node has stopped (its lease ran out: 6 s), a new ``skiptrain coordinator --resume`` on the same
   address, which takes the run over from its newest checkpoint (committed in its run directory:
   every node sends its part).

Events 2-5 hit a different host each, whose node holds a stage with other replicas where there
is one, so the stage lives on and the host comes back as a new node that takes its state from a
live replica; a stage that loses its only node restarts from the job's checkpoint when it is
young enough, else by CheckFree, which costs loss this bench does not measure.

Per event: ``self_stop_s`` (the fault to the moment the node stopped its own work because its
lease ran out, from its error report; for a stopped process that is when it resumes),
``detect_s`` (the fault to the coordinator's decision, from ``recoveries.jsonl``),
``resume_s`` (the fault to the first iteration the survivors finish in the new generation),
``back_s`` (the fault to the first iteration with the host back, as a new node; both timed on
this bench's clock when the row appears in the coordinator's ``metrics.jsonl``, since a row's
own time is its rank 0's clock, which may be the skewed host's) and whether
anything was fenced that should not have been.  Over the run: ``false_fencings``,
``samples_lost`` and ``samples_repeated`` (the sample logs of every node, against the job's
order), ``final_loss_ratio`` (validation loss with events over without), and
``iteration_measured_over_simulated`` (median iteration of the run without events over the
simulator's).  For the coordinator's death, ``resume_s`` and ``back_s`` are from the kill to
the first iteration after the checkpoint, and at full strength, as this bench sees them (it
restarts the coordinator 6 s after the kill), and ``redone_iterations`` the iterations done after
the checkpoint, which are done again.  Median and maximum over the seeds.

    .venv/bin/python bench/multihost.py [--quick] [--json PATH] [--keep DIR]

``--quick``: one seed and 900 steps (same code path).  Each seed's figures are written to its
folder as soon as it is done.  The run directories stay in ``--keep``
(default ``runs/bench/multihost``), one new folder per bench run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from skiptrain.data.corpus import read_documents  # noqa: E402
from skiptrain.data.dataset import write_dataset  # noqa: E402
from skiptrain.runtime.host_swarm import HostSwarm  # noqa: E402
from skiptrain.runtime.netns import Hosts, children  # noqa: E402
from skiptrain.runtime.recovery import trained_samples  # noqa: E402

NODES = 6
RATE_MBIT = 100.0
#: Forward seconds per sample per layer of the cost model (the tiny preset on this machine's CPU).
S_PER_SAMPLE_LAYER = 3e-4
EVENTS = ("kill -9 of a node process", "2 s link blip", "20 s partition of a host", "SIGSTOP of a node for 20 s",
          "a fresh host joins", "kill -9 of the coordinator", "kill -9, coordinator process")
#: Seconds between the coordinator's death and its replacement: every node has stopped by then.
RESTART_AFTER_S = 6.0


def make_data(root: Path) -> Path:
    t = REPO / "tests" / "data"
    data = root / "data"
    if not (data / "manifest.json").is_file():
        write_dataset(data, read_documents([str(t / "hamlet_excerpt.txt"), str(t / "macbeth_excerpt.txt")]),
                      read_documents([str(t / "milton_excerpt.txt")]), tokenizer="byte", val_fraction=0.1,
                      source="test excerpts")
    return data


def coordinator_args(steps: int, seed: int) -> list[str]:
    # (a fixed cost model: profiled on this loaded 2-core machine it varied 300x between runs)
    return ["--nodes", str(NODES), "--steps", str(steps), "--heartbeat-deadline", "5",
            "--set", "runtime.heartbeat_s=0.25", "--set", "train.eval_batches=4", "--set", f"train.seed={seed}",
            "--set", f"runtime.s_per_sample_layer={S_PER_SAMPLE_LAYER}"]


def seen(swarm: HostSwarm, pred, timeout_s: float, what: str) -> float:
    """This bench's clock when a training row matching ``pred`` is first seen in the coordinator's
    ``metrics.jsonl`` (within its mirror's 0.25 s).  A row's own ``time`` is its rank 0's wall
    clock, which may be the skewed host's: it is never compared with this one."""
    swarm.wait(lambda: any(pred(r) for r in swarm.rows() if "loss" in r), timeout_s, what)
    return time.time()


def detection(swarm: HostSwarm, node: int):
    return next((e for e in swarm.events() if e.get("node") == node and not e.get("join")), None)


def fault_event(swarm: HostSwarm, kind: str, host: int, inject, heal, n: int) -> dict:
    """Inject a fault on ``host``'s current node, time its detection, the survivors' resumption
    and the host's return as a new node; ``heal`` (after 20 s) undoes a cut or a stop."""
    node = swarm.node_ids(host)[-1]
    before = len(swarm.node_ids(host))
    step0 = swarm.last_step()
    t = time.time()
    inject()
    row = swarm.wait(lambda: detection(swarm, node), 60, f"{kind}'s detection")
    resumed = seen(swarm, lambda r: r.get("gen", 0) >= row["gen"] and r["step"] > step0, 90, f"training after {kind}")
    if heal is not None:
        time.sleep(max(0.0, 20.0 - (time.time() - t)))
        heal()
    swarm.wait(lambda: len(swarm.node_ids(host)) > before, 120, f"host {host}'s new node")
    back = seen(swarm, lambda r: r.get("nodes") == n and r.get("gen", 0) > row["gen"], 180, f"full strength after {kind}")
    stopped = _self_stop(swarm, host, node)
    return {"kind": kind, "host": host, "node": node, "detect_s": round(row["t_detect"] - t, 3),
            "resume_s": round(resumed - t, 3), "back_s": round(back - t, 3), "cause": row["cause"],
            "self_stop_s": None if stopped is None else round(stopped - t, 3)}


def _self_stop(swarm: HostSwarm, host: int, node: int) -> float | None:
    """When node ``node`` stopped its own work because its lease ran out (its error report on
    its host, whose time is that host's clock: the skew this bench gave it is taken off), None
    if it did not."""
    for f in (swarm.root / "work" / f"h{host}").glob(f"*/node{node}/errors/node{node}.json"):
        report = json.loads(f.read_text())
        if "lease" in report.get("msg", ""):
            return float(report["time"]) - float(swarm.skewed.get(host, 0.0))
    return None


def blip(swarm: HostSwarm, hosts: Hosts, host: int) -> dict:
    """A 2 s cut of ``host``: nothing may be fenced."""
    seen = len(swarm.events())
    t = time.time()
    hosts.cut(host)
    time.sleep(2.0)
    hosts.restore(host)
    time.sleep(8.0)                       # longer than the lease: a fencing would show by now
    fenced = [e for e in swarm.events()[seen:] if not e.get("join")]
    return {"kind": EVENTS[1], "host": host, "detect_s": None, "resume_s": None, "back_s": None,
            "fenced": [e["node"] for e in fenced], "new_generation": bool(fenced), "t": t}


def join_event(swarm: HostSwarm, host: int, n: int) -> dict:
    step0 = swarm.last_step()
    t = time.time()
    swarm.start_node(host)
    back = seen(swarm, lambda r: r.get("nodes") == n + 1 and r["step"] > step0, 180, "the fresh host's first iteration")
    joined = next((e for e in swarm.events() if e.get("join") and e.get("node") in swarm.node_ids(host)), {})
    return {"kind": EVENTS[4], "host": host, "node": (swarm.node_ids(host) or [None])[-1], "detect_s": None,
            "resume_s": None, "back_s": round(back - t, 3), "transfer_s": joined.get("transfer_s")}


def scripted_events(swarm: HostSwarm, hosts: Hosts) -> list[dict]:
    """Events 2-6, each on a host whose node holds a replicated stage (so the stage lives on
    and the host's new node takes the state of a live replica), a different host each time."""
    used: set[int] = set()
    rows = []
    h = _take(swarm, used)
    rows.append(fault_event(swarm, EVENTS[0], h, lambda: swarm.signal_node(h, signal.SIGKILL), None, NODES))
    rows.append(blip(swarm, hosts, _take(swarm, used)))
    h2 = _take(swarm, used)
    rows.append(fault_event(swarm, EVENTS[2], h2, lambda: hosts.cut(h2), lambda: hosts.restore(h2), NODES))
    h3 = _take(swarm, used)
    rows.append(fault_event(swarm, EVENTS[3], h3, lambda: swarm.signal_node(h3, signal.SIGSTOP),
                            lambda: _cont(swarm, h3), NODES))
    rows.append(join_event(swarm, NODES + 1, NODES))
    rows.append(coordinator_process_event(swarm))
    rows.append(coordinator_event(swarm, NODES + 1))
    return rows


def coordinator_process_event(swarm: HostSwarm) -> dict:
    """The coordinator's process dies and its host lives: the nodes train on (``trained_alone``
    iterations in their own run directories), and a new coordinator started with ``--resume``
    ``RESTART_AFTER_S`` later takes the live run over.  ``resume_s``: the longest gap between two
    iterations across the absence (rank 0's own clock: one host, so its skew cancels);
    ``back_s``: the kill to the first row the new coordinator mirrors."""
    t = time.time()
    swarm.kill_coordinator_process()
    local0 = swarm.local_last_step()
    time.sleep(RESTART_AFTER_S)
    alone = swarm.local_last_step()
    swarm.start_coordinator("--resume", host_lives=True)
    back = seen(swarm, lambda r: r["step"] > alone, 120, "the first row mirrored by the new coordinator")
    rows = sorted({r["step"]: r for r in swarm.rows() if "loss" in r and local0 - 1 <= r["step"] <= alone + 1}.values(),
                  key=lambda r: r["step"])
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
    return {"kind": EVENTS[6], "host": 0, "detect_s": None, "resume_s": round(max(gaps, default=0.0), 3),
            "back_s": round(back - t, 3), "trained_alone": alone - local0, "redone_iterations": 0}


def coordinator_event(swarm: HostSwarm, n: int) -> dict:
    """The coordinator's host dies; a new coordinator takes the run over with ``--resume``."""
    swarm.wait(lambda: swarm.committed_step() > 0, 180, "a committed checkpoint")
    step, ckpt = swarm.last_step(), swarm.committed_step()
    t = time.time()
    swarm.kill_coordinator()
    time.sleep(RESTART_AFTER_S)
    swarm.start_coordinator("--resume")
    swarm.wait(lambda: swarm.last_step() <= ckpt, 60, "the resumed run's metrics")
    swarm.wait(lambda: swarm.last_step() > ckpt, 180, "the first iteration after the checkpoint")
    resumed = time.time()
    swarm.wait(lambda: any(r.get("nodes") == n and r["step"] > ckpt for r in swarm.rows() if "loss" in r), 180,
               "full strength after the coordinator's death")
    return {"kind": EVENTS[5], "host": 0, "detect_s": None, "resume_s": round(resumed - t, 3),
            "back_s": round(time.time() - t, 3), "redone_iterations": step - ckpt, "checkpoint": ckpt}


def _take(swarm: HostSwarm, used: set[int]) -> int:
    """A host not used yet, one whose stage has other replicas when there is one."""
    try:
        host = swarm.replicated_host(used)
    except RuntimeError:
        host = min(set(swarm.agents) - used)
    used.add(host)
    return host


def run_once(root: Path, data: Path, steps: int, seed: int, events: bool) -> dict:
    """One run (with or without the events) under ``root``; its figures."""
    skew = {1: 60.0} if events else {}
    rng = random.Random(seed)
    with Hosts(NODES + 2) as hosts:
        for i in range(1, NODES + 2):
            hosts.shape(i, RATE_MBIT)             # every node host's uplink
        swarm = HostSwarm(hosts, root, str(data), coordinator_args(steps, seed), skewed=skew)
        swarm.start_coordinator(host_lives=True)
        swarm.wait_secret()
        order = list(range(1, NODES + 1))
        rng.shuffle(order)
        t0 = time.time()
        for i in order:
            time.sleep(rng.uniform(0, 10.0 / NODES) if events else 0.0)
            swarm.start_node(i)
        first = seen(swarm, lambda r: r.get("nodes") == NODES, 180, "every host in the first generation")
        rows = [{"kind": "hosts started in any order", "detect_s": None, "resume_s": None,
                 "back_s": round(first - t0, 3), "order": order}] if events else []
        if events:
            rows += scripted_events(swarm, hosts)
            if swarm.last_step() >= steps:
                raise SystemExit(f"the run ended before the events did: give more --steps than {steps}")
        rc = swarm.finish(timeout_s=3600)
        if rc != 0:
            raise SystemExit(f"the coordinator failed ({rc}): {swarm.log('coordinator')[-3000:]}")
        addresses = [line.split("advertising ")[1].split()[0] for i in range(1, NODES + 2)
                     for line in swarm.log(f"node_h{i}").splitlines() if "advertising " in line]
    return {"rows": rows, "summary": json.loads((root / "run" / "run.json").read_text()),
            "events": swarm.events(), "addresses": addresses, "skewed": skew,
            "samples": trained_samples(root / "run" / "phases" / "train"), "steps": steps}


def _cont(swarm: HostSwarm, host: int) -> None:
    """SIGCONT to the node process stopped on ``host`` (it finds its lease gone and stops)."""
    agent = swarm.agents[host].program_pid(timeout=5)
    for pid in children(agent) if agent else []:
        os.kill(pid, signal.SIGCONT)


def figures(base: dict, ev: dict, gb: int) -> dict:
    faulted = {r.get("node") for r in ev["rows"] if r.get("node") is not None}
    fenced = [e for e in ev["events"] if not e.get("join") and not e.get("restart") and e.get("node") not in faulted]
    samples = [i for s in ev["samples"].values() for i in s]
    want = set(range(ev["steps"] * gb))
    return {"events": ev["rows"], "false_fencings": len(fenced) + sum(len(r.get("fenced", [])) for r in ev["rows"]),
            "samples_lost": len(want - set(samples)), "samples_repeated": len(samples) - len(set(samples)),
            "final_loss_ratio": ev["summary"]["val_loss"] / base["summary"]["val_loss"],
            "iteration_measured_over_simulated": base["summary"]["median_iteration_s"]
            / base["summary"]["simulated_iteration_s"],
            "loopback_addresses": [a for a in ev["addresses"] if a.startswith("127.")],
            "clock_skew": ev["skewed"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, fewer steps")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", type=Path, default=REPO / "runs" / "bench" / "multihost", help="the runs go here")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--first-seed", type=int, default=1234, help="seeds run from this one on")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    ok, why = Hosts.available()
    if not ok:
        raise SystemExit(f"bench/multihost.py needs network namespaces: {why}")
    seeds = args.seeds or (1 if args.quick else 5)
    steps = args.steps or (900 if args.quick else 1500)
    data = make_data(args.keep)
    keep = args.keep / time.strftime("%Y%m%d-%H%M%S")       # (a new folder per bench run: nothing is replaced)
    per_seed = []
    for k in range(seeds):
        seed = args.first_seed + k
        base = run_once(keep / f"seed{seed}" / "no_events", data, steps, seed, events=False)
        ev = run_once(keep / f"seed{seed}" / "events", data, steps, seed, events=True)
        per_seed.append(figures(base, ev, _global_batch(keep / f"seed{seed}" / "events")))
        (keep / f"seed{seed}" / "figures.json").write_text(json.dumps(per_seed[-1], indent=1))   # (as it goes)
        print(f"seed {seed}: done ({keep / f'seed{seed}' / 'figures.json'})", flush=True)
    out = summarize(per_seed)
    out.update(quick=args.quick, seeds=seeds, steps=steps, nodes=NODES, runs=str(keep), per_seed=per_seed)
    print_table(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def _global_batch(root: Path) -> int:
    job = json.loads((root / "run" / "job.json").read_text())
    sched = job["phases"][0]["schedule"]
    return len(sched["micro_batches"]) * int(job["config"]["train"]["micro_batch"])


def summarize(per_seed: list[dict]) -> dict:
    def stat(values):
        values = [v for v in values if v is not None]
        return {"median": statistics.median(values), "max": max(values)} if values else None

    kinds = [r["kind"] for r in per_seed[0]["events"]]
    events = []
    for kind in kinds:
        rs = [r for s in per_seed for r in s["events"] if r["kind"] == kind]
        events.append({"kind": kind, **{k: stat([r.get(k) for r in rs])
                                        for k in ("detect_s", "resume_s", "back_s", "self_stop_s", "redone_iterations",
                                                  "trained_alone")},
                       "fenced": sorted({n for r in rs for n in r.get("fenced", [])})})
    out = {"events": events}
    for key in ("false_fencings", "samples_lost", "samples_repeated", "final_loss_ratio",
                "iteration_measured_over_simulated"):
        out[key] = stat([s[key] for s in per_seed])
    out["loopback_addresses"] = sorted({a for s in per_seed for a in s["loopback_addresses"]})
    return out


def print_table(out: dict) -> None:
    def fmt(st):
        return "-" if st is None else f"{st['median']:.2f} / {st['max']:.2f}"

    print(f"\n{'event':30s} {'stopped itself s':>17s} {'detect s':>13s} {'training again s':>17s} "
          f"{'back as new node s':>19s}")
    for e in out["events"]:
        print(f"{e['kind'][:30]:30s} {fmt(e['self_stop_s']):>17s} {fmt(e['detect_s']):>13s} {fmt(e['resume_s']):>17s} "
              f"{fmt(e['back_s']):>19s}"
              + (f"  fenced {e['fenced']}" if e["fenced"] else ""))
    print("(median / max over seeds)")
    for e in out["events"]:
        if e.get("redone_iterations"):
            print(f"{e['kind']}: iterations done again after the resume {fmt(e['redone_iterations'])}")
        if e.get("trained_alone"):
            print(f"{e['kind']}: iterations trained without a coordinator {fmt(e['trained_alone'])}")
    for key in ("false_fencings", "samples_lost", "samples_repeated", "final_loss_ratio",
                "iteration_measured_over_simulated"):
        print(f"{key:36s} {fmt(out[key])}")
    print(f"{'loopback addresses advertised':36s} {out['loopback_addresses'] or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
