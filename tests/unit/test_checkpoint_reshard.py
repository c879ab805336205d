"""Resharding: save under 4 stages x 2 replicas (8 simulated writers), load under 2 stages x 4
replicas and under a single process; parameters and AdamW state bit-identical; the resumed
single-process run continues the uninterrupted loss curve exactly."""

from __future__ import annotations

import torch

import skiptrain.checkpoint.reader as reader_mod
from skiptrain.checkpoint.manager import CheckpointManager, specs_of
from skiptrain.layout import tensor_stage
from skiptrain.checkpoint.reader import CheckpointReader
from skiptrain.checkpoint.state import split_optim_name
from skiptrain.config import build_config
from skiptrain.model.transformer import StagedLM
from skiptrain.optim import build_adamw


def _cfg(n_stages: int, stage0_layers: int):
    return build_config("tiny", overrides={"model": {"n_stages": n_stages, "stage0_layers": stage0_layers}})


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(0, 256, (4, 65), generator=g)
    return x[:, :-1], x[:, 1:]


def _step(model, opt, i: int) -> float:
    x, y = _batch(i)
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def _opt_by_name(model, opt) -> dict[str, torch.Tensor]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {f"optim.{k}.{name_of[id(p)]}": v for p, st in opt.state.items() for k, v in st.items()}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def test_save_4x2_load_2x4_and_single_process(tmp_path, monkeypatch):
    cfg4, cfg2, cfg1 = _cfg(4, 1), _cfg(2, 2), _cfg(1, 4)
    tc = cfg4.train
    ref = StagedLM(cfg4.model, seed=tc.seed)
    ref_opt = build_adamw(ref.named_parameters(), tc)
    for i in range(3):
        _step(ref, ref_opt, i)
    ref_tensors = dict(ref.state_dict())
    ref_tensors.update(_opt_by_name(ref, ref_opt))

    # ---- 4 stages x 2 replicas: 8 writers, rank = 2 * stage + replica -------------------
    part4 = ref.partition
    placement = {s: [2 * s, 2 * s + 1] for s in range(4)}
    holders = {n: placement[tensor_stage(n, part4)] for n in ref_tensors}
    specs = specs_of(ref_tensors)
    managers, nodes = [], []
    for s in range(4):
        for j in range(2):
            rank = 2 * s + j
            node = StagedLM(cfg4.model, stages=[s], seed=999)  # wrong values until copied
            node.load_state_dict({n: v for n, v in ref.state_dict().items() if n in node.state_dict()})
            opt = build_adamw(node.named_parameters(), tc)
            ref_params = dict(ref.named_parameters())
            for n, p in node.named_parameters():
                opt.state[p] = {k: v.clone() for k, v in ref_opt.state[ref_params[n]].items()}
            nodes.append((rank, node, opt))
            managers.append(CheckpointManager(tmp_path, rank=rank, ranks=range(8), chunk_bytes=1 << 14))
    for (rank, node, opt), mgr in zip(nodes, managers):
        mgr.save_training(3, node, opt, {"step": 3, "config": cfg4.to_dict(),
                                         "placement": {str(s): r for s, r in placement.items()}},
                          specs=specs, holders=holders, layout={"n_stages": 4, "replicas": 2})
    for mgr in managers:
        mgr.wait()

    r = CheckpointReader(tmp_path)
    assert r.step == 3 and set(r.meta.tensors) == set(ref_tensors)
    assert sorted(r.meta.files) == [f"data-r{k}.bin" for k in range(8)]
    for n, t in r.meta.tensors.items():  # every shard written by a rank holding the tensor
        assert {int(sh.file[6:-4]) for sh in t.shards} <= set(holders[n])
    loads = {int(k): v for k, v in r.meta.layout["bytes_per_rank"].items()}
    for s, ranks in placement.items():  # replicas share their stage's bytes evenly
        a, b = (loads[k] for k in ranks)
        assert abs(a - b) <= (1 << 14) + 4096 and a + b > 0
    assert sum(loads.values()) == sum(t.nbytes for t in r.meta.tensors.values())
    assert set(r.state["ranks"]) == {str(k) for k in range(8)}

    # ---- 2 stages x 4 replicas: each node reads exactly its own tensors' bytes ----------
    read_bytes = []
    orig = reader_mod._pread_all

    def counting(fd, view, off):
        read_bytes.append(memoryview(view).nbytes)
        return orig(fd, view, off)

    monkeypatch.setattr(reader_mod, "_pread_all", counting)
    for s in range(2):
        for _ in range(4):
            node = StagedLM(cfg2.model, stages=[s], seed=5)
            opt = build_adamw(node.named_parameters(), cfg2.train)
            read_bytes.clear()
            CheckpointManager.restore(tmp_path, node, opt)
            got = dict(node.state_dict())
            got.update(_opt_by_name(node, opt))
            mine = [n for n in ref_tensors if tensor_stage(n, node.partition) == s]
            assert sorted(got) == sorted(mine)
            for n in mine:
                assert _bits_equal(got[n], ref_tensors[n]), n
            assert sum(read_bytes) == sum(ref_tensors[n].numel() * ref_tensors[n].element_size() for n in mine)
    monkeypatch.setattr(reader_mod, "_pread_all", orig)

    # ---- a single process: everything, bit-identical, and the loss curve continues --------
    whole = StagedLM(cfg1.model, seed=77)
    whole_opt = build_adamw(whole.named_parameters(), cfg1.train)
    CheckpointManager.restore(tmp_path, whole, whole_opt)
    got = dict(whole.state_dict())
    got.update(_opt_by_name(whole, whole_opt))
    assert sorted(got) == sorted(ref_tensors)
    for n in ref_tensors:
        assert _bits_equal(got[n], ref_tensors[n]), n
    assert split_optim_name("optim.exp_avg.layers.2.ffn.w1.weight") == ("exp_avg", "layers.2.ffn.w1.weight")
    cont_ref = [_step(ref, ref_opt, i) for i in range(3, 7)]
    cont_new = [_step(whole, whole_opt, i) for i in range(3, 7)]
    assert cont_ref == cont_new
