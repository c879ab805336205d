"""Checks a launcher makes before any node process starts: the device each node computes on,
and whether each node's stages fit that device.  The nodes make the same checks when they build
their stages; these let a local launch refuse a bad layout in one line before it forks anything.
"""

from __future__ import annotations

import torch


def device_of_node(cfg, node: int, local_rank: int) -> torch.device:
    """The device swarm node ``node`` computes on (``runtime.devices``, else ``train.device``
    with ``cuda`` = ``cuda:local_rank`` modulo the visible GPUs; ``auto`` is the CPU in an elastic
    swarm, whose transitions run there); refused in one line: a device this process does not
    have, ``dp.backend=nccl`` off CUDA, elastic freezing on a device asked for off the CPU."""
    from ..config import node_devices
    from ..errors import UserError
    from ..model.device import node_device

    devices = node_devices(cfg.runtime.devices)
    asked = devices[node] if node < len(devices) else cfg.train.device
    if cfg.elastic.enabled and asked == "auto":
        devices, train_device = [], "cpu"
    else:
        train_device = cfg.train.device
    dev = node_device(train_device, devices, node, local_rank)
    if cfg.dp.backend == "nccl" and dev.type != "cuda":
        raise UserError(f"dp.backend=nccl needs every replica on a CUDA device, but node {node} computes "
                        f"on {dev}; set dp.backend=gloo, or give the node a GPU (train.device, runtime.devices)")
    if cfg.elastic.enabled and dev.type != "cpu":
        raise UserError(f"elastic.enabled: a swarm's freeze transitions move stages through host memory and run "
                        f"on the CPU only, but node {node} would compute on {dev}; set train.device=cpu "
                        "(and runtime.devices empty) or elastic.enabled=false")
    return dev


def check_swarm_memory(cfg, stages_of: dict[int, list[int]] | None = None) -> None:
    """Refuse in one line, before any node process starts, a local swarm with a node whose stages
    cannot fit its device: the check each node makes when it builds them
    (:func:`~skiptrain.model.device.check_stages_fit`, ``runtime.memory`` micro-batches in flight,
    on the device :func:`device_of_node` gives node ``r`` with ``LOCAL_RANK=r``).  ``stages_of``
    is the planned layout (node -> stages); without it (before planning), ``runtime.node_stages``
    when given, else every stage on the swarm's largest device (a stage that does not fit there
    fits no node)."""
    from ..config import node_stage_lists
    from ..model.device import check_stages_fit
    from ..model.memory import device_memory_bytes

    rt, t = cfg.runtime, cfg.train
    devices = {n: device_of_node(cfg, n, n) for n in range(rt.nodes)}
    if stages_of is not None:
        layout = [(n, stages, "") for n, stages in sorted(stages_of.items())]
    elif rt.node_stages.strip():
        layout = [(n, stages, "") for n, stages in enumerate(node_stage_lists(rt.node_stages))]
    else:
        largest = max(devices, key=lambda n: device_memory_bytes(devices[n]))
        layout = [(largest, [s], ", the swarm's largest device") for s in range(cfg.model.n_stages)]
    model = cfg.model
    if t.init_from:                      # the nodes build the pre-trained model's shapes
        from ..checkpoint.hf_import import model_config_for_data
        model = model_config_for_data(t.init_from, cfg.model, cfg.model.vocab_size)
    seen = set()
    for node, stages, note in layout:
        dev = devices[node]
        if (dev, tuple(stages)) not in seen:
            seen.add((dev, tuple(stages)))
            check_stages_fit(model, list(stages), dev, t.micro_batch, rt.memory, t.precision,
                             where=f"node {node}'s {dev}{note}")



def check_checkpoint_fits(path, model_cfg) -> None:
    """Refuse, in one line, to resume the checkpoint at ``path`` under a model config whose
    tensors it does not hold (another width, depth or vocabulary): every node would fail to load
    its stage.  The layout (stages, partition, replicas) may differ: checkpoints reshard."""
    from ..checkpoint.reader import CheckpointReader
    from ..checkpoint.state import model_tensors
    from ..errors import UserError
    from ..model import StagedLM

    saved = CheckpointReader(path).meta.tensors
    want = {n: list(t.shape) for n, t in model_tensors(StagedLM(model_cfg, device="meta")).items()}
    missing = sorted(n for n in want if n not in saved)
    wrong = sorted(n for n in want if n in saved and list(saved[n].shape) != want[n])
    if missing or wrong:
        what = (f"{wrong[0]} is {list(saved[wrong[0]].shape)} there, {want[wrong[0]]} here" if wrong
                else f"it holds no {missing[0]}")
        raise UserError(f"--resume: the checkpoint {path} does not fit this model config ({what}); resume with the "
                        "run's model settings (its config.toml), or start a new run")
