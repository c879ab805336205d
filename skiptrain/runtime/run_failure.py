"""What the launcher says when a run fails: the node at fault, why, when it was detected, and
every node's one-line report (``errors/node<r>.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..schedule.schedule import Schedule
from .failure import EXIT_FENCED, RuntimeFailure, describe_exit
from .job import Job


def describe_node(job: Job, node: int) -> str:
    stages = []
    for ph in job.phases:
        s = Schedule.from_dict(ph.schedule).stages_of().get(node)
        stages.append("-" if s is None else "+".join(map(str, s)))
    if len(set(stages)) == 1:
        return f"node {node}" + ("" if stages[0] == "-" else f" (stage {stages[0]})")
    return f"node {node} (stages {'/'.join(stages)} in phases {'/'.join(p.name for p in job.phases)})"


def explain_failure(job: Job, procs, failure: dict, run_dir: Path, store, killed_by_us: set[int]) -> RuntimeFailure:
    """The launch's error for ``failure`` (see the module doc)."""
    reports = {}
    for f in sorted((run_dir / "errors").glob("node*.json")):
        try:
            d = json.loads(f.read_text())
            reports[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue
    fault_t = None
    for r in range(len(procs)):
        try:
            if store.check([f"fault/{r}"]):
                fault_t = float(store.get(f"fault/{r}").decode())
        except Exception:  # noqa: BLE001
            pass
    detected = failure["t"] - fault_t if fault_t is not None else None
    signalled = [r for r, p in enumerate(procs)
                 if p.returncode is not None and p.returncode < 0 and r not in killed_by_us]
    if failure["kind"] == "store":
        return RuntimeFailure(f"the run's store process died ({describe_exit(failure['code'])}): every node lost "
                              "the run's membership and stopped; resume the run from its last checkpoint with "
                              f"`skiptrain launch --resume --out {run_dir}` (logs: {run_dir / 'logs'})", node=None)
    if procs and all(p.returncode == EXIT_FENCED for p in procs):
        return RuntimeFailure("every node stopped its own work: none could renew its lease, so the run's store "
                              f"did not answer (its process, logs/store.log, was stopped or starved longer than a "
                              f"lease); resume the run from its last checkpoint with `skiptrain launch --resume "
                              f"--out {run_dir}`", node=None)
    if failure["kind"] == "timeout":
        node, head = None, "the run did not finish within its time limit"
    elif failure["kind"] == "hung":
        node = failure["node"]
        head = (f"{describe_node(job, node)} stopped responding: no heartbeat for {failure['age']:.1f} s "
                f"(timeout {job.rt.timeout_s:g} s); stopped all nodes")
    elif signalled:
        node = signalled[0]
        head = f"{describe_node(job, node)} died ({describe_exit(procs[node].returncode)}); stopped all nodes"
    else:
        self_blamed = [r for r, d in reports.items() if d.get("node") == r]
        blamed = [d["node"] for d in reports.values() if d.get("node") is not None and d["node"] >= 0]
        node = self_blamed[0] if self_blamed else (blamed[0] if blamed else failure.get("node"))
        d = reports.get(node) or (reports.get(failure.get("node")) if failure.get("node") is not None else None)
        code = procs[node].returncode if node is not None and node < len(procs) else failure.get("code")
        why = f"{d['type']}: {d['msg']}" if d else describe_exit(code)
        head = f"{describe_node(job, node) if node is not None else 'a node'} failed: {why}"
    lines = [head]
    for r, d in sorted(reports.items()):
        lines.append(f"  node {r}: {d['type']}: {d['msg'][:300]}")
    if detected is not None:
        lines.append(f"  (detected {detected:.1f} s after the fault)")
    lines.append(f"  logs: {run_dir / 'logs'}")
    return RuntimeFailure("\n".join(lines), node=node, detected_after_s=detected)
