"""Each request's own token choice inside a shared batch.

Defined in chapter 12 (serving many users). Rows come and go every step, so the
per-request state lives with the request: its seeded generator and, with a repetition
penalty, the tokens it has seen. A row draws exactly what ``SamplingState`` draws for a
batch of one (same candidates, same Exp(1) noise from the same generator, in the same
order), so a seeded request gives the same tokens in a busy server as alone.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, apply_repetition_penalty, top_candidates


class RowSampler:
    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device):
        self.params, self.device = params, device
        self.greedy = params.greedy
        self.penalize = params.repetition_penalty != 1.0
        if self.greedy:
            self.candidates = 1
        elif params.top_k == 0 or params.top_k >= vocab_size:
            self.candidates = vocab_size
        else:  # as SamplingState.load: rounded up to a power of two
            self.candidates = min(1 << (params.top_k - 1).bit_length(), vocab_size)
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            self.generator.manual_seed(seed)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device) if self.penalize else None
        # (1, 1) tensors, as SamplingState holds them: dividing by a tensor, not a Python number,
        # keeps the arithmetic (and so the draws' winners) bit-identical to a batch of one
        col = dict(dtype=torch.float32, device=device)
        self.temperature = torch.tensor([[params.temperature if not self.greedy else 1.0]], **col)
        self.top_p = torch.tensor([[params.top_p]], **col)
        self.penalty = torch.tensor([[params.repetition_penalty]], **col)
        self.top_k = torch.tensor([[params.top_k]], device=device)

    def observe(self, token_ids: list[int]) -> None:
        """Mark the prompt's tokens as seen (repetition penalty)."""
        if self.seen is not None:
            self.seen[torch.tensor(token_ids, device=self.device)] = True

    def pick(self, logits: torch.Tensor) -> int:
        """logits: (vocab,) -> the next token id."""
        logits = logits.float()[None]  # (1, vocab)
        if self.penalize:
            logits = apply_repetition_penalty(logits, self.seen[None], self.penalty)
        if self.greedy:
            token = int(logits.argmax(dim=-1))
        else:
            noise = torch.empty(1, self.candidates, device=self.device).exponential_(generator=self.generator)
            probs, ids = top_candidates(logits / self.temperature, self.top_k, self.top_p, self.candidates)
            choice = (probs / noise.clamp_min(1e-30)).argmax(dim=-1, keepdim=True)
            token = int(ids.gather(1, choice))
        if self.seen is not None:
            self.seen[token] = True
        return token


def pick_rows(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """(batch, vocab) -> one token per row; the plain-greedy rows share one argmax."""
    plain = [i for i, s in enumerate(samplers) if s.greedy and not s.penalize]
    out = [0] * len(samplers)
    if plain:
        best = logits[plain].float().argmax(dim=-1).tolist()
        for i, tok in zip(plain, best):
            out[i] = tok
    for i, s in enumerate(samplers):
        if not (s.greedy and not s.penalize):
            out[i] = s.pick(logits[i])
    return out
