"""How much device memory one node's stage needs, from the config alone (nothing is allocated).

:func:`estimate_stage_memory` adds up, for the stage a node hosts:

* parameters: fp32 master weights (whatever ``train.precision``: bf16 autocasts the compute only);
* gradients: fp32, one per parameter (they accumulate over the micro-batches of an iteration);
* optimizer state: AdamW's two fp32 moments per parameter (``direction`` descent keeps none);
* activations: what autograd keeps per layer for each of ``in_flight`` micro-batches (the
  node's memory credits, ``runtime.memory``): per token and layer, the tensors autograd saves
  (:func:`activation_bytes_per_token_layer`, within 10% of the saved tensors measured on the
  CPU, ``tests/unit/test_model.py``); under bf16 also autocast's bf16 copies of the weights (once per
  iteration); stage 0 also holds one micro-batch's logits and their fp32 log-softmax for the
  loss (the loss runs one micro-batch at a time).

The activation part is an estimate of autograd's saved tensors (kernels' workspaces and the
allocator's slack are not counted); parameters, gradients and optimizer state are exact up to
the optimizer's per-tensor step counters.  :func:`check_fits` turns an estimate that exceeds a
device's memory into a one-line :class:`~skiptrain.errors.UserError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import UserError
from .partition import Partition, layer_bytes, partition_layers

GiB = 1024 ** 3
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


class StageMemoryError(UserError):
    """A stage does not fit its device."""


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[int, ...]
    params: int             # parameter count of the stage
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    in_flight: int
    precision: str = "fp32"

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def describe(self) -> str:
        """One line: the stage, its total and the parts in GiB."""
        g = lambda b: f"{b / GiB:.2f}"   # noqa: E731
        where = (f"stage {self.stages[0]}" if len(self.stages) == 1
                 else "stages " + ", ".join(str(s) for s in self.stages))
        return (f"{where}: {self.params / 1e6:.1f}M parameters, about {g(self.total_bytes)} GiB "
                f"(parameters {g(self.param_bytes)}, gradients {g(self.grad_bytes)}, optimizer "
                f"{g(self.optimizer_bytes)}, activations {g(self.activation_bytes)} for {self.in_flight} "
                f"micro-batch{'es' if self.in_flight != 1 else ''} in flight)")


def stage_params(cfg: ModelConfig, stage: int, partition: Partition | None = None) -> int:
    """Parameters held by ``stage`` (stage 0: also embedding, final norm and head)."""
    part = partition or partition_layers(cfg)
    n = len(part.layers(stage)) * layer_bytes(cfg, dtype_bytes=1)     # = parameters per layer
    if stage == 0:
        n += 2 * cfg.vocab_size * cfg.d_model + cfg.d_model
    return n


def activation_bytes_per_token_layer(cfg: ModelConfig, precision: str = "fp32") -> int:
    """Bytes autograd keeps per token and layer (see the module doc): four fp32 tensors of the
    residual stream's width (norm inputs and their statistics' operands), then in the compute
    dtype the SwiGLU intermediates (gate, up, their product's operands: 4 x hidden), the linear
    layers' inputs and q/k/v/attention outputs (5 x d_model in fp32; 8 x d_model under bf16
    autocast, whose casts are separate tensors) and k/v (2 x kv width)."""
    a = DTYPE_BYTES[precision]
    d, kv, h = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.hidden
    return 4 * 4 * d + a * (4 * h + (8 if a == 2 else 5) * d + 2 * kv)


def estimate_stage_memory(cfg: ModelConfig, stage: int, micro_batch: int, in_flight: int,
                          precision: str = "fp32", optimizer: str = "adamw",
                          partition: Partition | None = None) -> MemoryEstimate:
    """Device memory of one node hosting ``stage`` with ``in_flight`` micro-batches of
    ``micro_batch`` samples held at once (see the module doc for what is counted)."""
    part = partition or partition_layers(cfg)
    n = stage_params(cfg, stage, part)
    tokens = micro_batch * cfg.seq_len
    act = in_flight * tokens * len(part.layers(stage)) * activation_bytes_per_token_layer(cfg, precision)
    if precision == "bf16":   # autocast's bf16 copies of the weights, held for the iteration
        act += 2 * n
    if stage == 0:
        act += in_flight * tokens * 4 * cfg.d_model                      # embedding outputs
        act += tokens * cfg.vocab_size * (DTYPE_BYTES[precision] + 4)    # one micro-batch's logits
    opt = 8 * n if optimizer == "adamw" else 0
    return MemoryEstimate((stage,), n, 4 * n, 4 * n, opt, act, in_flight, precision)


def estimate_node_memory(cfg: ModelConfig, stages: list[int], micro_batch: int, in_flight: int,
                         precision: str = "fp32", optimizer: str = "adamw",
                         partition: Partition | None = None) -> MemoryEstimate:
    """:func:`estimate_stage_memory` summed over the stages one process hosts (each micro-batch in
    flight holds activations in every stage it passed)."""
    parts = [estimate_stage_memory(cfg, s, micro_batch, in_flight, precision, optimizer, partition)
             for s in stages]
    return MemoryEstimate(tuple(stages), sum(e.params for e in parts), sum(e.param_bytes for e in parts),
                          sum(e.grad_bytes for e in parts), sum(e.optimizer_bytes for e in parts),
                          sum(e.activation_bytes for e in parts), in_flight, precision)


def device_memory_bytes(device: str | torch.device) -> int:
    """Total memory of ``device``: the GPU's for CUDA, the machine's RAM for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(est: MemoryEstimate, available_bytes: int, device: str) -> None:
    """Refuse (one-line UserError) a stage whose estimate exceeds ``available_bytes`` of ``device``."""
    if est.total_bytes > available_bytes:
        raise StageMemoryError(
            f"{est.describe()} does not fit {device} ({available_bytes / GiB:.2f} GiB); use more stages "
            "(model.n_stages), fewer micro-batches in flight (runtime.memory) or a smaller train.micro_batch"
            + (" or train.precision=bf16" if est.precision == "fp32" else ""))
