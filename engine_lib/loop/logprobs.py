"""Token logprobs: computed in the scheduler from the model's raw logits, shaped for the API by ``responses``.

Defined in chapter 13 (an API for agents and evaluators). A logprob here is ``log_softmax`` of the model's
own logits for that position: the raw distribution, before temperature, penalties, bias
and top-k/top-p/min-p, as vLLM reports by default. At temperature 0 the chosen token is
the argmax of those logits (unless a penalty or a bias moved it), so it is the top entry.
The scheduler sends token ids and floats only; turning ids into text happens in the HTTP
layer, off the model's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens, best first


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits (n, vocab), the token taken at each row, how many alternatives each row wants
    -> one ``TokenLogprob`` per row (one host copy for the lot)."""
    lp = logits.float().log_softmax(dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    if k:
        values, ids = lp.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, p, tuple(zip(ids[i][:ks[i]], values[i][:ks[i]])) if k else ())
            for i, (t, p) in enumerate(zip(chosen, picked))]


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what Qwen2's BPE tokens are spelled in) -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (a byte-level BPE piece may be part of a character)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_of_char()
    if piece is not None and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return tokenizer.decode([token_id]).encode()  # special and added tokens are spelled as themselves


class TokenText:
    """Token id -> (text, bytes), memoised per server (the vocabulary does not change)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self.cache:
            raw = token_bytes(self.tokenizer, token_id)
            self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self.cache[token_id]
