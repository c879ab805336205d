"""Prepared data sets on disk: token files plus a manifest, and the code that writes them.

A data directory holds

* ``manifest.json``: what was done (sources with sha256, tokenizer, split rule, token counts);
* ``tokenizer.json`` for a BPE tokenizer (none for the byte tokenizer);
* ``train.bin``, ``val.bin`` and optionally ``ood.bin``: flat little-endian token ids (uint16
  when the vocabulary fits, else uint32), read back as numpy memmaps.

Split rule: the last ``val_fraction`` of every document (by characters, cut at a line break)
is validation text, the rest training text, so every document is represented in both and no
text is in both.  Out-of-distribution documents (``ood.bin``) are never trained on.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import DataError
from .corpus import Document
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val", "ood")
#: The largest vocabulary a data set may have (model.vocab_size's maximum).
MAX_VOCAB = 2 ** 24


def split_document(text: str, val_fraction: float) -> tuple[str, str]:
    if val_fraction <= 0:
        return text, ""
    cut = int(len(text) * (1 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl > len(text) * (1 - 2 * val_fraction):
        cut = nl + 1
    return text[:cut], text[cut:]


def _encode_docs(tok: Tokenizer, texts: list[str], sep: list[int]) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch([t for t in texts if t]):
        ids.extend(enc)
        ids.extend(sep)
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    return np.asarray(ids, dtype=dtype)


def write_dataset(out: str | Path, docs: list[Document], ood_docs: list[Document] | None = None,
                  tokenizer: str = "bpe", vocab_size: int = 4096, val_fraction: float = 0.05,
                  source: str = "custom") -> dict:
    """Split, train the tokenizer on the training text, tokenize, write token files and manifest."""
    if not 0.0 < val_fraction < 0.5:
        raise DataError(f"val fraction {val_fraction} must lie in (0, 0.5)")
    if tokenizer == "bpe" and vocab_size < 300:
        raise DataError(f"BPE vocab size {vocab_size} is too small (needs 256 bytes + merges); use >= 300 or --tokenizer byte")
    if tokenizer == "bpe" and vocab_size > MAX_VOCAB:  # (the tokenizer library would allocate for it and abort)
        raise DataError(f"BPE vocab size {vocab_size} is above the largest a model takes ({MAX_VOCAB}); use a "
                        "smaller --vocab-size (e.g. 4096)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    pairs = [split_document(d.text, val_fraction) for d in docs]
    train_texts = [a for a, _ in pairs]
    val_texts = [b for _, b in pairs]
    if tokenizer == "byte":
        tok: Tokenizer = ByteTokenizer()
        sep = [10, 10]
    elif tokenizer == "bpe":
        tok = BPETokenizer.train(train_texts, vocab_size=vocab_size)
        tok.save(out / BPETokenizer.FILE)
        sep = [tok.eot_id]
    else:
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose 'bpe' or 'byte'")
    arrays = {"train": _encode_docs(tok, train_texts, sep), "val": _encode_docs(tok, val_texts, sep)}
    if ood_docs:
        arrays["ood"] = _encode_docs(tok, [d.text for d in ood_docs], sep)
    _write_token_files(out, arrays)
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_by": f"skiptrain {__version__}",
        "created_unix": int(time.time()),
        "source": source,
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size},
        "dtype": str(arrays["train"].dtype),
        "split_rule": f"last {val_fraction:.3f} of every document is validation",
        "val_fraction": val_fraction,
        "tokens": {k: int(v.size) for k, v in arrays.items()},
        "documents": [{"name": d.name, "sha256": d.sha256, "chars": len(d.text)} for d in docs],
        "ood_documents": [{"name": d.name, "sha256": d.sha256, "chars": len(d.text)} for d in (ood_docs or [])],
        "seconds": round(time.time() - t0, 2),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _write_token_files(out: Path, arrays: dict[str, np.ndarray]) -> None:
    """Each split's token file, written whole and then renamed; an interrupted write (Ctrl-C, a
    full disk) leaves no half-written ``.tmp`` file behind."""
    for name, arr in arrays.items():
        tmp = out / f"{name}.bin.tmp"
        try:
            arr.tofile(tmp)
            tmp.replace(out / f"{name}.bin")
        finally:
            tmp.unlink(missing_ok=True)


def write_splits(out: str | Path, base: "TokenDataset", arrays: dict[str, np.ndarray], source: str) -> "TokenDataset":
    """A prepared data directory holding ``arrays`` (split name -> token ids) with ``base``'s
    tokenizer: a data set derived from ``base`` (say, its training split cut to a window range)
    that node processes open by path like any other.  Returns it opened."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v, dtype=base.manifest["dtype"]) for k, v in arrays.items()}
    _write_token_files(out, arrays)
    if (base.path / BPETokenizer.FILE).is_file():
        shutil.copyfile(base.path / BPETokenizer.FILE, out / BPETokenizer.FILE)
    manifest = {**base.manifest, "created_unix": int(time.time()), "source": source,
                "tokens": {k: int(v.size) for k, v in arrays.items()}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return TokenDataset.open(out)


def check_manifest(manifest: dict, mf: Path) -> None:
    """The fields a data set is read by must have their types (``tokenizer.kind``, ``vocab_size``,
    ``dtype``, ``tokens``); a manifest edited by hand or damaged is one line naming the field."""
    tok, tokens = manifest.get("tokenizer"), manifest.get("tokens")
    problem = None
    if not isinstance(tok, dict) or not isinstance(tok.get("kind"), str):
        problem = f"'tokenizer' is {tok!r}, not {{\"kind\": ..., \"vocab_size\": ...}}"
    elif isinstance(tok.get("vocab_size"), bool) or not isinstance(tok.get("vocab_size"), int) \
            or not 2 <= tok["vocab_size"] <= MAX_VOCAB:
        problem = f"'tokenizer.vocab_size' is {tok.get('vocab_size')!r}, not an integer in 2..{MAX_VOCAB}"
    elif manifest.get("dtype") not in ("uint16", "uint32"):
        problem = f"'dtype' is {manifest.get('dtype')!r}, not 'uint16' or 'uint32'"
    elif not isinstance(tokens, dict) or not all(
            isinstance(k, str) and k.isidentifier() and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for k, n in tokens.items()):
        problem = f"'tokens' is {str(tokens)[:80]}, not split names with token counts >= 0"
    if problem:
        raise DataError(f"{mf} is malformed: {problem}; re-run `skiptrain prepare --out {mf.parent}`")


@dataclass
class TokenDataset:
    """A prepared data directory opened for reading."""

    path: Path
    manifest: dict
    tokenizer: Tokenizer
    checked: set = field(default_factory=set, repr=False)  # splits whose token ids were checked

    @classmethod
    def open(cls, path: str | Path) -> "TokenDataset":
        p = Path(path)
        mf = p / MANIFEST
        if not mf.is_file():
            raise DataError(
                f"no prepared data set at {str(p)!r} (missing {MANIFEST}); "
                f"run `skiptrain prepare --out {p}` first")
        try:
            manifest = json.loads(mf.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{mf} is corrupt ({e}); re-run `skiptrain prepare --out {p}`") from None
        if not isinstance(manifest, dict):
            raise DataError(f"{mf} is malformed: it holds a JSON {type(manifest).__name__}, not an object; "
                            f"re-run `skiptrain prepare --out {p}`")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{mf} has format version {manifest.get('format_version')!r}, this skiptrain reads "
                            f"{FORMAT_VERSION}; re-run `skiptrain prepare --out {p}`")
        check_manifest(manifest, mf)
        tok = load_tokenizer(manifest["tokenizer"]["kind"], p)
        ds = cls(p, manifest, tok)
        for split, n in manifest["tokens"].items():
            f = p / f"{split}.bin"
            size = np.dtype(manifest["dtype"]).itemsize * n
            if not f.is_file() or f.stat().st_size != size:
                raise DataError(f"token file {f} is missing or truncated (expected {size} bytes); "
                                f"re-run `skiptrain prepare --out {p}`")
        return ds

    def fingerprint(self) -> str:
        """What makes two copies of this data set the same (its sources, tokenizer, split rule and
        token counts; not when or how fast it was prepared): a SHA-256 hex digest, so hosts that
        each prepared their own copy can check they hold the same data."""
        import hashlib

        same = {k: v for k, v in self.manifest.items() if k not in ("created_unix", "created_by", "seconds")}
        return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def has_split(self, split: str) -> bool:
        return split in self.manifest["tokens"]

    def tokens(self, split: str) -> np.ndarray:
        if split not in self.manifest["tokens"]:
            raise DataError(f"data set {self.path} has no {split!r} split (has {sorted(self.manifest['tokens'])})")
        if int(self.manifest["tokens"][split]) == 0:
            raise DataError(f"the {split!r} split of data set {self.path} is empty (0 tokens); re-run "
                            f"`skiptrain prepare --out {self.path}` with more text or a larger --val-fraction")
        arr = np.memmap(self.path / f"{split}.bin", dtype=self.manifest["dtype"], mode="r")
        if split not in self.checked:
            self.check_ids(split, arr)
            self.checked.add(split)
        return arr

    def split_name(self, split: str) -> str:
        """How errors name ``split`` of this data set."""
        return f"the {split!r} split of data set {self.path}"

    def check_ids(self, split: str, arr: np.ndarray) -> None:
        """Every token id of ``arr`` must be below the vocabulary size (else the embedding would fail)."""
        top = int(arr.max())
        if top >= self.vocab_size:
            pos = int(np.argmax(arr >= self.vocab_size))
            raise DataError(f"{self.path / (split + '.bin')} holds token id {int(arr[pos])} at position {pos}, "
                            f"outside the vocabulary of {self.vocab_size} in {MANIFEST}; the token file does "
                            f"not belong to this manifest: re-run `skiptrain prepare --out {self.path}`")
