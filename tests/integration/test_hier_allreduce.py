"""The hierarchical dense sum of the runtime (skiptrain/dp/transport.py) over real gloo processes:
six group members in three regions (plus one rank outside the group), built through the
runtime's emulation seam from a topology and the cost model: it equals the flat all-reduce to
float tolerance, every member ends with the same bits (a -0.0 included), a sum of fewer values
than pieces is right, and a member sending NaN is named.  Regions of two members reduce-scatter and
gather back, also to one member where a region of one makes k = 1; with regions of 2, 3 and 5
(k = 2) the first two scatter and gather, the third all-reduces twice."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("hier_sum_worker.py")


def _run(tmp_path, nan_rank, world, regions):
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(tmp_path / "init"),
                               str(tmp_path / f"out{r}.json"), str(nan_rank), *regions],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(1, world)]


@pytest.mark.parametrize("world, sizes, regions, shards, owners", [
    # nodes 1..6 sit in regions r1, r2, r3, r1, r2, r3: group ranks {0, 3}, {1, 4}, {2, 5}
    (7, [], [[0, 3], [1, 4], [2, 5]], [[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
    # nodes 1..5: {0, 3}, {1, 4}, {2}; k = 1: the regions of two (= 2k) reduce to one member,
    # the region of one has no ring
    (6, [], [[0, 3], [1, 4], [2]], [[0, 1, 2]], [[0], [1], []]),
    # nodes 1..10 in regions of 2, 3, 5: k = 2; the region of 5 (> 2k) all-reduces, and three of
    # its members and one of the region of 3 sit in no shard ring
    (11, ["2,3,5"], [[0, 1], [2, 3, 4], [5, 6, 7, 8, 9]], [[0, 2, 5], [1, 3, 6]], [[0, 1], [2, 3], []]),
])
def test_hierarchical_sum_equals_flat_and_names_a_nan_sender(tmp_path, world, sizes, regions, shards, owners):
    res = _run(tmp_path, nan_rank=5, world=world, regions=sizes)
    for r in res:
        got = sorted(zip(r["regions"], r["owners"]), key=lambda ro: sorted(ro[0]))
        assert [sorted(g) for g, _ in got] == regions and [list(o) for _, o in got] == owners
        assert sorted(map(sorted, r["shards"])) == shards
        # the owner of piece j in every region is that region's member of shard ring j
        assert all(o in r["shards"][j] for _, own in got for j, o in enumerate(own))
    assert all(r["hierarchical_picked"] for r in res)
    for r in res:
        assert r["max_diff"] <= 1e-5 * max(1.0, r["max_abs"])
        assert r["tiny_ok"]
    assert len({r["hier_sha"] for r in res}) == 1
    # global rank 5 sent NaN: every member is told, by global rank
    assert all(r["nan_ranks"] == [5] for r in res)
