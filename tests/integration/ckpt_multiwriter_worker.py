"""One writer process of tests/integration/test_checkpoint.py::test_separate_writer_processes.

Usage: python ckpt_multiwriter_worker.py ROOT RANK N_STAGES REPLICAS.  Every process computes the
same plan from the global specs and placement (no communication), writes only its assigned
shards, and the lowest rank commits once all parts are on disk (file-system barrier).  Tensor
values are a pure function of the name, so the test can check every byte.
"""

import sys
import zlib

import numpy as np

from skiptrain.checkpoint.plan import TensorSpec, plan_save
from skiptrain.checkpoint.writer import commit, write_part


def tensors(n_stages: int) -> dict[str, np.ndarray]:
    out = {}
    for s in range(n_stages):
        for name, shape in ((f"layers.{s}.w", (300 + 7 * s, 64)), (f"layers.{s}.b", (64,)),
                            (f"optim.exp_avg.layers.{s}.w", (300 + 7 * s, 64))):
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def stage_of(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])


def main() -> None:
    root, rank, n_stages, replicas = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    data = tensors(n_stages)
    ranks = list(range(n_stages * replicas))
    holders = {n: [stage_of(n) * replicas + j for j in range(replicas)] for n in data}
    specs = [TensorSpec(n, "float32", a.shape) for n, a in data.items()]
    plan = plan_save(specs, holders, chunk_bytes=16 << 10, ranks=ranks)
    mine = {n: data[n] for n in plan.names_for(rank)}  # a node only holds its own stage anyway
    assert all(rank in holders[n] for n in mine)
    write_part(root, 7, rank, plan, mine, {"pid_rank": rank})
    if rank == ranks[0]:
        commit(root, 7, ranks, plan, {"step": 7}, {"n_stages": n_stages, "replicas": replicas}, timeout=60)


if __name__ == "__main__":
    main()
