"""Speculative decoding: a cheap draft proposes k tokens, the model checks them all in one forward.

Defined in chapter 11 (more tokens per read). A decode step reads every weight to score
one position; a verify step reads them once to score k + 1 positions (the newest token and
k drafted ones). Every drafted token the model agrees with is a token for free.

- Drafters: ``PromptLookup`` copies what followed the latest n-gram's earlier occurrence in
  the context (free to draft); ``DraftModel`` runs a smaller model with the same vocabulary
  and its own KV cache; ``Replay`` proposes a known continuation (a forced acceptance rate,
  to show the mechanics where random weights make real acceptance meaningless).
- ``verify_tokens`` accepts the longest agreeing prefix. Greedy: a draft is kept when it is
  the model's argmax, so the output is plain greedy's, token for token. Sampling: the
  standard accept/reject rule for a deterministic draft (keep draft x with probability
  p(x), else draw from p without x), so the output is distributed exactly as the model's.
- The runner's ``verify`` and ``advance`` (chapter 05's contract: slots are arguments) do the
  rest: rejected drafts' slots are simply written over later; nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..cache.contiguous import KVCache
from ..errors import UnsupportedOptionError
from ..loop.naive import raise_if_bad
from ..sampling.pick import PickMode, SamplingParams, SamplingState, apply_repetition_penalty, top_candidates
from ..step.runner import CachedRunner


class PromptLookup:
    """Draft by lookup: the longest recent n-gram (n = max_ngram..1) that occurred earlier in the
    context proposes the tokens that followed its latest earlier occurrence."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, runner: CachedRunner) -> None:
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

    def propose(self, runner: CachedRunner, k: int) -> torch.Tensor:
        st = runner.state
        history = st.history.tolist()
        ends = (st.cache_pos[:, 0] + 1).tolist()  # the newest token's slot + 1
        valid = st.key_valid.tolist() if st.padded else None
        out = []
        for row, end in enumerate(ends):
            start = valid[row].index(True) if valid else 0
            found = self.lookup(history[row][start:end], k, self.max_ngram)
            out.append((found + [found[-1] if found else history[row][end - 1]] * k)[:k])  # pad: likely rejected
        return torch.tensor(out, dtype=torch.long, device=st.token.device)


class Replay:
    """Proposes a known continuation per row (e.g. plain greedy's output): acceptance is forced,
    to measure what speculation buys at a given acceptance rate."""

    name = "replay"

    def __init__(self, continuations: list[list[int]]):
        self.continuations = continuations
        self.prompt_len = 0

    def start(self, runner: CachedRunner) -> None:
        self.prompt_len = runner.state.prompt_len

    def propose(self, runner: CachedRunner, k: int) -> torch.Tensor:
        st = runner.state
        done = (st.cache_pos[:, 0] - self.prompt_len + 1).tolist()  # tokens generated so far, per row
        out = []
        for row, n in enumerate(done):
            cont = self.continuations[row][n:n + k]
            out.append((cont + [0] * k)[:k])
        return torch.tensor(out, dtype=torch.long, device=st.token.device)


class DraftModel:
    """A smaller model with the same vocabulary drafts greedily through its own KV cache.

    Its cache mirrors the target's slot for slot (same sequences, same padding), so it reuses
    the target's positions and slots. Each round feeds it two tokens, the one before the
    target's newest and the newest (re-writing a slot it may already hold, which is harmless),
    then k - 1 single tokens.
    """

    name = "draft_model"

    def __init__(self, model):
        self.model = model
        self.kv: list | None = None

    def start(self, runner: CachedRunner) -> None:
        st, cfg = runner.state, self.model.config
        if cfg.vocab_size != runner.model.config.vocab_size:
            raise UnsupportedOptionError("the draft model's vocabulary differs from the target's")
        dtype, device = self.model.dtype, self.model.device
        self.kv = KVCache(cfg.num_hidden_layers, st.batch, cfg.num_key_value_heads, cfg.head_dim, st.max_len,
                          dtype, device).layers()
        t = st.prompt_len
        slots = torch.arange(t, device=device).expand(st.batch, t)
        positions = (st.key_valid[:, :t].long().cumsum(-1) - 1).clamp(min=0) if st.padded else slots
        with torch.inference_mode():
            self.model(st.history[:, :t], positions, self.kv, slots, st.key_valid if st.padded else None, kv_len=t)

    @torch.inference_mode()
    def propose(self, runner: CachedRunner, k: int) -> torch.Tensor:
        st = runner.state
        rows = torch.arange(st.batch, device=st.token.device)
        slots = torch.cat([st.cache_pos - 1, st.cache_pos], dim=1)  # (batch, 2)
        positions = torch.cat([st.positions - 1, st.positions], dim=1)
        inputs = torch.stack([st.history[rows, st.cache_pos[:, 0] - 1], st.token[:, 0]], dim=1)
        out = []
        for i in range(k):  # the furthest row's newest token is in slot st.length - 1
            logits = self.model(inputs, positions, self.kv, slots, st.key_valid, kv_len=st.length + i)
            out.append(logits[:, -1].argmax(-1))
            inputs, slots, positions = out[-1][:, None], slots[:, -1:] + 1, positions[:, -1:] + 1
        return torch.stack(out, dim=1)


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


@torch.inference_mode()
def speculative_tokens(runner: CachedRunner, drafter, input_ids: torch.Tensor, valid: torch.Tensor | None,
                       sampling: list[SamplingParams], max_new_tokens: int, stats: dict, max_k: int = 8,
                       first_k: int = 4) -> Iterator[list[list[int]]]:
    """Prefill, then rounds of draft k -> verify k + 1 -> keep the agreeing prefix. Yields each
    row's new tokens as they are accepted (rows advance by different amounts). ``stats`` gets
    the drafted and accepted counts and the number of target forwards."""
    # room for a finished row's last overshoot (k + 1) and the verify steps it still joins (k + 1)
    first = runner.prefill(input_ids, valid, sampling, max_new_tokens + 2 * max_k + 2)
    st = runner.state
    first = first.tolist()
    raise_if_bad(runner.bad_rows(), "after prefill", runner.device)
    yield [[t] for t in first]
    drafter.start(runner)
    b = len(first)
    done = [1] * b
    k = first_k
    stats.update(drafted=0, accepted=0, target_forwards=1, rounds=0, rows=b)
    while min(done) < max_new_tokens:
        remaining = max(max_new_tokens - d for d in done if d < max_new_tokens)
        k = max(1, min(k, max_k, remaining - 1))  # no drafts past the last token anyone still needs
        draft = drafter.propose(runner, k)  # (batch, k)
        logits = runner.verify(draft)  # (batch, k + 1, vocab)
        accepted, nxt = verify_tokens(logits, draft, st.sampling, st.sampling.mode)
        active = torch.tensor([d < max_new_tokens for d in done], device=draft.device)
        runner.advance(accepted, nxt, draft, active)
        kept = torch.cat([draft, nxt[:, None]], dim=1)  # (batch, k + 1): drafts, then the next token
        position = torch.arange(k + 1, device=draft.device)
        st.sampling.mark_seen(torch.where(position < accepted[:, None], kept, nxt[:, None]))  # kept ones only
        n_host, kept_host = accepted.tolist(), kept.tolist()  # one sync per round
        raise_if_bad(runner.bad_rows(), f"in verify step {stats['rounds'] + 1}", runner.device)
        out = []
        for row in range(b):
            if done[row] >= max_new_tokens:
                out.append([])
                continue
            n = n_host[row]
            new = (kept_host[row][:n] + [kept_host[row][k]])[:max_new_tokens - done[row]]
            done[row] += len(new)
            out.append(new)
            stats["drafted"] += k
            stats["accepted"] += n
        stats["target_forwards"] += 1
        stats["rounds"] += 1
        k = k + 1 if all(n == k for n, a in zip(n_host, active.tolist()) if a) else max(n_host) + 1
        yield out
