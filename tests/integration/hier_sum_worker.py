"""Child process for tests/integration/test_hier_allreduce.py: one rank of a gloo world.

``python hier_sum_worker.py RANK WORLD INIT_FILE OUT_JSON NAN_RANK [REGIONS]``: joins the world
over the file store, makes the stage group of ranks 1..WORLD-1 (rank 0 stays outside it, so group
ranks are not global ranks), builds the hierarchical links of that group over a topology of
regions (the group's nodes dealt round-robin to three regions, or REGIONS: comma-separated sizes,
filled one after the other) through the runtime's own seam
(:meth:`skiptrain.runtime.emulation.Emulation.sync_link`), sums a seeded tensor (its first value
-0.0 on every member) flat and hierarchically with :class:`skiptrain.dp.transport.Transport`, and
tensors of 1 and 3 values (pieces left empty), then sums once more with rank NAN_RANK (-1: none)
sending a NaN, and writes what it saw.
"""

import hashlib
import json
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from skiptrain.dp.link import HierarchicalLinks
from skiptrain.dp.transport import NonFiniteContribution, Transport
from skiptrain.net.topology import Node, Topology
from skiptrain.runtime.emulation import Emulation
from skiptrain.runtime.job import EmulationSpec
from skiptrain.schedule.cost import CostModel


def topology(world: int, regions: list[int] | None) -> Topology:
    """Node 0 alone, then the group's nodes in three regions round-robin, or in regions of the
    given sizes (1 ms inside, 50 ms between)."""
    loc = [0] + ([1 + (i % 3) for i in range(world - 1)] if regions is None
                 else [1 + r for r, n in enumerate(regions) for _ in range(n)])
    same = np.array([[loc[a] == loc[b] for b in range(world)] for a in range(world)])
    return Topology([Node(i, f"r{loc[i]}") for i in range(world)], np.where(same, 0.001, 0.05),
                    np.where(same, 1e9, 1e8))


class Phase:
    emulation = EmulationSpec(sync=True)


def main(rank: int, world: int, init: str, out: str, nan_rank: int, regions: list[int] | None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(1, world)))
    result = {"rank": rank}
    if rank > 0:
        topo = topology(world, regions)
        cost = CostModel(dp_topology="hierarchical")
        link = Emulation(Phase, topo, cost, rank).sync_link(list(range(1, world)))
        result["regions"] = [list(r) for r in link.regions] if isinstance(link, HierarchicalLinks) else None
        result["shards"] = [list(r) for r in link.shards] if isinstance(link, HierarchicalLinks) else None
        result["owners"] = [list(r) for r in link.owners] if isinstance(link, HierarchicalLinks) else None
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(10_007, generator=g)
        x[0] = -0.0
        flat = Transport(group).all_reduce_sum(x.clone())
        hier_tr = Transport(group, link)
        result["hierarchical_picked"] = link.hierarchical(x.numel() * 4, hier_tr.world)
        hier = hier_tr.all_reduce_sum(x.clone())
        result["max_diff"] = float((flat - hier).abs().max())
        result["max_abs"] = float(flat.abs().max())
        result["hier_sha"] = hashlib.sha256(hier.numpy().tobytes()).hexdigest()
        tiny = [torch.arange(1.0, n + 1) * rank for n in (1, 3)]
        result["tiny_ok"] = all(bool(torch.equal(hier_tr.all_reduce_sum(t.clone()), Transport(group).all_reduce_sum(t.clone())))
                                for t in tiny)
        bad = x.clone()
        if rank == nan_rank:
            bad[17] = float("nan")
        try:
            hier_tr.all_reduce_sum(bad)
            result["nan_ranks"] = None
        except NonFiniteContribution as e:
            result["nan_ranks"] = e.ranks
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]),
         [int(n) for n in sys.argv[6].split(",")] if len(sys.argv) > 6 else None)
