"""Choosing the next token on the device: greedy, temperature, top-k, top-p and repetition penalty.

Defined in chapter 09 (beyond greedy). Every row of a batch has its own settings (``params.SamplingParams``),
held as device tensors in fixed buffers (``SamplingState``), so one compiled, graph-captured decode step
serves any mix of requests. Picking a token stays on the device: sampling uses the exponential race
(argmax of p / Exp(1) noise), which draws from p with no host sync; the noise is drawn from the request's
seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import SamplingParams

# top-k sampling looks at this many candidates whatever its k (up to it): one compiled shape
TOP_K_CANDIDATES = 64


@dataclass(frozen=True)
class PickMode:
    """The static shape of a pick: one compiled (and captured) variant per distinct mode.

    There are four by design (``PICK_MODES``): greedy with or without a repetition penalty,
    and sampling over the top ``TOP_K_CANDIDATES`` or over the whole vocabulary.
    """

    greedy: bool  # every row greedy: a plain argmax, nothing else
    penalize: bool  # some row has a repetition penalty
    candidates: int  # how many top logits sampling looks at (the largest top_k, rounded up; vocab if off)
    adjusted: bool = False  # rows' logits adjusted first (``adjust_logits``): the server's step, chapter 12


def non_finite(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., vocab) -> (...) bool: True where a row holds a NaN or an Inf. Two reductions, no
    (..., vocab) temporaries: a NaN carries through the max and the min, +Inf shows in the max, -Inf in the
    min. Measured on a 2-core CPU, one 151,936-logit row: 23 us, where ``~isfinite(x).all(-1)`` took 167."""
    return ~(torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1)))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor | float) -> torch.Tensor:
    """As in transformers: positive logits of seen tokens / penalty, negative ones * penalty.

    logits: (batch, vocab) float; seen: (batch, vocab) bool, over prompt and generated tokens;
    penalty: a number or (batch, 1), 1.0 = off.
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def adjust_logits(logits: torch.Tensor, add: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The server's per-request adjustments in two tensors, so a batch applies them in one go.

    logits, add: (batch, vocab) float; ``add`` holds logit_bias minus the presence and frequency
    penalties, and -inf on tokens that may not come yet (min_tokens). floor: (batch, 1), min_p's
    shift T * ln(min_p) (-inf = off): a logit below its row's max + floor is dropped.
    """
    logits = logits + add
    return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + floor, float("-inf"))


def top_candidates(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k, then top-p, survivors among the ``candidates`` highest scores, without a full sort.

    scores: (batch, vocab), already divided by the temperature; top_k (batch, 1) long, 0 = off;
    top_p (batch, 1). -> probs (batch, candidates), 0 for dropped ones, and their token ids.
    Top-p keeps the smallest prefix of the sorted candidates whose mass reaches top_p (the most
    likely token always survives), as transformers' warpers do after top-k.
    """
    values, ids = scores.topk(candidates, dim=-1)  # (batch, candidates), sorted descending
    rank = torch.arange(candidates, device=scores.device)
    values = values.masked_fill((top_k > 0) & (rank >= top_k), float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked candidates
    return probs.masked_fill(mass_before >= top_p, 0.0), ids


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Full-vocabulary view of ``top_candidates``: every dropped logit set to -inf (for teaching and tests)."""
    b, vocab = logits.shape
    k = torch.full((b, 1), top_k, device=logits.device)
    p = torch.full((b, 1), top_p, device=logits.device)
    probs, ids = top_candidates(logits, k, p, min(top_k, vocab) if top_k > 0 else vocab)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, probs > 0)
    return logits.masked_fill(~keep, float("-inf"))


class SamplingState:
    """Per-row sampling settings in fixed device buffers, loaded for each request.

    A captured CUDA graph reads these buffers by address, so a new request copies its
    settings into them instead of making new tensors.
    """

    def __init__(self, batch: int, vocab_size: int, device: torch.device):
        self.batch, self.vocab_size, self.device = batch, vocab_size, device
        col = dict(device=device, dtype=torch.float32)
        self.temperature = torch.ones(batch, 1, **col)
        self.top_p = torch.ones(batch, 1, **col)
        self.penalty = torch.ones(batch, 1, **col)
        self.top_k = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.greedy_rows = torch.ones(batch, 1, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
        self.noise: dict[int, torch.Tensor] = {}  # candidates -> (batch, candidates) Exp(1) draws
        self.add: torch.Tensor | None = None  # (batch, vocab) and (batch, 1) for adjust_logits, where a
        self.floor: torch.Tensor | None = None  # server's step picks adjusted rows (its PickMode.adjusted)
        self.generators: list[torch.Generator] = []
        self.mode = PickMode(True, False, 1)

    def load(self, rows: list[SamplingParams]) -> PickMode:
        """Copy one request's settings (one SamplingParams per row) into the buffers."""
        if len(rows) != self.batch:
            raise ValueError(f"{len(rows)} sampling settings for a batch of {self.batch}")
        greedy = all(p.greedy for p in rows)
        # sampling always applies the penalty (1.0 divides and multiplies exactly): one mode fewer
        penalize = not greedy or any(p.repetition_penalty != 1.0 for p in rows)
        top_ks = [p.top_k for p in rows if not p.greedy]
        if greedy:
            candidates = 1
        elif 0 in top_ks or max(top_ks) > min(TOP_K_CANDIDATES, self.vocab_size):
            candidates = self.vocab_size  # top-k off (or large): top-p needs the whole sorted vocabulary
        else:
            candidates = min(TOP_K_CANDIDATES, self.vocab_size)
        cpu = dict(dtype=torch.float32)
        self.temperature.copy_(torch.tensor([[p.temperature if not p.greedy else 1.0] for p in rows], **cpu))
        self.top_p.copy_(torch.tensor([[p.top_p] for p in rows], **cpu))
        self.penalty.copy_(torch.tensor([[p.repetition_penalty] for p in rows], **cpu))
        self.top_k.copy_(torch.tensor([[p.top_k] for p in rows]))
        self.greedy_rows.copy_(torch.tensor([[p.greedy] for p in rows]))
        self.seen.zero_()
        self.generators = []
        if not greedy:
            if candidates not in self.noise:
                self.noise[candidates] = torch.ones(self.batch, candidates, device=self.device)
            # one generator for a batch that shares its settings, else one per row
            shared = all(p is rows[0] for p in rows)
            for p in rows[:1] if shared else rows:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
                self.generators.append(gen)
        self.mode = PickMode(greedy, penalize, candidates)
        return self.mode

    def observe(self, token_ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Mark prompt tokens as seen for the repetition penalty. token_ids, valid: (batch, n)."""
        if not self.mode.penalize:
            return
        hits = torch.ones_like(token_ids, dtype=torch.int32) if valid is None else valid.int()
        counts = torch.zeros(self.seen.shape, dtype=torch.int32, device=self.device)
        counts.scatter_add_(1, token_ids, hits)  # padding positions add 0
        self.seen |= counts > 0

    def _fill(self, out: torch.Tensor, kind: str) -> torch.Tensor:
        """Fill (batch, ...) ``out`` in place from the generators: one draw when the batch shares
        one, else row by row. ``uniform`` on [0, 1) or ``exponential`` Exp(1)."""
        draw = (lambda t, g: t.uniform_(generator=g)) if kind == "uniform" else (lambda t, g: t.exponential_(generator=g))
        if len(self.generators) == 1:
            draw(out, self.generators[0])
        else:
            for row, gen in enumerate(self.generators):
                draw(out[row], gen)
        return out

    def draw_noise(self) -> None:
        """Fresh Exp(1) noise for the next pick (one kernel; nothing when every row is greedy)."""
        if not self.mode.greedy:
            self._fill(self.noise[self.mode.candidates], "exponential")

    def random(self, shape: tuple[int, ...], kind: str = "uniform") -> torch.Tensor:
        """(batch, ...) draws from each row's generator: ``uniform`` on [0, 1) or ``exponential`` Exp(1)."""
        return self._fill(torch.empty((self.batch, *shape), device=self.device), kind)

    def mark_seen(self, tokens: torch.Tensor) -> None:
        """Mark tokens (batch, n) as seen, for the repetition penalty of later steps."""
        if self.mode.penalize:
            rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
            self.seen[rows.expand_as(tokens), tokens] = True

    def pick(self, logits: torch.Tensor, mode: PickMode) -> torch.Tensor:
        """(batch, vocab) logits -> (batch,) token ids. Device ops only: safe to compile and capture."""
        logits = logits.float()
        if mode.adjusted:
            logits = adjust_logits(logits, self.add, self.floor)
        if mode.penalize:
            logits = apply_repetition_penalty(logits, self.seen, self.penalty)
        # max's indices are argmax's (the first of equal maxima), in a third of its time on a CPU: measured on
        # 2 cores, one 151,936-logit fp32 row, 66 against 205 us
        token = logits.max(dim=-1).indices
        if not mode.greedy:
            probs, ids = top_candidates(logits / self.temperature, self.top_k, self.top_p, mode.candidates)
            noise = self.noise[mode.candidates].clamp_min(1e-30)  # Exp(1) can draw 0: 0/0 would win
            choice = (probs / noise).argmax(dim=-1, keepdim=True)  # the race
            token = torch.where(self.greedy_rows[:, 0], token, ids.gather(1, choice)[:, 0])
        if mode.penalize:  # index_put_ on the buffer itself: no (batch, vocab) copy in a compiled step
            self.seen[torch.arange(token.shape[0], device=token.device), token] = True
        return token


def pick_modes(vocab_size: int, adjusted: bool = False) -> list[PickMode]:
    """Every mode ``SamplingState.load`` can return: the compiled step's variants per batch class.
    The server's step (``adjusted``) adjusts the logits in every mode but plain greedy: still four."""
    return [PickMode(True, False, 1), PickMode(True, True, 1, adjusted),
            PickMode(False, True, min(TOP_K_CANDIDATES, vocab_size), adjusted), PickMode(False, True, vocab_size, adjusted)]
