"""Where a process computes and in which precision: ``train.device`` and ``train.precision``.

* :func:`resolve_device` turns ``auto | cpu | cuda`` into a ``torch.device``: ``auto`` is CUDA
  when torch sees a GPU, else the CPU; a node process of a swarm passes its local rank and gets
  ``cuda:LOCAL_RANK`` (modulo the GPUs it sees, so several nodes may share one GPU).
* :func:`autocast` is the compute-precision context: ``fp32`` does nothing, ``bf16`` runs
  matmuls and attention in bfloat16 (``torch.autocast``, on CPU and CUDA alike) while the
  parameters, their gradients and the optimizer state stay fp32.  Enter it around forward *and*
  backward (the executor runs both inside one iteration).
* :func:`to_device` moves a host batch to the device: through pinned memory with a
  non-blocking copy when the device is CUDA, unchanged on the CPU; :func:`to_host_async` is the
  other way (a pinned host buffer filled by a non-blocking copy, and the CUDA event to wait on
  before the host reads it).
* :func:`build_on_device` is how a process gets its stages: memory estimate and refusal when they
  cannot fit the device (:func:`check_stages_fit`), a build on the meta device (nothing allocated, no other stage ever
  built) and the materialisation of just those stages on the device.
"""

from __future__ import annotations

import contextlib

import torch

from ..config import ModelConfig
from ..errors import UserError
from .memory import MemoryEstimate, check_fits, device_memory_bytes, estimate_node_memory
from .partition import Partition
from .transformer import StagedLM

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str, local_rank: int = 0, setting: str = "train.device") -> torch.device:
    """``auto | cpu | cuda`` (or an explicit ``cuda:N``) as a device; ``cuda`` is
    ``cuda:local_rank`` modulo the GPUs torch sees.  CUDA without a GPU, or a GPU index this torch
    does not see, is a UserError naming ``setting``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"{setting}={name} but this torch sees no CUDA device; "
                            f"use {setting}=cpu or auto")
        dev, count = torch.device(name), torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UserError(f"{setting}={name} but this torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
                            "use one of those, or cuda for cuda:LOCAL_RANK")
        return torch.device("cuda", dev.index if dev.index is not None else local_rank % count)
    raise UserError(f"{setting}={name!r} is not a device; choose auto, cpu, cuda or cuda:N")


def node_device(train_device: str, devices: list[str], node: int, local_rank: int) -> torch.device:
    """The device of swarm node ``node``: its entry of ``runtime.devices`` (parsed by
    :func:`skiptrain.config.node_devices`) when the list has one, else ``train.device`` with
    ``cuda`` meaning ``cuda:local_rank`` (modulo the GPUs the process sees, so several nodes may
    share one GPU; a node joining beyond the list also takes this)."""
    if node < len(devices):
        return resolve_device(devices[node], local_rank, f"runtime.devices (node {node})")
    return resolve_device(train_device, local_rank)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The compute-precision context for forward and backward on ``device`` (see the module doc)."""
    if precision not in PRECISIONS:
        raise UserError(f"train.precision={precision!r} is not allowed; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``: pinned and copied asynchronously for CUDA."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """``t`` copied into host memory without waiting: for a CUDA tensor a pinned buffer filled by
    a non-blocking copy on the current stream, and the event recorded after it (synchronise on it
    before reading the buffer, e.g. in a sender thread, so the copy overlaps the next compute);
    a host tensor is returned as it is, with no event."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def check_stages_fit(cfg: ModelConfig, stages: list[int], device: str | torch.device, micro_batch: int,
                     in_flight: int, precision: str, partition: Partition | None = None,
                     where: str | None = None) -> MemoryEstimate:
    """The memory estimate of ``stages`` with ``in_flight`` micro-batches of ``micro_batch``
    samples, refused (one-line :class:`~skiptrain.model.memory.StageMemoryError`, nothing
    allocated) when it exceeds the memory of ``device`` (named ``where`` in the message, default
    the device): the check of every process that builds stages, and of a launch before it starts
    any (:func:`skiptrain.runtime.preflight.check_swarm_memory`)."""
    est = estimate_node_memory(cfg, stages, micro_batch, in_flight, precision, partition=partition)
    check_fits(est, device_memory_bytes(device), where or str(device))
    return est


def build_on_device(cfg: ModelConfig, stages: list[int], seed: int, device: torch.device, micro_batch: int,
                    in_flight: int, precision: str, partition: Partition | None = None
                    ) -> tuple[StagedLM, MemoryEstimate]:
    """``stages`` of the model materialised on ``device`` (the values a CPU build holds) and their
    memory estimate with ``in_flight`` micro-batches; refused (one line, before anything is
    allocated) when the estimate exceeds the device's memory."""
    est = check_stages_fit(cfg, stages, device, micro_batch, in_flight, precision, partition)
    model = StagedLM(cfg, stages=stages, partition=partition, seed=seed, device="meta")
    return model.materialize(device), est
