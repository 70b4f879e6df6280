"""One request inside the token loop: its tokens, its blocks, its sampler, its text so far.

Defined in chapter 12 (serving many users); every cached generation of the engine is a sequence too.
A sequence needs ``len(tokens) - computed`` tokens pushed through the model: many after admission (a
prefill, done in chunks), one while it decodes, all of them again after a preemption freed its blocks
(recompute).
Its events: ``PromptLogprobs`` once after the prefill (only when asked for), ``Delta`` as
text comes out (with the logprobs of the tokens since the last one, when asked for), and
one ``Finished``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..sampling.streaming import IncrementalDecoder
from .logprobs import TokenLogprob
from .sampler import RowSampler


@dataclass(frozen=True)
class Delta:
    """New text (possibly empty while a character or a possible stop string is held back)."""

    text: str
    tokens: int  # tokens generated so far
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens since the last Delta, when asked for


@dataclass(frozen=True)
class PromptLogprobs:
    """Each prompt token's logprob given the ones before it; the first has none (None)."""

    entries: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int
    message: str = ""  # for "error"


class StopText:
    """Incremental text with stop strings: text that could still become a stop string is held back."""

    def __init__(self, tokenizer, stops: tuple[str, ...], keep_stop: bool = False):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = tuple(s for s in stops if s)
        self.keep_stop = keep_stop  # the matched stop string stays in the text
        self.text, self.sent = "", 0

    def _release(self, final: bool, may_stop: bool = True) -> tuple[str, bool]:
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0] if may_stop else []
        if hits:
            cut, stop = min(hits)  # the earliest match wins
            cut += len(stop) if self.keep_stop else 0
            self.text = self.text[:cut]
            out, self.sent = self.text[self.sent:], cut
            return out, True
        hold = 0
        if not final:
            for stop in self.stops:  # the longest tail of the text that starts a stop string
                for n in range(min(len(stop) - 1, len(self.text) - self.sent), hold, -1):
                    if self.text.endswith(stop[:n]):
                        hold = n
                        break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def push(self, token_id: int, may_stop: bool = True) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string was hit); ``may_stop`` False (before
        ``min_tokens``) lets a stop string pass as text, as vLLM does."""
        self.text += self.decoder.push(token_id)
        return self._release(final=False, may_stop=may_stop)

    def flush(self) -> str:
        self.text += self.decoder.flush()
        return self._release(final=True)[0]


@dataclass(eq=False)  # compared by identity: two requests may hold equal fields
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams  # every option of the request, ``max_tokens`` set
    text: StopText
    sink: Callable[[object], None]  # receives Delta and Finished events; must not block
    sampler: RowSampler | None = None  # made by the loop's thread when it admits the sequence
    matcher: object = None  # a grammar.GrammarMatcher following ``params.grammar``, or None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    last_token_at: float | None = None
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)  # drained by the next Delta
    prompt_entries: list[TokenLogprob | None] | None = None  # the prompt's logprobs, filled by the prefill
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the cache
    first_token_at: float | None = None
    preemptions: int = 0
    done: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error", once done
    # speculative decoding (chapter 11): the next draft's length, and what the row has drafted, kept, run
    draft_k: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0  # forwards that made a token for it: its prefill's last chunk, each decode or verify step
    made: int = 0  # tokens those forwards made, its stop token included

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def scores_prompt(self) -> bool:
        """It asked for its prompt's logprobs and has not all of them: its prefill must start at
        position 0 and return every position's logits (so a prefix cache must not skip its prompt)."""
        return self.prompt_entries is not None and len(self.prompt_entries) < len(self.prompt_ids)

    @property
    def pending(self) -> int:
        """Tokens still to push through the model before the next token can be picked."""
        return self.length - self.computed


def make_sequence(tokenizer, prompt_ids: list[int], params: SamplingParams, sink=None, request_id: str = "",
                  matcher=None) -> Sequence:
    """A request as the loop holds it. ``params.max_tokens`` must be set (the engine sets it from
    ``max_new_tokens``, the server from the request or the room left in the context)."""
    if params.max_tokens is None:
        raise ValueError("a sequence needs params.max_tokens")
    seq = Sequence(request_id, list(prompt_ids), params, StopText(tokenizer, params.stop, params.include_stop_str),
                   sink or (lambda event: None), matcher=matcher)
    if params.prompt_logprobs is not None:
        seq.prompt_entries = [None]  # the first token has nothing before it
    return seq
