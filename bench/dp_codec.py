"""Bench: the CPU cost of one sparse sync (DeMo, SparseLoCo) against one training step's compute.

One process, one torch thread, the DP race's model (the ``small`` preset narrowed to d_model 128
and 4 layers, 1.8M parameters).  A sync of :class:`~skiptrain.dp.sparse.SparseExchange` is
timed in CPU seconds (``time.process_time``, so other load on the machine does not count): the
top-k and quantisation of every tensor, the payload's encoding, the validation and decoding of
N peers' payloads (the gather itself is replaced by N copies of this replica's payload: the
bytes on the wire are not what is measured here), the average, and the inverse transform.  Beside
it, one forward and backward of a replica's micro-batch (2 x 128 tokens) on the same model, so
the table reads as "a sync costs this fraction of a step's compute".

    .venv/bin/python bench/dp_codec.py --json runs/bench/dp_codec.json
    .venv/bin/python bench/dp_codec.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from skiptrain.config import build_config  # noqa: E402
from skiptrain.dp.sparse import SparseExchange  # noqa: E402
from skiptrain.model import StagedLM  # noqa: E402

MODEL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=4096",
         "model.seq_len=128", "model.n_stages=1"]
CODECS = {"demo k=8 sign1 u12": ["dp.strategy=demo", "dp.topk=8", "dp.indices=u12", "dp.values=sign1"],
          "sparseloco k=40 sign2 u12": ["dp.strategy=sparseloco", "dp.topk=40", "dp.indices=u12", "dp.values=sign2"]}


class Copies:
    """All-gather stand-in: every one of ``n`` peers sent what this replica sent."""

    def __init__(self, n: int):
        self.n, self.rank = n, 0

    def all_gather_bytes(self, buf):
        return [buf.copy() for _ in range(self.n)]


def cpu_ms(fn, repeat: int) -> float:
    """The least CPU milliseconds of ``fn`` over ``repeat`` tries (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return best * 1e3


def step_ms(model: StagedLM, cfg, repeat: int) -> float:
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))

    def one():
        model.zero_grad(set_to_none=True)
        model(x, targets=x)[1].backward()
    return cpu_ms(one, repeat)


def measure(name: str, overrides: list[str], peers: int, repeat: int) -> dict:
    cfg = build_config("small", overrides=MODEL + overrides)
    model = StagedLM(cfg.model)
    named = list(model.named_parameters())
    sx = SparseExchange(named, cfg.dp, Copies(peers))
    acc = sx.zeros()
    gen = torch.Generator().manual_seed(0)
    for a in acc.values():
        a.copy_(torch.randn(a.shape, generator=gen))
    by = "senders" if cfg.dp.strategy == "demo" else "replicas"
    gathered = sx.exchange(acc, 2)
    out = {"codec": name, "peers": peers, "params": sum(p.numel() for _, p in named), "tensors": len(named),
           "payload_bytes": sx.payload_bytes,
           "exchange_ms": cpu_ms(lambda: sx.exchange(acc, 2), repeat),
           "average_ms": cpu_ms(lambda: sx.average(gathered, by=by), repeat),
           "forward_transform_ms": cpu_ms(lambda: [sx.geo[n].forward(p.detach()) for n, p in named], repeat),
           "step_ms": step_ms(model, cfg, repeat)}
    out["sync_ms"] = out["exchange_ms"] + out["average_ms"]
    out["sync_over_step"] = out["sync_ms"] / out["step_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (same code path)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeat = 3 if args.quick else 15
    rows = [measure(n, ov, args.peers, repeat) for n, ov in CODECS.items()]
    print(f"\none sync, {args.peers} peers, CPU ms (least of {repeat}); step = forward + backward of one replica's "
          "micro-batch")
    print(f"{'codec':28s} {'payload B':>9s} {'exchange':>8s} {'average':>8s} {'sync':>7s} {'fwd DCT':>7s} "
          f"{'step':>7s} {'sync/step':>9s}")
    for r in rows:
        print(f"{r['codec']:28s} {r['payload_bytes']:9,d} {r['exchange_ms']:8.1f} {r['average_ms']:8.1f} "
              f"{r['sync_ms']:7.1f} {r['forward_transform_ms']:7.1f} {r['step_ms']:7.1f} {r['sync_over_step']:9.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "quick": args.quick}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
