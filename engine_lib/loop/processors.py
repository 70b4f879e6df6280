"""The options OpenAI's and vLLM's requests add to the pick, applied to one request's logits before it.

Defined in chapter 12 (serving many users). ``SamplingState`` (chapter 09) holds what the
compiled decode step needs; these fields of ``SamplingParams`` add more, per request:

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

import torch

from ..sampling import SamplingParams, adjust_logits


class LogitsAdjust:
    """One request's adjustments as ``sampling.adjust_logits`` takes them: a (vocab,) vector to add
    and a min_p floor. The same two feed a pick on the host and a pick inside the server's decode
    step (copied into its batch buffers), so a row picks the same token either way."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device):
        self.params, self.generated, self.vocab_size = params, 0, vocab_size
        self.stop_ids = [i for i in params.stop_token_ids if i < vocab_size]
        self.bias = {int(i): float(v) for i, v in params.logit_bias if i < vocab_size}
        self.counts: dict[int, int] = {}  # generated tokens, for the presence and frequency penalties
        self.add = torch.zeros(vocab_size, device=device)  # (vocab,)
        changed = set(self.bias) | (set(self.stop_ids) if params.min_tokens else set())
        self._refresh(changed)
        # greedy ignores min_p: the top token always passes it
        self.floor_value = -math.inf if params.greedy or not params.min_p else params.temperature * math.log(params.min_p)
        self.floor = torch.full((1, 1), self.floor_value, device=device)

    @classmethod
    def of(cls, params: SamplingParams, vocab_size: int, device) -> LogitsAdjust | None:
        return cls(params, vocab_size, device) if params.adjusts else None

    def value(self, token: int) -> float:
        """What ``add`` holds for ``token`` now."""
        if self.generated < self.params.min_tokens and token in self.stop_ids:
            return -math.inf
        count = self.counts.get(token, 0)
        return (self.bias.get(token, 0.0) - self.params.presence_penalty * (count > 0)
                - self.params.frequency_penalty * count)

    def _refresh(self, tokens) -> None:
        tokens = sorted(tokens)
        if tokens:  # one small write: a step changes one token's entry (two or so when min_tokens is met)
            values = torch.tensor([self.value(t) for t in tokens])
            self.add[torch.tensor(tokens, device=self.add.device)] = values.to(self.add.device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(vocab,) logits -> adjusted float ones (a new tensor)."""
        return adjust_logits(logits.float()[None], self.add[None], self.floor)[0]

    def observe(self, token: int) -> None:
        """Count a generated token (its id, on the host)."""
        self.generated += 1
        changed = set()
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1
            changed.add(token)
        if self.generated == self.params.min_tokens:  # the stop tokens may come from now on
            changed.update(self.stop_ids)
        self._refresh(changed)


