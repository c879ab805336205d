"""The node process: ``python -m skiptrain.runtime.node --job JOB.json``.

Joins the run through the standard torch.distributed environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), so the same entry point serves the local launcher
(:mod:`skiptrain.runtime.launcher`, which hosts the rendezvous store itself and sets
``SKIPTRAIN_STORE_HOSTED=1``) and ``torchrun`` on one or several hosts (rank 0, or torchrun's
agent when ``TORCHELASTIC_USE_AGENT_STORE=True``, hosts the store).  Rank ``r`` is node ``r`` of
every schedule.

Device and precision: each node computes on one device (:meth:`Node.pick_device`: its entry of
``runtime.devices``, else ``train.device`` with ``cuda`` meaning ``cuda:LOCAL_RANK`` modulo the
GPUs it sees, so several nodes may share one GPU) and under ``train.precision`` (bf16 autocast
around every forward and backward, fp32 weights, gradients and optimizer state); its messages
cross gloo through pinned host buffers (:mod:`skiptrain.runtime.transport`).

Per phase of the job (:mod:`skiptrain.runtime.job`): build only this node's stage on its device
(:func:`~skiptrain.model.device.build_on_device`: memory estimate printed, refusal of a stage
that cannot fit, meta build, materialisation; ``train.init_from`` loads the stage's tensors
only), a process group per stage for
the data-parallel sync (strategy from ``cfg.dp`` via :func:`skiptrain.dp.strategy.make_strategy`;
gloo, or NCCL with ``dp.backend=nccl``),
then per iteration: a common start time, the executor (:mod:`skiptrain.runtime.executor`), one sync + optimizer
step weighted by the micro-batches this node processed, and the timeline.  Rank 0 appends the
iteration's loss and measured time to ``RUN_DIR/metrics.jsonl``.

Outputs under ``RUN_DIR``: ``phases/<name>/node<r>.json`` (timeline events per iteration,
stats), ``parts/stage<s>.safetensors`` (``save_weights``), ``phases/<name>/dump/node<r>.pt``
(``dump``: parameters and pre-sync summed gradients), ``errors/node<r>.json`` on failure.

Failure semantics: any error, or a peer failure seen by the heartbeat, writes
``errors/node<r>.json`` naming the node at fault and exits the process at once (``os._exit``)
with :data:`~skiptrain.runtime.failure.EXIT_FAILED` / :data:`~skiptrain.runtime.failure.EXIT_PEER_FAILED`; gloo waits are bounded
by ``job.rt.timeout_s``.  The launcher (or torchrun) then stops the other processes.

The node is a loop over components, each a module of this package:

* :mod:`.main`: argv and environment, the join connection, exit codes;
* :mod:`.loop`: :class:`Node`, one iteration as a fixed order of component calls;
* :mod:`.phase`: a phase's config, its start and its end;
* :mod:`.admission`: the join challenge and the first generation (recovery mode);
* :mod:`.control`: the control plane (membership, groups, the small collectives);
* :mod:`.layout`: the layout in force and its one switch, ``adopt``;
* :mod:`.healing`: recovery, takeover and CheckFree, joins;
* :mod:`.replan`: route re-planning after a recovery or a join, and on drift;
* :mod:`.update`: the iteration's sync and optimizer step for this node's stages;
* :mod:`.report`: the gathered statistics, rank 0's metrics line, the sample log;
* :mod:`.stats`: per-iteration statistics as named columns.
"""

from .coordinator_link import STOP_KEY
from .loop import Node
from .state import PhaseState, StopRequested
from .main import main

__all__ = ["Node", "PhaseState", "STOP_KEY", "StopRequested", "main"]
