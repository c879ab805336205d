"""Offline resharding: rewrite a checkpoint for another layout of stages and replicas.

Loading never needs this (any layout reads any checkpoint directly); it is for placing each
node's bytes in its own file before a run on a new layout, e.g. to copy only ``data-r{k}.bin``
to node k.  The output is an ordinary committed checkpoint under ``dst`` (same step, tensors
bit-identical) whose writer ranks are ``stage * replicas + replica``, with the stored config's
``model.n_stages`` / ``model.stage0_layers`` and the placement updated.  It is written with the
same protocol as a live save (temporary directory, fsync, rename, LATEST), one rank at a time so
memory stays at one rank's share.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config import MAX_NODES, ConfigError
from ..model.partition import partition_layers
from .export import checkpoint_config
from .format import CheckpointError, step_dir_name, tmp_dir_name
from .manager import optimizer_record
from ..layout import Layout
from .plan import DEFAULT_CHUNK_BYTES, TensorSpec, plan_save
from .reader import CheckpointReader, byte_view
from .writer import commit, write_part


def reshard(src: str | Path, dst: str | Path, n_stages: int, replicas: int = 1, stage0_layers: int = -1,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Path:
    reader = CheckpointReader(src)
    cfg = checkpoint_config(reader)
    cfg.model.n_stages, cfg.model.stage0_layers = n_stages, stage0_layers
    try:
        cfg.check()
    except ConfigError as e:
        raise CheckpointError(f"cannot reshard to {n_stages} stages: {e}") from None
    if replicas < 1:
        raise CheckpointError("replicas must be at least 1")
    if n_stages * replicas > MAX_NODES:
        raise CheckpointError(f"{n_stages} stages x {replicas} replicas is {n_stages * replicas} writers, more than a run "
                              f"has nodes ({MAX_NODES}); ask for fewer replicas")
    dst = Path(dst)
    if (dst / step_dir_name(reader.step)).exists():
        raise CheckpointError(f"{dst} already holds a checkpoint of step {reader.step} "
                              f"({dst / step_dir_name(reader.step)}); resharding there would replace it: pass an "
                              "empty destination directory")
    partition = partition_layers(cfg.model)
    placement = {s: [s * replicas + j for j in range(replicas)] for s in range(n_stages)}
    ranks = [r for rs in placement.values() for r in rs]
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in reader.meta.tensors.items()]
    plan = plan_save(specs, Layout(partition, [placement[s] for s in range(n_stages)]).holders(reader.meta.tensors),
                     chunk_bytes, ranks)
    state = {k: v for k, v in reader.state.items() if k != "ranks"}
    state["config"] = cfg.to_dict()
    state["placement"] = {str(s): rs for s, rs in placement.items()}
    opt = optimizer_record(reader.state)
    layout = {"writers": ranks, "n_stages": n_stages, "replicas": replicas, "partition": partition.to_list(),
              "bytes_per_rank": {str(r): b for r, b in plan.bytes_per_rank().items()},
              "resharded_from": str(reader.path)}
    try:
        for r in ranks:
            tensors = reader.read_many(plan.names_for(r))
            rank_state = {"optimizer": opt} if (opt and r == ranks[0]) else None
            write_part(dst, reader.step, r, plan, {n: byte_view(t) for n, t in tensors.items()}, rank_state)
            del tensors
        return commit(dst, reader.step, ranks, plan, state, layout)
    except OSError as e:
        shutil.rmtree(dst / tmp_dir_name(reader.step), ignore_errors=True)
        raise CheckpointError(f"cannot write the resharded checkpoint under {dst}: {e.strerror} ({e.filename}); "
                              "nothing of it was kept; pass a writable destination with free space") from None
