"""skiptrain.runtime: the multi-process skip-pipeline runtime (issue 4).

One module per job:

* :mod:`.launcher` -- start N local node processes, watch them, stop all on any failure;
* :mod:`.node` -- the node process (``python -m skiptrain.runtime.node``; torchrun-compatible);
* :mod:`.executor` -- run one node's share of a :class:`~skiptrain.schedule.schedule.Schedule`:
  task queues, memory credits, backward first;
* :mod:`.transport` -- tagged point-to-point activations/gradients over gloo, header + payload;
* :mod:`.wan` -- per-directed-link FIFO emulation of a topology, compute padding;
* :mod:`.failure` -- heartbeats, error reports, exit codes, hooks for fault tolerance;
* :mod:`.job` -- the JSON job (phases: schedule, cost model, emulation) and how to build one;
* :mod:`.cli` -- ``skiptrain launch`` and ``skiptrain train --nodes N``.
"""
