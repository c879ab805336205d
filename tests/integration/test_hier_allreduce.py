"""The hierarchical dense sum of the runtime (skiptrain/dp/transport.py) over real gloo processes:
six group members in three regions (plus one rank outside the group), built through the
runtime's emulation seam from a topology and the cost model: it equals the flat all-reduce to
float tolerance, every member ends with the same bits, and a member sending NaN is named.  Regions
of two members reduce-scatter and gather back; with a region of one (five members), the others
all-reduce twice."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("hier_sum_worker.py")


def _run(tmp_path, nan_rank, world):
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(tmp_path / "init"),
                               str(tmp_path / f"out{r}.json"), str(nan_rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(1, world)]


@pytest.mark.parametrize("world, regions, shards, owners", [
    # nodes 1..6 sit in regions r1, r2, r3, r1, r2, r3: group ranks {0, 3}, {1, 4}, {2, 5}
    (7, [[0, 3], [1, 4], [2, 5]], [[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
    # nodes 1..5: {0, 3}, {1, 4}, {2}; k = 1, so the regions of two all-reduce (no owners)
    (6, [[0, 3], [1, 4], [2]], [[0, 1, 2]], [[], [], []]),
])
def test_hierarchical_sum_equals_flat_and_names_a_nan_sender(tmp_path, world, regions, shards, owners):
    res = _run(tmp_path, nan_rank=5, world=world)
    assert all(sorted(map(sorted, r["regions"])) == regions for r in res)
    assert all(sorted(map(sorted, r["shards"])) == shards for r in res)
    assert all(sorted(map(sorted, r["owners"])) == owners for r in res)
    assert all(r["hierarchical_picked"] for r in res)
    for r in res:
        assert r["max_diff"] <= 1e-5 * max(1.0, r["max_abs"])
    assert len({r["hier_sha"] for r in res}) == 1
    # global rank 5 sent NaN: every member is told, by global rank
    assert all(r["nan_ranks"] == [5] for r in res)
