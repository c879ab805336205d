"""Import a pre-trained LLaMA-architecture model from a local Hugging Face directory.

The inverse of :mod:`.export`: ``config.json`` becomes skiptrain's model section
(:func:`model_config_from_hf`), the safetensors tensors (one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``) get skiptrain's global names
(:func:`~.export.skiptrain_name`) and the q/k rows go back from HF's rotate-half layout to
interleaved pairs (:func:`~.export.half_to_interleaved`).  Nothing is fetched from a hub.

A node that builds only its stage reads only its stage's tensors (:func:`load_hf_weights` on a
``StagedLM(cfg, stages=[s])``; safetensors reads each tensor on its own).  A model with tied
embeddings gets its head initialised from the embedding (skiptrain's head is its own tensor,
so the two may drift apart in further training).  A configuration skiptrain's decoder cannot
represent (another architecture, biases, rope scaling, another activation, a head dimension other
than hidden_size / num_attention_heads) is refused with a one-line error naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import UserError
from ..model.transformer import is_meta
from .export import half_to_interleaved, hf_name


class HFImportError(UserError):
    """A Hugging Face directory skiptrain cannot import; the message names the file or field."""


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFImportError(f"{path} does not exist; pass a local Hugging Face model directory "
                            "(config.json + safetensors)")
    return json.loads(path.read_text())


def check_supported(hf: dict) -> None:
    """Refuse (one line) a config skiptrain's LLaMA decoder cannot represent exactly."""
    def refuse(what: str) -> None:
        raise HFImportError(f"cannot import this model: {what}; skiptrain holds LLaMA-architecture "
                            "models without biases or rope scaling")

    if hf.get("model_type") != "llama":
        refuse(f"model_type is {hf.get('model_type')!r}, not 'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act is {hf.get('hidden_act')!r}, not 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(f"{key} is true")
    if hf.get("rope_scaling"):
        refuse(f"rope_scaling is {hf['rope_scaling']!r}")
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        refuse(f"rope_parameters.rope_type is {rope_type!r}, not 'default'")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, head_dim):
        refuse(f"head_dim is {hf['head_dim']}, not hidden_size / num_attention_heads = {head_dim}")


def rope_theta(hf: dict) -> float:
    """The rotary base: ``rope_theta``, or ``rope_parameters.rope_theta`` in newer configs."""
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return float(theta)


def model_config_from_hf(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    """skiptrain's model section for ``hf``; layout fields (stages, stage 0's layers) come from
    ``base``, and its ``seq_len`` too when shorter than the model's ``max_position_embeddings``."""
    check_supported(hf)
    base = base or ModelConfig()
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"],
        seq_len=min(base.seq_len, hf.get("max_position_embeddings", base.seq_len)),
        n_stages=min(base.n_stages, hf["num_hidden_layers"] + 1), stage0_layers=base.stage0_layers,
        rope_theta=rope_theta(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", base.init_std)))
    cfg.check()
    return cfg


def model_config_for_data(hf_dir: str | Path, base: ModelConfig, data_vocab: int) -> ModelConfig:
    """:func:`model_config_from_hf` for training on a data set of ``data_vocab`` token ids, which
    must be the model's own tokenizer's ids (only their count can be checked here)."""
    cfg = model_config_from_hf(read_hf_config(hf_dir), base)
    if data_vocab > cfg.vocab_size:
        raise HFImportError(f"the data set has {data_vocab} token ids but the model in {hf_dir} only "
                            f"{cfg.vocab_size}; prepare the data with the model's tokenizer")
    return cfg


def hf_tensor_files(hf_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return {n: d / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    single = d / "model.safetensors"
    if not single.is_file():
        raise HFImportError(f"{d} holds neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {n: single for n in f.keys()}


def read_hf_tensors(hf_dir: str | Path, cfg: ModelConfig, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (skiptrain's global names) of the model in ``hf_dir``, in skiptrain's
    layout and their stored dtype; a tied model's ``head.weight`` is its embedding."""
    files = hf_tensor_files(hf_dir)
    keys: dict[str, str] = {}
    for name in names:
        key = hf_name(name)
        if key not in files and name == "head.weight":
            key = hf_name("tok_emb.weight")           # tied embeddings
        if key not in files:
            raise HFImportError(f"{hf_dir}: tensor {key!r} (skiptrain {name!r}) is missing")
        keys[name] = key
    out: dict[str, torch.Tensor] = {}
    for path in sorted({files[k] for k in keys.values()}):
        with safe_open(str(path), framework="pt") as f:
            out.update({n: f.get_tensor(k) for n, k in keys.items() if files[k] == path})
    for name, t in out.items():
        if name.endswith("attn.wq.weight"):
            t = half_to_interleaved(t, cfg.n_heads)
        elif name.endswith("attn.wk.weight"):
            t = half_to_interleaved(t, cfg.kv_heads)
        out[name] = t
    return out


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Copy the weights of the HF model in ``hf_dir`` into ``model`` (a ``StagedLM`` holding any
    stages, on any device; values are cast to its parameters' dtype)."""
    if is_meta(model):
        raise HFImportError("the model is on the meta device; materialize() it before loading weights")
    named = dict(model.named_parameters())
    tensors = read_hf_tensors(hf_dir, model.cfg, named)
    for name, p in named.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise HFImportError(f"{hf_dir}: {name} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}")
        p.copy_(t)
