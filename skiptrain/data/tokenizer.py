"""Tokenizers: a byte-level BPE trained with HF ``tokenizers``, and a file-less byte tokenizer.

Both expose ``vocab_size``, ``encode(str) -> list[int]``, ``encode_batch``, ``decode(list[int])``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

from ..errors import DataError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train or store. Used by tests."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation), trained offline in about a second per 5 MB."""

    kind = "bpe"
    FILE = "tokenizer.json"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=2, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"])
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        if not p.is_file():
            raise DataError(f"tokenizer file {str(p)!r} is missing; re-run `skiptrain prepare`")
        try:
            return cls(HFTokenizer.from_file(str(p)))
        except Exception as e:  # the library raises a plain Exception on malformed JSON
            raise DataError(f"tokenizer file {str(p)!r} is unreadable ({e}); re-run `skiptrain prepare`") from None

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def eot_id(self) -> int:
        return self._tok.token_to_id("<|endoftext|>")


def load_tokenizer(kind: str, data_dir: str | Path | None = None) -> Tokenizer:
    """``byte`` needs nothing; ``bpe`` loads ``tokenizer.json`` from the data directory."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if data_dir is None:
            raise DataError("a BPE tokenizer needs the prepared data directory")
        return BPETokenizer.load(Path(data_dir) / BPETokenizer.FILE)
    raise DataError(f"unknown tokenizer kind {kind!r}; expected 'bpe' or 'byte'")
