"""Each request's own token choice inside a shared batch.

Defined in chapter 12 (serving many users). Rows come and go every step, so the
per-request state lives with the request: a ``SamplingState`` for a batch of one, with its
seeded generator and, with a repetition penalty, the tokens it has seen. A row therefore
draws exactly what ``Engine.generate`` draws for that request alone (same candidates, same
Exp(1) noise from the same generator, in the same order), so a seeded request gives the same
tokens in a busy server as alone. The server's extra options (``processors``) adjust a row's
logits before that pick (``took`` counts each picked token for them). A row with a grammar
(structured output, forced tool calls) then has its logits masked to the tokens the grammar
allows, and its matcher advanced after the pick; a row without one pays nothing for that.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, SamplingState
from .processors import LogitsAdjust


class RowSampler:
    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device, grammar=None):
        self.params = params
        self.state = SamplingState(1, vocab_size, device)
        self.mode = self.state.load([params])
        self.adjust = LogitsAdjust.of(params, vocab_size, device)
        self.grammar = grammar  # a grammar.GrammarMatcher following params.grammar, or None

    @property
    def in_step(self) -> bool:
        """Picked inside the decode step, batched with the other rows (its logits adjustment copied
        into the step's buffers): every row but one with a grammar, whose mask is made on the host."""
        return self.grammar is None

    @property
    def plain_greedy(self) -> bool:
        """Argmax with no penalty: nothing per request, so such rows can share one argmax."""
        return self.mode.greedy and not self.mode.penalize and self.adjust is None and self.grammar is None

    def observe(self, token_ids: list[int]) -> None:
        """Mark the prompt's tokens as seen (repetition penalty)."""
        self.state.observe(torch.tensor([token_ids], device=self.state.device))

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (vocab,) -> the next token id, a 0-d tensor on the device (no host sync)."""
        if self.adjust is not None:
            logits = self.adjust(logits)
        if self.grammar is not None:  # after the penalties and biases: a forbidden token stays at -inf
            logits = self.grammar.mask_logits(logits)
        self.state.draw_noise()
        token = self.state.pick(logits[None], self.mode)[0]
        if self.grammar is not None:
            self.grammar.advance(int(token))  # a host sync, for grammar rows only: the next mask needs it
        return token

    def took(self, token: int) -> None:
        """The row's picked token, wherever it was picked: counted for its adjustments."""
        if self.adjust is not None:
            self.adjust.observe(token)


def pick_rows(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """(batch, vocab) -> one token per row; the plain-greedy rows share one argmax, and the
    whole batch reaches the host in one copy."""
    tokens: list[torch.Tensor | None] = [None] * len(samplers)
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if plain:
        for i, token in zip(plain, logits[plain].float().argmax(dim=-1)):
            tokens[i] = token
    for i, s in enumerate(samplers):
        if tokens[i] is None:
            tokens[i] = s.pick(logits[i])
    return torch.stack(tokens).tolist()
