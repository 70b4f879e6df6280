"""The server's extra sampling options, applied to one request's logits before its pick.

Defined in chapter 12 (serving many users). ``SamplingState`` (chapter 09) holds what the
compiled decode step needs; OpenAI's and vLLM's request fields add more, per request:

- ``logit_bias``: added to the chosen tokens' logits;
- ``min_tokens``: the stop tokens are masked until that many tokens are out (and stop strings
  do not stop it: ``StopText.push``);
- ``presence_penalty`` and ``frequency_penalty``, OpenAI's definitions over the *generated*
  tokens: ``logit - presence * (count > 0) - frequency * count``;
- ``min_p``: drop tokens whose probability (after temperature) is below ``min_p`` times the
  top one's, i.e. logits below ``max + T * ln(min_p)``. Judged here, before the repetition
  penalty that ``SamplingState.pick`` applies (vLLM judges it after).

A request that asks for none of them pays nothing: ``LogitsAdjust.of`` returns None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Extras:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions' echo)
    include_stop_str: bool = False  # keep a matched stop string in the text (vLLM's include_stop_str_in_output)

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.min_p or self.logit_bias
                    or self.min_tokens)


class LogitsAdjust:
    def __init__(self, extras: Extras, stop_ids: tuple[int, ...], temperature: float, greedy: bool,
                 vocab_size: int, device: torch.device):
        self.extras, self.generated = extras, 0
        self.counts = (torch.zeros(vocab_size, device=device)
                       if extras.presence_penalty or extras.frequency_penalty else None)
        self.bias = None
        if extras.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            ids, values = zip(*extras.logit_bias)
            self.bias[list(ids)] = torch.tensor(values, device=device)
        self.stop_ids = [i for i in stop_ids if i < vocab_size]
        # greedy ignores min_p: the top token always passes it
        self.min_p_shift = None if greedy or not extras.min_p else temperature * math.log(extras.min_p)

    @classmethod
    def of(cls, extras: Extras, stop_ids, temperature, greedy, vocab_size, device) -> LogitsAdjust | None:
        return cls(extras, stop_ids, temperature, greedy, vocab_size, device) if extras.adjusts else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(vocab,) float logits -> adjusted ones (a new tensor)."""
        logits = logits.float().clone()
        if self.bias is not None:
            logits += self.bias
        if self.generated < self.extras.min_tokens and self.stop_ids:
            logits[self.stop_ids] = float("-inf")
        if self.counts is not None:
            logits -= self.extras.presence_penalty * (self.counts > 0) + self.extras.frequency_penalty * self.counts
        if self.min_p_shift is not None:
            logits.masked_fill_(logits < logits.max() + self.min_p_shift, float("-inf"))
        return logits

    def observe(self, token: torch.Tensor) -> None:
        """Count a generated token (a 0-d device tensor: no host sync)."""
        self.generated += 1
        if self.counts is not None:
            self.counts[token] += 1


NO_EXTRAS = Extras()
