"""skiptrain.runtime: one runtime for every way of training.

One module per job:

* :mod:`.step` -- THE optimizer step: per-stage sync, one global clip, one optimizer step;
* :mod:`.executor` -- run one node's share of a :class:`~skiptrain.schedule.schedule.Schedule`:
  task queues, memory credits, backward first (the one-process trainer runs on it too);
* :mod:`.node` -- the node process (``python -m skiptrain.runtime.node``; torchrun-compatible), a
  loop over components (control plane, layout, healer, re-planner, stats);
* :mod:`.preflight` -- checks a launcher makes before any node starts (devices, memory);
* :mod:`.transport` -- tagged point-to-point activations/gradients over gloo (header + payload,
  per-link codecs), and the in-process transport between stages of one process;
* :mod:`.emulation` -- the one seam for emulated links and compute, and the node's measurements;
* :mod:`.wan` -- per-directed-link FIFO emulation of a topology, compute padding;
* :mod:`.evaluate` -- validation loss;
* :mod:`.launcher`, :mod:`.monitor`, :mod:`.outputs` -- start N local node processes, watch them,
  stop all on a failure; merge what they leave;
* :mod:`.swarm_view`, :mod:`.live` -- what a running swarm shows in its run directory for the
  dashboard (``swarm.json`` from the watcher, ``live_node<r>.json`` from each node);
* :mod:`.faults` -- the fault-injecting wrapper of the node (tests and benchmarks); :mod:`.netns` --
  emulated hosts (network namespaces on a bridge) for multi-host tests and benchmarks;
* :mod:`.coordinator`, :mod:`.recovery`, :mod:`.join`, :mod:`.joiners`, :mod:`.join_placement`,
  :mod:`.fencing`, :mod:`.event_log`, :mod:`.membership`, :mod:`.store`, :mod:`.drift` -- recovery
  mode: membership, re-planning, admission and placement of joiners, fencing, signed writes;
* :mod:`.freezing`, :mod:`.freeze_cache`, :mod:`.prefill`, :mod:`.transition` -- elastic freezing
  in the swarm;
* :mod:`.failure` -- heartbeats, error reports, exit codes;
* :mod:`.job` -- the JSON job (phases: schedule, cost model, emulation, config) and how to build one.
"""
