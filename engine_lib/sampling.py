"""Choosing the next token: greedy, temperature, top-k, top-p and repetition penalty.

Defined in chapter 09 (beyond greedy). Defaults come from the checkpoint's
``generation_config.json``, as in ``transformers``. Everything stays on the device:
sampling uses the exponential-race trick (argmax of p / Exp(1) noise), which draws from
p without the host sync that ``torch.multinomial`` can cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .errors import UnsupportedOptionError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``do_sample=False`` or ``temperature=0`` means greedy (argmax)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UnsupportedOptionError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UnsupportedOptionError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UnsupportedOptionError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise UnsupportedOptionError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_generation_config(cls, path: str | Path) -> SamplingParams:
        """The checkpoint's defaults (Qwen2.5-Instruct: sample, T=0.7, top-p 0.8, top-k 20, penalty 1.1)."""
        path = Path(path)
        if not path.is_file():
            return cls()
        raw = json.loads(path.read_text())
        eos = raw.get("eos_token_id", [])
        return cls(do_sample=bool(raw.get("do_sample", False)),
                   temperature=float(raw.get("temperature", 1.0)),
                   top_k=int(raw.get("top_k", 0) or 0), top_p=float(raw.get("top_p", 1.0)),
                   repetition_penalty=float(raw.get("repetition_penalty", 1.0)),
                   stop_token_ids=tuple(eos if isinstance(eos, list) else [eos]))

    def merged(self, **overrides) -> SamplingParams:
        """Apply a call's options. ``do_sample=False`` alone gives *plain* greedy: unlike
        ``transformers``, the checkpoint's repetition penalty is not kept unless asked for."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("do_sample") is False or given.get("temperature") == 0:
            given.setdefault("repetition_penalty", 1.0)
        if "stop_token_ids" in given:
            given["stop_token_ids"] = tuple(given["stop_token_ids"])
        return replace(self, **given)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """As in transformers: positive logits of seen tokens / penalty, negative ones * penalty.

    logits: (batch, vocab) float; seen: (batch, vocab) bool, over prompt and generated tokens.
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus (keeps >= 1)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1:] = False  # the most likely token always survives
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Turns (batch, vocab) logits into (batch,) token ids, on the device, with no host sync."""

    def __init__(self, params: SamplingParams, vocab_size: int, batch: int, device: torch.device):
        self.params = params
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None
                                       else int(torch.randint(0, 2**62, (1,)).item()))

    def observe(self, token_ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Mark prompt tokens as seen for the repetition penalty. token_ids, valid: (batch, n)."""
        if self.seen is None:
            return
        hits = torch.ones_like(token_ids, dtype=torch.int32) if valid is None else valid.int()
        counts = torch.zeros(self.seen.shape, dtype=torch.int32, device=self.seen.device)
        counts.scatter_add_(1, token_ids, hits)  # padding positions add 0
        self.seen |= counts > 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        p = self.params
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, p.repetition_penalty)
        if p.greedy:
            token = logits.argmax(dim=-1)
        else:
            logits = filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
            probs = logits.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(1, generator=self.generator)
            token = (probs / noise).argmax(dim=-1)
        if self.seen is not None:
            self.seen.scatter_(1, token[:, None], True)
        return token
