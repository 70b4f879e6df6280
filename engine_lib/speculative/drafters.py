"""Speculative decoding's drafters: a cheap guess at a sequence's next tokens, which one forward then verifies.

Defined in chapter 11 (more tokens per read). A decode step reads every weight to score one position; a
verify step reads them once to score k + 1 (the newest token and k drafted ones), and every drafted token
the model agrees with is a token for free (``verify.verify_tokens``). The token loop asks its drafter for
each speculating row's draft (``propose``: the row's sequence and how many tokens at most) and runs the
verify forward itself (``loop.engine_core``), so every drafter runs under the same scheduler, runner and
output processor as plain decoding.

- ``PromptLookup`` copies what followed the latest occurrence of the context's last n-gram (free to draft);
- ``DraftModel`` runs a smaller model with the same vocabulary greedily, through a cache of its own;
- ``Replay`` proposes a known continuation (a forced acceptance rate, to show the mechanics where random
  weights make real acceptance meaningless).
"""

from __future__ import annotations

import weakref

import torch

from ..cache.contiguous import KVCache
from ..errors import UnsupportedOptionError
from ..step.forward import Row, contiguous_forward


class PromptLookup:
    """Draft by lookup: the longest recent n-gram (n = max_ngram..1) that occurred earlier in the
    context proposes the tokens that followed its latest earlier occurrence."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, cache) -> None:
        pass

    @staticmethod
    def draft_start(context: list[int], max_ngram: int = 3) -> int | None:
        """Where the draft begins in ``context``: just after the latest earlier occurrence of its
        longest recurring tail n-gram (n = max_ngram, ..., 1); None when no tail recurs."""
        for n in range(min(max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest earlier occurrence first
                if context[start:start + n] == tail:
                    return start + n  # < len(context): at least one token follows
        return None

    @staticmethod
    def lookup(context: list[int], k: int, max_ngram: int = 3) -> list[int]:
        """The up to ``k`` tokens that followed the match (``draft_start``), or [] without one."""
        at = PromptLookup.draft_start(context, max_ngram)
        return [] if at is None else context[at:at + k]

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """(sequence, at most k tokens) per row -> each row's draft (maybe shorter, maybe empty)."""
        return [self.lookup(seq.tokens, k, self.max_ngram) for seq, k in requests]


class Replay:
    """Proposes a known continuation of each prompt (e.g. plain greedy's own output): acceptance is forced,
    to measure what speculation buys at a given acceptance rate. ``continuations[i]`` continues
    ``prompts[i]``; without ``prompts``, one continuation serves every request."""

    name = "replay"

    def __init__(self, continuations: list[list[int]], prompts: list[list[int]] | None = None):
        if prompts is None and len(continuations) != 1:
            raise UnsupportedOptionError("Replay: give the prompts the continuations continue, or one continuation")
        self.by_prompt = {tuple(p): c for p, c in zip(prompts, continuations)} if prompts is not None else None
        self.only = continuations[0] if prompts is None else None

    def start(self, cache) -> None:
        pass

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        out = []
        for seq, k in requests:
            cont = self.only if self.by_prompt is None else self.by_prompt.get(tuple(seq.prompt_ids), [])
            done = len(seq.output_ids)  # tokens generated so far
            out.append(list(cont[done:done + k]))
        return out


class DraftModel:
    """A smaller model with the same vocabulary drafts greedily through a contiguous cache of its own, one row
    per row of the target's (so it drafts for the engine's generations, whose cache is chapter 05's).

    Each round feeds it the tokens of the sequence its cache does not hold yet (after a verify, the ones the
    target kept past its last draft, and the target's own next token), then k - 1 of its own drafts. What
    its cache holds is remembered per sequence, so a rejected draft's slots are simply written over later.
    """

    name = "draft_model"

    def __init__(self, model):
        self.model = model
        self.cache: KVCache | None = None
        self.held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> tokens its row holds

    def start(self, cache) -> None:
        """A cache like the target's ``cache`` (rows, slots), made when the target's is."""
        if not isinstance(cache, KVCache):
            raise UnsupportedOptionError("a draft model drafts beside the engine's contiguous cache; a server "
                                         "(paged cache) takes speculative='prompt_lookup'")
        cfg = self.model.config
        if self.cache is None or (self.cache.batch, self.cache.max_len) != (cache.batch, cache.max_len):
            self.cache = None  # free the old buffers first
            self.cache = KVCache(cfg.num_hidden_layers, cache.batch, cfg.num_key_value_heads, cfg.head_dim,
                                 cache.max_len, self.model.dtype, self.model.device)
        self.held = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        rows = []
        for seq, _ in requests:
            held, tokens = self.held.get(seq, []), seq.tokens
            same = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
            same = min(same, len(tokens) - 1)  # the newest token is always fed: its logits draft the first token
            rows.append(Row(tokens[same:], same, seq.blocks[:1]))
        drafts = [[] for _ in requests]
        for step in range(max(k for _, k in requests)):
            live = [i for i, (_, k) in enumerate(requests) if k > step]
            if step:
                rows = [Row([drafts[i][-1]], len(requests[i][0].tokens) + step - 1, requests[i][0].blocks[:1])
                        for i in live]
            picks = contiguous_forward(self.model, self.cache, rows).argmax(-1).tolist()  # (rows,)
            for i, token in zip(live, picks):
                drafts[i].append(token)
        for (seq, k), draft in zip(requests, drafts):
            self.held[seq] = seq.tokens + draft[:k - 1]  # the last draft was never fed
        return drafts
