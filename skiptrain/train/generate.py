"""Sampling text from a trained model, one token at a time, so output streams as it is made.

``skiptrain generate`` writes each new token as soon as it is sampled; the number of new tokens
is capped at :data:`MAX_NEW_TOKENS` (each token re-runs the model over up to ``seq_len`` tokens
of context, so a huge request would otherwise run for days).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Sequence

from ..errors import UserError

#: The most new tokens one ``skiptrain generate`` call samples.
MAX_NEW_TOKENS = 10_000


def check_request(tokens: int, temperature: float) -> None:
    """Refuse a token count outside ``[0, MAX_NEW_TOKENS]`` or a temperature that is not finite and >= 0."""
    if not 0 <= tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--tokens {tokens} is outside 0..{MAX_NEW_TOKENS} (the most one call samples); "
                        "ask for fewer tokens")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature {temperature} must be a finite number >= 0 (0 = always the most "
                        "likely token)")


def sample_tokens(model, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.8,
                  top_k: int | None = 50, route: Sequence[int] | None = None, generator=None) -> Iterator[int]:
    """Yield ``max_new_tokens`` sampled token ids continuing ``prompt`` (context cropped to seq_len).

    Samples the same tokens as ``StagedLM.generate`` with the same ``torch.Generator``.
    """
    import torch

    tokens = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(max_new_tokens):
        nxt = model.sample_next(tokens, temperature, top_k, route, generator)
        tokens = torch.cat([tokens, nxt], dim=1)
        yield int(nxt.item())


def stream_text(tok, ids: Iterable[int], write: Callable[[str], object]) -> str:
    """Decode ``ids`` with the tokenizer ``tok`` as they come and ``write`` each piece; returns the whole text.

    Ids that decode to an incomplete character (a multi-byte UTF-8 sequence split over tokens) are
    held back until the character is complete (or the stream ends).
    """
    pending: list[int] = []
    out: list[str] = []
    for i in ids:
        pending.append(i)
        piece = tok.decode(pending)
        if piece.endswith("\ufffd") and len(pending) < 8:
            continue
        write(piece)
        out.append(piece)
        pending = []
    if pending:
        piece = tok.decode(pending)
        write(piece)
        out.append(piece)
    return "".join(out)
