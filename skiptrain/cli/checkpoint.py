"""``skiptrain ckpt ls | inspect | verify | reshard`` and ``skiptrain export``.

PATH arguments accept a checkpoint directory (``.../step-00000100``), a checkpoint root
(``RUN_DIR/checkpoints``: its latest committed checkpoint) or a run directory (``RUN_DIR``:
``RUN_DIR/checkpoints``).  Problems (corrupt data, unknown format, missing checkpoint) are one
line naming the file and tensor, and offer the previous committed checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..checkpoint import store
from ..checkpoint.format import METADATA_FILE, CheckpointCorruptError, CheckpointError


def _root(path: str) -> Path:
    p = Path(path)
    if not (p / METADATA_FILE).is_file() and (p / "checkpoints").is_dir():
        return p / "checkpoints"
    return p


def _gib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def cmd_ls(args) -> int:
    root = _root(args.path)
    committed = store.list_committed(root)
    if not committed:
        raise CheckpointError(f"no committed checkpoints under {root}")
    latest = store.latest(root)
    from ..checkpoint.reader import CheckpointReader

    for step, p in committed:
        mark = "*" if latest is not None and p.name == latest.name else " "
        try:
            r = CheckpointReader(p)
            lay = r.meta.layout
            info = (f"{len(r.meta.tensors):5d} tensors  {_gib(r.meta.total_bytes()):>10}  "
                    f"{len(lay.get('writers', [0]))} writer(s)")
        except CheckpointError as e:
            info = f"UNREADABLE: {e}"
        print(f"{mark} {p.name}  step {step:>8}  {info}")
    stale = [e.name for e in root.iterdir() if e.name.startswith((".tmp-", ".trash-"))]
    if stale:
        print(f"  (uncommitted leftovers, ignored: {', '.join(sorted(stale))})")
    return 0


def cmd_inspect(args) -> int:
    from ..checkpoint.reader import CheckpointReader

    r = CheckpointReader(_root(args.path))
    m = r.meta
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
        return 0
    print(f"checkpoint {r.path}\n  step {m.step}, {len(m.tensors)} tensors, {_gib(m.total_bytes())}, "
          f"files: {', '.join(f'{f} ({_gib(n)})' for f, n in sorted(m.files.items()))}")
    print(f"  layout: {json.dumps(m.layout)}")
    for k, v in sorted(m.state.items()):
        s = json.dumps(v)
        print(f"  state.{k}: {s if len(s) <= 100 else s[:97] + '...'}")
    if args.tensors:
        for n, t in sorted(m.tensors.items()):
            shards = ", ".join(f"{s.file}@{s.byte_offset}+{s.nbytes} rows {s.offsets[:1]}" for s in t.shards)
            print(f"  {n:55s} {t.dtype:9s} {str(t.shape):16s} {shards}")
    return 0


def cmd_verify(args) -> int:
    from ..checkpoint.reader import CheckpointReader

    root = _root(args.path)
    targets = ([p for _, p in store.list_committed(root)] if args.all else [root])
    if not targets:
        raise CheckpointError(f"no committed checkpoints under {root}; nothing was verified (pass a checkpoint "
                              "root or a run directory)")
    failed = 0
    for t in targets:
        t0 = time.perf_counter()
        try:
            r = CheckpointReader(t)
            n = r.verify()
            print(f"ok   {r.path}  step {r.step}: {len(r.meta.tensors)} tensors, {_gib(n)} checked "
                  f"in {time.perf_counter() - t0:.2f} s")
        except CheckpointCorruptError as e:
            if not args.all:
                raise
            failed += 1
            print(f"FAIL {e}")
    if failed:
        raise CheckpointError(f"{failed} of {len(targets)} checkpoints failed verification")
    return 0


def cmd_reshard(args) -> int:
    from ..checkpoint.reshard import reshard

    out = reshard(_root(args.src), args.dst, args.stages, args.replicas, args.stage0_layers)
    print(f"resharded -> {out} ({args.stages} stages x {args.replicas} replicas, "
          f"{args.stages * args.replicas} data files)")
    return 0


def cmd_export(args) -> int:
    from ..checkpoint.export import export

    out = export(_root(args.path), args.out, args.format, args.dtype)
    what = "Hugging Face LLaMA (config.json + model.safetensors)" if args.format == "hf" else "safetensors"
    print(f"exported {what} -> {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="list, inspect, verify and reshard checkpoints")
    csub = p.add_subparsers(dest="ckpt_command", metavar="ACTION")
    csub.required = True
    q = csub.add_parser("ls", help="committed checkpoints under a root (* = LATEST)")
    q.add_argument("path", help="checkpoint root or run directory")
    q.set_defaults(func=cmd_ls)
    q = csub.add_parser("inspect", help="metadata of a checkpoint: step, layout, state, tensors")
    q.add_argument("path")
    q.add_argument("--tensors", action="store_true", help="list every tensor and its shards")
    q.add_argument("--json", action="store_true", help="print metadata.json")
    q.set_defaults(func=cmd_inspect)
    q = csub.add_parser("verify", help="read every byte and check every checksum")
    q.add_argument("path")
    q.add_argument("--all", action="store_true", help="every committed checkpoint under the root")
    q.set_defaults(func=cmd_verify)
    q = csub.add_parser("reshard", help="rewrite a checkpoint for another stage/replica layout")
    q.add_argument("src")
    q.add_argument("dst", help="checkpoint root to write")
    q.add_argument("--stages", type=int, required=True)
    q.add_argument("--replicas", type=int, default=1)
    q.add_argument("--stage0-layers", type=int, default=-1, help="layers on stage 0 (-1 = partitioner)")
    q.set_defaults(func=cmd_reshard, written_paths=("DST",))

    p = sub.add_parser("export", help="export a checkpoint to safetensors + Hugging Face LLaMA config.json")
    p.add_argument("path", help="checkpoint, checkpoint root or run directory")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--format", choices=("hf", "skiptrain"), default="hf")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.set_defaults(func=cmd_export, written_paths=("--out",))
