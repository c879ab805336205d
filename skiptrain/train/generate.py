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


def check_request(tokens: int, temperature: float, seed: int = 0, prompt: str = "") -> None:
    """Refuse a token count outside ``[0, MAX_NEW_TOKENS]``, a temperature that is not finite and
    >= 0, a seed a torch generator does not take, or a prompt that is not text (bytes that are not
    UTF-8 reach ``sys.argv`` as lone surrogates, which no tokenizer encodes)."""
    if not 0 <= tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--tokens {tokens} is outside 0..{MAX_NEW_TOKENS} (the most one call samples); "
                        "ask for fewer tokens")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature {temperature} must be a finite number >= 0 (0 = always the most "
                        "likely token)")
    if not -2 ** 63 <= seed < 2 ** 64:
        raise UserError(f"--seed {seed} is outside -2**63..2**64-1 (what a torch generator takes); pass a smaller seed")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"--prompt holds bytes that are not UTF-8 text (character {e.start}); pass the prompt as "
                        "UTF-8 text (e.g. set a UTF-8 locale, LANG=C.UTF-8)") from None


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
