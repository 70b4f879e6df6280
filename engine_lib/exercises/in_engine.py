"""The reader's own piece inside the engine, for a real generation: the exercises that change the engine.

A check hands the reader's function to a small engine (the tiny random checkpoint, fp32, the ``kv_cache``
rung) in place of the engine's own piece, generates greedily with it, and compares the whole generation
with the engine's own run of the same prompt: every token, and the logits at every position of prompt and
reply. Used by exercises 02.1 (the reader's RMSNorm in every layer) and 11.1 (the reader's prompt lookup
as the drafter of speculative decoding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..model.layers.rmsnorm import RMSNorm
from ._grading import Mismatch, expect_tensor, expect_tokens, tiny_engine

PROMPT = [9707, 11, 1879, 0, 1096, 374, 264, 1273, 13, 9707, 11, 1879, 0, 1096, 374]  # repeats itself
NEW_TOKENS = 8


@dataclass
class Generation:
    tokens: list[int]  # the reply's ids
    logits: torch.Tensor  # (prompt + reply, vocab) fp32: one forward over the whole sequence
    extra: dict  # the result's counts (speculative decoding's drafted and accepted tokens)


def generation(engine) -> Generation:
    """``NEW_TOKENS`` greedy tokens after ``PROMPT``, then the logits of the whole sequence, both with ``engine``."""
    r = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, stop_token_ids=[])
    return Generation(list(r.token_ids), engine.logits(PROMPT + list(r.token_ids)), dict(r.extra))


def expect_same_generation(got: Generation, want: Generation, whose: str, atol: float = 1e-4) -> None:
    """The reply token for token, then the logits at every position, against the engine's own run."""
    expect_tokens(got.tokens, want.tokens, len(PROMPT))
    expect_tensor(got.logits, want.logits, f"{whose} logits over prompt and reply", atol=atol, rtol=atol)


@contextmanager
def norms_replaced(model, rms_norm: Callable) -> Iterator[int]:
    """Every RMSNorm of ``model`` runs ``rms_norm(x, weight, eps)`` instead of its own forward (restored on
    exit). -> how many norms were replaced."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.forward = lambda x, norm=norm: rms_norm(x, norm.weight, norm.eps)
    try:
        yield len(norms)
    finally:
        for norm in norms:
            del norm.forward


def rms_norm_in_engine(rms_norm: Callable) -> None:
    """Raise ``Mismatch`` unless the engine, with every RMSNorm replaced by the reader's, generates exactly
    what it generates with its own."""
    engine = tiny_engine()
    want = generation(engine)
    with torch.inference_mode(), norms_replaced(engine.model, rms_norm) as n:
        got = generation(engine)
    if n == 0:
        raise Mismatch("the engine has no RMSNorm to replace")
    expect_same_generation(got, want, f"the engine with your RMSNorm in all {n} norms:")


class ReadersLookup:
    """A drafter for the engine's token loop made of the reader's ``lookup(context, k, max_ngram)``."""

    name = "your prompt lookup"

    def __init__(self, lookup: Callable, max_ngram: int = 3):
        self.lookup, self.max_ngram = lookup, max_ngram

    def start(self, cache) -> None:
        pass

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        return [[int(t) for t in self.lookup(list(seq.tokens), k, self.max_ngram)][:k] for seq, k in requests]


def lookup_in_engine(lookup: Callable) -> None:
    """Raise ``Mismatch`` unless a greedy generation drafted by the reader's lookup is plain greedy's, token
    for token and logit for logit, and drafts and accepts as many tokens as the engine's own prompt lookup."""
    from ..engine import Engine
    from ..speculative import PromptLookup

    base = tiny_engine()

    def speculating(drafter):
        return Engine(base.model, base.tokenizer, base.model_dir, base.stage, base.device, speculative=drafter)

    plain, own = generation(base), generation(speculating(PromptLookup(3)))
    got = generation(speculating(ReadersLookup(lookup)))
    expect_same_generation(got, plain, "the reply drafted by your lookup:")
    for key in ("drafted", "accepted"):
        if got.extra.get(key) != own.extra.get(key):
            raise Mismatch(f"drafting with your lookup, the engine {key} {got.extra.get(key)} tokens; with its own "
                           f"prompt lookup it {key} {own.extra.get(key)}")
