"""Keeping the drafts the model agrees with: the rule that makes speculative decoding exact.

Defined in chapter 11 (more tokens per read). One forward scores the newest token and k drafted ones
(k + 1 positions); ``verify_tokens`` keeps the longest agreeing prefix. Greedy: a draft is kept when it
is the model's argmax, so the output is plain greedy's, token for token. Sampling: the standard
accept/reject rule for a deterministic draft (keep draft x with probability p(x), else draw from p
without x), so the output is distributed exactly as the model's.
"""

from __future__ import annotations

import torch

from ..sampling import PickMode, SamplingState, apply_repetition_penalty, top_candidates


@torch.inference_mode()
def verify_tokens(logits: torch.Tensor, draft: torch.Tensor, sampling: SamplingState,
                  mode: PickMode) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of ``draft`` (batch, k) that the model agrees with.

    logits: (batch, k + 1, vocab) from ``verify``. -> (accepted (batch,), next token (batch,)):
    the number of drafted tokens kept, and the token that follows them (the model's correction
    at the first rejection, or a bonus token when every draft was kept).
    """
    b, k1, vocab = logits.shape
    k = k1 - 1
    rows = torch.arange(b, device=logits.device)
    if mode.penalize:  # position i has seen the drafts before it too
        seen = sampling.seen[:, None, :].repeat(1, k1, 1)  # (batch, k + 1, vocab)
        for j in range(k):
            seen[rows[:, None], torch.arange(j + 1, k1, device=logits.device)[None, :], draft[:, j:j + 1]] = True
        logits = apply_repetition_penalty(logits, seen, sampling.penalty[:, None, :])
    greedy_target = logits.argmax(-1)  # (batch, k + 1)
    if mode.greedy:
        keep = greedy_target[:, :k] == draft
        accepted = keep.long().cumprod(dim=1).sum(dim=1)
        return accepted, greedy_target[rows, accepted]
    rep = lambda t: t.repeat_interleave(k1, dim=0)  # per-row settings, one per position
    flat = logits.reshape(b * k1, vocab) / rep(sampling.temperature)
    probs, ids = top_candidates(flat, rep(sampling.top_k), rep(sampling.top_p), mode.candidates)
    probs, ids = probs.reshape(b, k1, -1), ids.reshape(b, k1, -1)  # (batch, k + 1, candidates)
    p_draft = (probs[:, :k] * (ids[:, :k] == draft[..., None])).sum(-1)  # p(draft token) at each position
    keep = sampling.random((k,)) < p_draft  # accept x with probability p(x)
    greedy_rows = sampling.greedy_rows  # (batch, 1): rows that asked for greedy in a sampled batch
    keep = torch.where(greedy_rows, greedy_target[:, :k] == draft, keep)
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    p_next, ids_next = probs[rows, accepted], ids[rows, accepted]  # (batch, candidates)
    rejected = torch.cat([draft, draft[:, :1]], dim=1)[rows, accepted]  # the draft refused there (if any)
    p_next = p_next.masked_fill((accepted < k)[:, None] & (ids_next == rejected[:, None]), 0.0)  # p without it
    choice = (p_next / sampling.random((p_next.shape[1],), "exponential").clamp_min(1e-30)).argmax(-1, keepdim=True)
    sampled = ids_next.gather(1, choice)[:, 0]
    return accepted, torch.where(greedy_rows[:, 0], greedy_target[rows, accepted], sampled)
