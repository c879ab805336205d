"""`skiptrain ckpt ls|inspect|verify|reshard`, `skiptrain export`, and the HF LLaMA export."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from skiptrain.checkpoint.export import hf_name, interleaved_to_half
from skiptrain.checkpoint.manager import CheckpointManager
from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.cli import main
from skiptrain.config import build_config
from skiptrain.model.transformer import StagedLM
from skiptrain.optim import build_adamw


@pytest.fixture()
def saved(tmp_path):
    cfg = build_config("tiny")
    model = StagedLM(cfg.model, seed=3)
    opt = build_adamw(model.named_parameters(), cfg.train)
    x = torch.randint(0, 256, (2, 65))
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    root = tmp_path / "run" / "checkpoints"
    mgr = CheckpointManager(root, keep=5)
    for step in (1, 2):
        mgr.save_training(step, model, opt, {"step": step, "config": cfg.to_dict()})
    mgr.close()
    return cfg, model, opt, root


def test_ls_inspect_verify(saved, capsys):
    cfg, model, opt, root = saved
    assert main(["ckpt", "ls", str(root.parent)]) == 0
    out = capsys.readouterr().out
    assert "step-00000001" in out and "* step-00000002" in out
    assert main(["ckpt", "inspect", str(root), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and "optim.exp_avg.layers.3.ffn.w2.weight" in out
    assert main(["ckpt", "verify", str(root), "--all"]) == 0
    assert capsys.readouterr().out.count("ok ") == 2
    # corrupt the latest: verify fails with one line naming file, tensor and the previous one
    r = CheckpointReader(root)
    s = r.meta.tensors["head.weight"].shards[0]
    with open(r.path / s.file, "r+b") as f:
        f.seek(s.byte_offset)
        f.write(b"\xff\xff\xff\xff")
    assert main(["ckpt", "verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert "head.weight" in err and s.file in err and "step-00000001" in err and len(err.splitlines()) == 1
    assert main(["ckpt", "verify", str(root), "--all"]) == 2
    assert main(["ckpt", "ls", str(root / "nowhere")]) == 2


def test_reshard_cli_bit_identical(saved, tmp_path, capsys):
    cfg, model, opt, root = saved
    dst = tmp_path / "resharded"
    assert main(["ckpt", "reshard", str(root), str(dst), "--stages", "2", "--replicas", "3",
                 "--stage0-layers", "1"]) == 0
    a, b = CheckpointReader(root), CheckpointReader(dst)
    assert b.step == a.step and sorted(b.meta.files) == [f"data-r{k}.bin" for k in range(6)]
    assert b.state["config"]["model"]["n_stages"] == 2 and b.state["placement"] == {"0": [0, 1, 2], "1": [3, 4, 5]}
    b.verify()
    ta, tb = a.read_many(a.names()), b.read_many(b.names())
    assert ta.keys() == tb.keys()
    for n in ta:
        assert torch.equal(ta[n], tb[n]), n
    # a 2-stage node loads its stage from the resharded checkpoint with the right optimizer groups
    cfg2 = build_config("tiny", overrides={"model": {"n_stages": 2, "stage0_layers": 1}})
    node = StagedLM(cfg2.model, stages=[1], seed=9)
    nopt = build_adamw(node.named_parameters(), cfg2.train)
    CheckpointManager.restore(dst, node, nopt)
    for n, p in node.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n])
    assert nopt.param_groups[0]["weight_decay"] == cfg.train.weight_decay
    assert main(["ckpt", "reshard", str(root), str(tmp_path / "x"), "--stages", "9"]) == 2


def _hf_reference_logits(sd: dict, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """A from-scratch LLaMA forward in Hugging Face's conventions (rotate-half RoPE, HF names)."""
    m = cfg.model
    d, hd, nh, nkv = m.d_model, m.head_dim, m.n_heads, m.kv_heads
    b, t = tokens.shape
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()

    def rot(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_eps) * w

    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(b, t, nh, hd).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        h = h + y.transpose(1, 2).reshape(b, t, d) @ sd[p + "self_attn.o_proj.weight"].T
        x = norm(h, sd[p + "post_attention_layernorm.weight"])
        g = F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
        h = h + g @ sd[p + "mlp.down_proj.weight"].T
    return norm(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_export_hf_layout_matches_skiptrain_logits(saved, tmp_path, capsys):
    cfg, model, opt, root = saved
    out = tmp_path / "hf"
    assert main(["export", str(root.parent), "--out", str(out)]) == 0
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == "llama" and conf["num_key_value_heads"] == cfg.model.kv_heads
    assert conf["intermediate_size"] == cfg.model.hidden and conf["num_hidden_layers"] == cfg.model.n_layers
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == {hf_name(n) for n in model.state_dict()}
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        ours = model(tokens)
        ref = _hf_reference_logits(sd, cfg, tokens)
    torch.testing.assert_close(ref, ours, atol=2e-5, rtol=1e-4)
    # without the q/k permutation the reference differs: the permutation is what makes it match
    bad = dict(sd)
    for n, p in model.named_parameters():
        if n.endswith(("attn.wq.weight", "attn.wk.weight")):
            bad[hf_name(n)] = p.detach()
    with torch.no_grad():
        assert (_hf_reference_logits(bad, cfg, tokens) - ours).abs().max() > 1e-3
    # the native format keeps skiptrain's names and values
    assert main(["export", str(root), "--out", str(tmp_path / "native"), "--format", "skiptrain"]) == 0
    native = load_file(str(tmp_path / "native" / "model.safetensors"))
    assert all(torch.equal(native[n], p) for n, p in model.state_dict().items())


def test_interleaved_to_half_pairs():
    # head_dim 4: interleaved rows (0,1),(2,3) become halves (0,2 | 1,3)
    w = torch.arange(8.0).view(8, 1)
    assert interleaved_to_half(w, 2).view(-1).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_export_loads_in_transformers(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, model, opt, root = saved
    out = tmp_path / "hf"
    main(["export", str(root), "--out", str(out)])
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)


def _one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_export_into_a_run_a_checkpoint_or_a_data_set_is_refused_and_changes_nothing(saved, tmp_path, capsys):
    _, _, _, root = saved
    run = root.parent
    (run / "config.toml").write_text("[train]\n")
    (run / "model.safetensors").write_bytes(b"the run's weights")
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    for out, what in ((run, "holds a run (config.toml)"), (root / "step-00000002", "holds a checkpoint (metadata.json)"),
                      (data, "holds a data set (manifest.json)")):
        before = sorted(p.name for p in out.iterdir())
        _one_line(capsys, ["export", str(root), "--out", str(out)], f"--out {out} {what}: exporting there would")
        assert sorted(p.name for p in out.iterdir()) == before
    assert (run / "model.safetensors").read_bytes() == b"the run's weights"
    _one_line(capsys, ["export", str(root), "--out", str(run / "config.toml" / "x")],
              "cannot write the export directory")


def test_reshard_never_replaces_a_committed_checkpoint_and_refuses_absurd_layouts(saved, tmp_path, capsys):
    _, _, _, root = saved
    before = sorted((root / "step-00000002").iterdir())
    _one_line(capsys, ["ckpt", "reshard", str(root), str(root), "--stages", "2"],
              "already holds a checkpoint of step 2")
    assert sorted((root / "step-00000002").iterdir()) == before and CheckpointReader(root).verify()
    _one_line(capsys, ["ckpt", "reshard", str(root), str(tmp_path / "r"), "--stages", "2", "--replicas", "100000000"],
              "2 stages x 100000000 replicas is 200000000 writers, more than a run has nodes (1024)")
    _one_line(capsys, ["ckpt", "reshard", str(root), str(root / "LATEST" / "x"), "--stages", "2"],
              "cannot write the resharded checkpoint under")


def test_verify_all_with_no_checkpoint_is_an_error_not_a_silent_success(tmp_path, capsys):
    _one_line(capsys, ["ckpt", "verify", "--all", str(tmp_path / "nowhere")], "nothing was verified")
