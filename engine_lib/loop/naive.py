"""Token loops: the naive one (chapter 04) and the cached prefill + decode one (chapter 05 on).

Both are generators that yield (batch, n) chunks of new token ids as soon as they are on
the host. The cached loop syncs with the device only every ``sync_every`` tokens (1 when
streaming), so a GPU never waits on Python between decode steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..cache.contiguous import KVCache
from ..errors import NonFiniteLogitsError
from ..sampling.pick import SamplingParams, SamplingState, non_finite
from ..step.runner import CachedRunner


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> ids (batch, longest), valid (same shape, False on padding).

    Left padding: every prompt ends in the last column, so every row's next token is at
    the same slot, and one decode step serves them all.
    """
    b, t = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, t), pad, dtype=torch.long)
    valid = torch.zeros((b, t), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, t - len(p):] = torch.tensor(p)
        valid[row, t - len(p):] = True
    return ids, valid


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of ``logits`` (batch, ..., vocab) that hold a NaN or an Inf. Syncs."""
    return torch.nonzero(non_finite(logits).reshape(len(logits), -1).any(dim=-1)).flatten().tolist()


def raise_if_bad(bad_rows: list[int], where: str, device=None) -> None:
    """The one finite-or-raise check: ``bad_rows`` are the batch rows whose logits held NaN or Inf
    (``non_finite_rows``, or the runner's flags read at a host sync); ``device`` picks the advice."""
    if bad_rows:
        raise NonFiniteLogitsError(f"{where} (batch rows {bad_rows})", device)


@torch.inference_mode()
def naive_tokens(model, input_ids: torch.Tensor, params: SamplingParams, max_new_tokens: int) -> Iterator[torch.Tensor]:
    """No cache: every step runs the model over the whole sequence so far.

    input_ids: (1, prompt_len). Step n costs a forward pass over prompt_len + n tokens
    (the LM head only on the last position, as ``transformers`` does with use_cache=False).
    """
    sampling = SamplingState(1, model.config.vocab_size, input_ids.device)
    mode = sampling.load([params])
    sampling.observe(input_ids)
    ids = input_ids
    for step in range(max_new_tokens):
        logits = model(ids, last_only=True)[:, -1]  # (1, vocab)
        raise_if_bad(non_finite_rows(logits), f"at generated token {step}", logits.device)
        sampling.draw_noise()
        token = sampling.pick(logits, mode)  # (1,)
        ids = torch.cat([ids, token[:, None]], dim=1)  # the sequence grows by one
        yield token[:, None].cpu()


@torch.inference_mode()
def stepwise_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits of every position, computed one position per forward through a KV cache, as
    a decode loop would, instead of all positions in one forward (as prefill does).

    Both give the same numbers: the model is autoregressive (position i sees positions <= i),
    but nothing forces it to compute the positions of a known sequence one after another.
    -> (seq, vocab) float32.
    """
    cfg, device = model.config, model.device
    cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, len(ids), model.dtype, device)
    x = torch.tensor([ids], device=device)
    out = []
    for i in range(len(ids)):
        slot = torch.tensor([[i]], device=device)  # position i, written to cache slot i
        out.append(model(x[:, i:i + 1], slot, cache.layers(), slot, kv_len=i + 1)[0, -1].float())
    return torch.stack(out)


def cached_tokens(runner: CachedRunner, input_ids: torch.Tensor, valid: torch.Tensor | None,
                  sampling: list[SamplingParams], max_new_tokens: int, sync_every: int = 16) -> Iterator[torch.Tensor]:
    """Prefill the prompt once, then decode one token per step from the KV cache.

    input_ids: (batch, prompt_len), left-padded where ``valid`` (same shape) is False.
    """
    first = runner.prefill(input_ids, valid, sampling, max_new_tokens)  # (batch,)
    chunk = first[:, None].cpu()  # the first token: this sync is what TTFT measures
    raise_if_bad(runner.bad_rows(), "after prefill", runner.device)
    yield chunk
    done = 1
    while done < max_new_tokens:
        n = min(sync_every, max_new_tokens - done)
        for _ in range(n):
            runner.decode()
        chunk = runner.new_tokens(done, done + n)  # (batch, n): one sync for n tokens
        raise_if_bad(runner.bad_rows(), f"before generated token {done + n}", runner.device)
        done += n
        yield chunk
