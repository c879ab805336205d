"""Importing a local Hugging Face LLaMA directory: the inverse of `skiptrain export`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from skiptrain.checkpoint.export import export, half_to_interleaved, interleaved_to_half
from skiptrain.checkpoint.hf_import import (HFImportError, load_hf_weights, model_config_from_hf,
                                            read_hf_config, read_hf_tensors)
from skiptrain.checkpoint.manager import CheckpointManager
from skiptrain.config import build_config
from skiptrain.model.transformer import StagedLM
from skiptrain.optim import build_adamw
from skiptrain.train.trainer import Trainer


@pytest.fixture()
def exported(tmp_path):
    """A trained-one-step tiny model, checkpointed and exported to HF LLaMA format."""
    cfg = build_config("tiny", overrides={"model": {"n_layers": 6, "stage0_layers": 1}})
    model = StagedLM(cfg.model, seed=3)
    opt = build_adamw(model.named_parameters(), cfg.train)
    x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", keep=2)
    mgr.save_training(1, model, opt, {"step": 1, "config": cfg.to_dict()})
    mgr.close()
    return cfg, model, export(tmp_path / "run" / "checkpoints", tmp_path / "hf")


def test_half_to_interleaved_inverts_export_permutation():
    w = torch.randn(24, 5)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, 3), 3), w)


def test_export_then_import_is_bit_exact_and_logits_match(exported):
    cfg, model, hf_dir = exported
    imported = model_config_from_hf(read_hf_config(hf_dir), cfg.model)
    assert imported == dataclasses.replace(cfg.model, ffn_hidden=cfg.model.hidden)
    fresh = StagedLM(imported, seed=99)
    load_hf_weights(fresh, hf_dir)
    ref = dict(model.named_parameters())
    for n, p in fresh.named_parameters():
        assert torch.equal(p, ref[n]), n
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))


def test_a_node_imports_only_its_stage_into_a_materialized_meta_build(exported):
    cfg, model, hf_dir = exported
    node = StagedLM(cfg.model, stages=[2], seed=5, device="meta")
    with pytest.raises(HFImportError, match="materialize"):
        load_hf_weights(node, hf_dir)
    node.materialize("cpu")
    load_hf_weights(node, hf_dir)
    ref = dict(model.named_parameters())
    assert {n for n, _ in node.named_parameters()} < set(ref)
    for n, p in node.named_parameters():
        assert torch.equal(p, ref[n]), n


def test_transformers_llama_imports_with_matching_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    for tied in (False, True):
        conf = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tied)
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(conf).eval()
        hf.save_pretrained(tmp_path / f"llama{tied}")           # local files only
        cfg = model_config_from_hf(read_hf_config(tmp_path / f"llama{tied}"),
                                   build_config("tiny", overrides={"model": {"n_stages": 3, "stage0_layers": -1}}).model)
        ours = StagedLM(cfg, seed=1).eval()
        load_hf_weights(ours, tmp_path / f"llama{tied}")
        tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("change,msg", [
    ({"model_type": "mistral"}, "model_type is 'mistral'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling is"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type is 'yarn'"),
    ({"attention_bias": True}, "attention_bias is true"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"head_dim": 8}, "head_dim is 8"),
])
def test_unsupported_configs_are_refused_in_one_line(exported, change, msg):
    _, _, hf_dir = exported
    conf = {**read_hf_config(hf_dir), **change}
    with pytest.raises(HFImportError, match=msg) as e:
        model_config_from_hf(conf)
    assert "\n" not in str(e.value)


def test_missing_tensor_and_directory_are_one_line_errors(exported, tmp_path):
    cfg, _, hf_dir = exported
    with pytest.raises(HFImportError, match="config.json does not exist"):
        read_hf_config(tmp_path / "nowhere")
    with pytest.raises(HFImportError, match="'model.layers.9.mlp.up_proj.weight'.*is missing"):
        read_hf_tensors(hf_dir, cfg.model, ["layers.9.ffn.w3.weight"])


def test_trainer_starts_from_an_imported_model(exported, byte_data):
    cfg, model, hf_dir = exported
    run = build_config("tiny", overrides={"data": {"path": str(byte_data)},
                                          "train": {"progress": False, "init_from": str(hf_dir)}})
    tr = Trainer(run)
    assert tr.cfg.model.n_layers == 6 and tr.cfg.model.vocab_size == 256
    ref = dict(model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in tr.model.named_parameters())
    assert tr.train_step().loss < 6.0
    conf = json.loads((hf_dir / "config.json").read_text())
    conf["vocab_size"] = 100
    (hf_dir / "config.json").write_text(json.dumps(conf))
    with pytest.raises(HFImportError, match="the data set has 256 token ids but the model"):
        Trainer(run)
