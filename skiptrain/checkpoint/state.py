"""Training state <-> named tensors + JSON, by global names, for any subset of stages.

Naming (documented in docs/checkpoint.md):

* model parameters and persistent buffers: their global names, ``layers.7.attn.wq.weight``;
* optimizer state: ``optim.{key}.{parameter name}`` for every tensor in ``optimizer.state[p]``,
  e.g. ``optim.exp_avg.layers.7.attn.wq.weight``, ``optim.exp_avg_sq.<name>``,
  ``optim.step.<name>`` (AdamW's 0-d step counter).  ``key`` never contains a dot.
* optimizer hyper-parameters: JSON, one record per parameter group with the group's parameter
  *names* (not indices), so a node holding other stages restores the hyper-parameters of its own
  parameters; non-tensor per-parameter state goes to JSON by parameter name too.

Because everything is keyed by the global parameter name, a model built for any stage subset
and partition loads exactly its part: :func:`load_optimizer` looks up its own parameters' names.

RNG states: ``torch`` generator states and ``random.Random`` states are encoded to JSON
(base64 / lists) with :func:`encode_torch_rng` / :func:`encode_random` and decoded back exactly.
"""

from __future__ import annotations

import base64
import random
from typing import Any, Iterable, Mapping

import torch

from .format import CheckpointError

OPTIM_PREFIX = "optim."


def optim_name(key: str, param_name: str) -> str:
    if "." in key:
        raise ValueError(f"optimizer state key {key!r} contains a dot")
    return f"{OPTIM_PREFIX}{key}.{param_name}"


def split_optim_name(name: str) -> tuple[str, str] | None:
    """``optim.exp_avg.layers.0.x`` -> (``exp_avg``, ``layers.0.x``); None for non-optimizer names."""
    if not name.startswith(OPTIM_PREFIX):
        return None
    key, _, param = name[len(OPTIM_PREFIX):].partition(".")
    return key, param


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by global name (sharing the live storage)."""
    return dict(model.state_dict(keep_vars=False))


def _jsonable(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, (list,)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def optimizer_tensors(named_params: Iterable[tuple[str, torch.nn.Parameter]],
                      optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's state as (named tensors, JSON record)."""
    name_of = {id(p): n for n, p in named_params}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups = []
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            if id(p) not in name_of:
                raise ValueError("optimizer holds a parameter that is not in the model")
            n = name_of[id(p)]
            names.append(n)
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    tensors[optim_name(k, n)] = v
                else:
                    scalars.setdefault(n, {})[k] = _jsonable(v)
        groups.append({"params": names, **{k: _jsonable(v) for k, v in g.items() if k != "params"}})
    return tensors, {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}


def load_optimizer(optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                   tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any] | None) -> None:
    """Restore ``optimizer`` (built over any subset of the saved parameters) from named state.

    ``tensors`` must hold every ``optim.*.<name>`` entry of this optimizer's parameters that the
    checkpoint has (see :func:`optimizer_state_names`).  Group hyper-parameters are taken from the
    saved group that held each group's first parameter.  Raises CheckpointError when the saved
    optimizer was of another class.
    """
    record = dict(record or {})
    if record.get("class") not in (None, type(optimizer).__name__):
        raise CheckpointError(f"checkpoint holds {record['class']} state; this run uses "
                              f"{type(optimizer).__name__}")
    name_of = {id(p): n for n, p in named_params}
    saved_group = {n: g for g in record.get("param_groups", []) for n in g["params"]}
    scalars = record.get("scalars", {})
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for full, t in tensors.items():
        kp = split_optim_name(full)
        if kp is not None:
            by_param.setdefault(kp[1], {})[kp[0]] = t
    sd = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for g, gsd in zip(optimizer.param_groups, sd["param_groups"]):
        new_g = dict(gsd)
        for p, idx in zip(g["params"], gsd["params"]):
            n = name_of[id(p)]
            st = dict(scalars.get(n, {}))
            st.update(by_param.get(n, {}))
            if st:
                state[idx] = st
        if g["params"]:
            first = name_of[id(g["params"][0])]
            for k, v in saved_group.get(first, {}).items():
                if k != "params" and k in new_g:
                    new_g[k] = tuple(v) if isinstance(new_g[k], tuple) else v
        groups.append(new_g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def optimizer_state_names(available: Iterable[str], param_names: Iterable[str]) -> list[str]:
    """The ``optim.*`` names among ``available`` that belong to ``param_names``."""
    wanted = set(param_names)
    out = []
    for n in available:
        kp = split_optim_name(n)
        if kp is not None and kp[1] in wanted:
            out.append(n)
    return out


def encode_torch_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_torch_rng(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def encode_random(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def decode_random(state: list, rng: random.Random | None = None) -> random.Random:
    rng = rng or random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng
