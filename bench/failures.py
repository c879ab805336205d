"""Failure bench (issue 8): time to detect, time to recover and iterations lost, per fault kind.

An 8-node swarm (stages 3/2/2/1, tiny model, 6 micro-batches per iteration, recovery on) runs a
few iterations while one fault is injected at iteration 1 (full run: one launch per fault, plus a
launch without a fault for the normal iteration time; ``--quick``: one launch with all four
faults at iterations 1-4).  Reported per fault:

* **detect**: coordinator's detection time after the fault (fault time written by the victim);
* **recover**: per survivor, from the moment it saw the failure to the moment it had re-formed
  its groups, re-planned and settled the iteration (median and max over survivors);
* **lost**: iteration attempts abandoned (the whole iteration is re-run on the same samples)
  and samples lost or repeated over the whole run (must be 0);
* the normal iteration time of the same swarm, to compare.

    .venv/bin/python bench/failures.py [--quick] [--json runs/bench/failures.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workdir import work_dir  # noqa: E402

from skiptrain.config import build_config  # noqa: E402
from skiptrain.data.corpus import read_documents  # noqa: E402
from skiptrain.data.dataset import write_dataset  # noqa: E402
from skiptrain.runtime.faults import faulty_job  # noqa: E402
from skiptrain.runtime.job import Job, Phase, with_runtime  # noqa: E402
from skiptrain.runtime.launcher import launch  # noqa: E402
from skiptrain.runtime.recovery import trained_samples  # noqa: E402
from skiptrain.schedule.schedule import MicroBatch, Schedule  # noqa: E402

PLACEMENT = [[0, 1, 2], [3, 4], [5, 6], [7]]
FAULTS = {
    "kill body (sole replica of stage 3, mid-iteration)": {"node": 7, "kind": "kill", "delay_s": 0.3},
    "kill stage-0 originator": {"node": 1, "kind": "kill"},
    "hang (SIGSTOP) stage 1": {"node": 4, "kind": "hang"},
    "bad peer (NaN activations) stage 2": {"node": 6, "kind": "nan"},
}


def schedule() -> Schedule:
    mbs, k = [], 0
    for _ in range(2):
        for o in PLACEMENT[0]:
            mbs.append(MicroBatch(k, o, [(1, PLACEMENT[1][k % 2]), (2, PLACEMENT[2][(k + 1) % 2]), (3, 7)]))
            k += 1
    return Schedule(placement=[list(p) for p in PLACEMENT], micro_batches=mbs, memory=2, method="bench")


def run(data: Path, out: Path, faults, iterations: int, deadline_s: float) -> dict:
    cfg = build_config("tiny", overrides={"train": {"grad_clip": 0.0, "steps": 20, "warmup_steps": 1}})
    job = Job(config=with_runtime(cfg.to_dict(), timeout_s=15.0, heartbeat_s=0.2, heartbeat_deadline_s=deadline_s, recover=True),
              data_path=str(data), run_dir=str(out),
              phases=[Phase("p", schedule().to_dict(), iterations=iterations)],
              **faulty_job(faults) if faults else {})
    t = time.time()
    res = launch(job, timeout_s=300)
    wall = time.time() - t
    rec = [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()] \
        if (out / "recoveries.jsonl").exists() else []
    node_rec: dict[int, list[dict]] = {}
    for f in (out / "phases" / "p").glob("node*.json"):
        for r in json.loads(f.read_text())["recoveries"]:
            node_rec.setdefault(r["gen"], []).append(r)
    trained = [i for s in trained_samples(out / "phases" / "p").values() for i in s]
    gb = 6 * cfg.train.micro_batch
    lost = len(set(range(iterations * gb)) - set(trained))
    repeated = len(trained) - len(set(trained))
    rows = []
    for r in rec:
        survivors = node_rec.get(r["gen"], [])
        rs = [x["recover_s"] for x in survivors]
        rows.append({"node": r["node"], "cause": r["cause"][:90], "detect_s": r["detect_s"],
                     "recover_median_s": statistics.median(rs) if rs else None,
                     "recover_max_s": max(rs) if rs else None,
                     "attempts_abandoned": int(any(not x["committed"] for x in survivors)),
                     "gen": r["gen"]})
    done = res.phase_iterations("p")
    return {"wall_s": wall, "faults": rows, "iteration_s": [m["iteration_s"] for m in done], "samples_lost": lost,
            "samples_repeated": repeated, "losses": [m["loss"] for m in done]}


def run_all(args, root: Path) -> tuple[dict, dict]:
    """The launches (one with every fault when quick, else one per fault and one without) under
    ``root``; their results and each faulty node's label."""
    T = Path(__file__).resolve().parents[1] / "tests" / "data"
    data = root / "data"
    write_dataset(data, read_documents([str(T / "hamlet_excerpt.txt"), str(T / "macbeth_excerpt.txt")]),
                  read_documents([str(T / "milton_excerpt.txt")]), tokenizer="byte", val_fraction=0.1,
                  source="test excerpts")
    results: dict = {"quick": args.quick, "deadline_s": args.deadline, "runs": {}}
    if args.quick:
        faults = [dict(f, iteration=i + 1) for i, f in enumerate(FAULTS.values())]
        results["runs"]["all four"] = run(data, root / "all", faults, 6, args.deadline)
        labels = dict(zip([f["node"] for f in faults], FAULTS))
    else:
        results["runs"]["no fault"] = run(data, root / "base", [], 4, args.deadline)
        labels = {}
        for i, (name, f) in enumerate(FAULTS.items()):
            results["runs"][name] = run(data, root / f"f{i}", [dict(f, iteration=1)], 4, args.deadline)
            labels[f["node"]] = name
    return results, labels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one launch with all four faults")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--deadline", type=float, default=2.0, help="heartbeat deadline (s) for hung peers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with work_dir(None, "failures") as tmp:
        results, labels = run_all(args, Path(tmp))
    print(f"{'fault':52s} {'detect s':>9s} {'recover s (med/max)':>20s} {'attempts lost':>13s} "
          f"{'samples lost/rep':>16s}")
    normal = []
    for name, r in results["runs"].items():
        normal += r["iteration_s"][:1]
        for row in r["faults"]:
            d = "-" if row["detect_s"] is None else f"{row['detect_s']:.3f}"
            rec = "-" if row["recover_median_s"] is None else \
                f"{row['recover_median_s']:.2f}/{row['recover_max_s']:.2f}"
            print(f"{labels.get(row['node'], name)[:52]:52s} {d:>9s} {rec:>20s} {row['attempts_abandoned']:>13d} "
                  f"{r['samples_lost']:>7d}/{r['samples_repeated']:<8d}")
    base = results["runs"].get("no fault")
    if base:
        print(f"normal iteration (no fault, 8 nodes): median {statistics.median(base['iteration_s']):.3f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
