"""Export a checkpoint's model to safetensors plus a Hugging Face LLaMA ``config.json``.

The result loads with ``transformers.LlamaForCausalLM.from_pretrained(DIR)`` and gives the same
logits as skiptrain's model (tested when transformers is installed).  Mapping:

==========================================  ===============================================
skiptrain                                   Hugging Face LLaMA
==========================================  ===============================================
``tok_emb.weight``                          ``model.embed_tokens.weight``
``layers.{i}.attn_norm.weight``             ``model.layers.{i}.input_layernorm.weight``
``layers.{i}.attn.wq|wk|wv|wo.weight``      ``model.layers.{i}.self_attn.q|k|v|o_proj.weight``
``layers.{i}.ffn_norm.weight``              ``model.layers.{i}.post_attention_layernorm.weight``
``layers.{i}.ffn.w1|w3|w2.weight``          ``model.layers.{i}.mlp.gate|up|down_proj.weight``
``norm.weight`` / ``head.weight``           ``model.norm.weight`` / ``lm_head.weight``
==========================================  ===============================================

Rotary embeddings: skiptrain rotates interleaved pairs ``(x[2i], x[2i+1])`` (Meta's convention);
HF rotates halves ``(x[i], x[i + d/2])``.  So the rows of ``wq`` and ``wk`` are permuted within
each head exactly as Meta->HF conversion does (:func:`interleaved_to_half`).

``--format skiptrain`` writes the tensors under skiptrain's own global names instead (the same
file layout as a run directory's ``model.safetensors``, its checksum included), without
permutation.  The checkpoint's shards are CRC-32 checked as they are read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import Config, ConfigError, config_from_dict
from .format import METADATA_FILE, CheckpointError
from .reader import CheckpointReader

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "head.weight": "lm_head.weight"}


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k projection rows from interleaved-pair RoPE to HF's rotate-half layout."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half` (HF rotate-half rows back to interleaved pairs)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def skiptrain_name(hf: str) -> str:
    """The inverse of :func:`hf_name`: a Hugging Face LLaMA tensor name in skiptrain's naming."""
    for ours, theirs in _TOP_MAP.items():
        if hf == theirs:
            return ours
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        for ours, theirs in _LAYER_MAP.items():
            if parts[3] == theirs:
                return f"layers.{parts[2]}.{ours}"
    raise CheckpointError(f"tensor {hf!r} is not part of a LLaMA model skiptrain can hold")


def hf_name(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in _LAYER_MAP:
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}"
    raise CheckpointError(f"tensor {name!r} has no Hugging Face LLaMA equivalent")


def hf_config(cfg: Config, dtype: str = "float32") -> dict:
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.hidden,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": m.init_std, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": dtype,
    }


def checkpoint_config(reader: CheckpointReader) -> Config:
    saved = reader.state.get("config")
    if not saved:
        raise CheckpointError(f"checkpoint {reader.path} stores no config; it was not written by the trainer")
    try:
        return config_from_dict(saved)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {reader.path}: its stored config is invalid ({e})") from None


def model_names(reader: CheckpointReader) -> list[str]:
    return [n for n in reader.names() if n in _TOP_MAP or n.startswith("layers.")]


def export(src: str | Path, out: str | Path, fmt: str = "hf", dtype: str = "float32") -> Path:
    """Write ``out/model.safetensors`` (+ ``config.json`` for ``hf``) from checkpoint ``src``.

    Reads only the model's tensors (not the optimizer state), checksums verified.  A
    ``tokenizer.json`` next to the checkpoint root (a run directory) is copied along.
    """
    out = Path(out)
    check_export_dir(out)
    reader = CheckpointReader(src)
    cfg = checkpoint_config(reader)
    tensors = reader.read_many(model_names(reader))
    try:
        return _write_export(reader, cfg, tensors, out, fmt, dtype)
    except OSError as e:
        raise CheckpointError(f"cannot write the export directory {out}: {e.strerror} ({e.filename}); pass a "
                              "writable --out with free space") from None


#: Files that mark a directory an export must not write into: what it is, and the file that says so.
NOT_AN_EXPORT_DIR = {"config.toml": "a run", METADATA_FILE: "a checkpoint", "manifest.json": "a data set"}


def check_export_dir(out: Path) -> None:
    """Refuse an ``out`` that holds a run, a checkpoint or a data set: the export's
    ``model.safetensors`` / ``tokenizer.json`` would replace theirs (a run's weights lost)."""
    for marker, what in NOT_AN_EXPORT_DIR.items():
        if (out / marker).is_file():
            raise CheckpointError(f"--out {out} holds {what} ({marker}): exporting there would replace its "
                                  "files; pass another --out (and copy model.safetensors over yourself if you mean "
                                  "to replace a run's weights)")


def _write_export(reader: CheckpointReader, cfg: Config, tensors: dict, out: Path, fmt: str, dtype: str) -> Path:
    target = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "skiptrain":
        from .weights import save_weights_file  # the run directory's format, checksum included

        save_weights_file({n: t.to(target) for n, t in tensors.items()}, out / "model.safetensors")
    elif fmt == "hf":
        hf = {}
        for n, t in tensors.items():
            if n.endswith("attn.wq.weight"):
                t = interleaved_to_half(t, cfg.model.n_heads)
            elif n.endswith("attn.wk.weight"):
                t = interleaved_to_half(t, cfg.model.kv_heads)
            hf[hf_name(n)] = t.to(target).contiguous()
        save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=1) + "\n")
    else:
        raise CheckpointError(f"unknown export format {fmt!r}; choose hf or skiptrain")
    for cand in (reader.path.parent.parent / "tokenizer.json", reader.path.parent / "tokenizer.json"):
        if cand.is_file():
            shutil.copyfile(cand, out / "tokenizer.json")
            break
    (out / "skiptrain.json").write_text(json.dumps(
        {"source": str(reader.path), "step": reader.step, "format": fmt, "config": cfg.to_dict()}, indent=1) + "\n")
    return out
