"""Token loops: the naive one (chapter 04) and the cached prefill + decode one (chapter 05 on).

Both are generators that yield (batch, n) chunks of new token ids as soon as they are on
the host. The cached loop syncs with the device only every ``sync_every`` tokens (1 when
streaming), so a GPU never waits on Python between decode steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .errors import NonFiniteLogitsError
from .runner import CachedRunner
from .sampling import Sampler


def _check_finite(logits: torch.Tensor, where: str) -> None:
    if not torch.isfinite(logits).all():
        raise NonFiniteLogitsError(f"NaN or Inf in the logits {where}; in float16 this usually means an "
                                   f"activation overflowed: try dtype=torch.bfloat16 or torch.float32")


@torch.inference_mode()
def naive_tokens(model, input_ids: torch.Tensor, sampler: Sampler, max_new_tokens: int) -> Iterator[torch.Tensor]:
    """No cache: every step runs the model over the whole sequence so far.

    input_ids: (1, prompt_len). Step n costs a forward pass over prompt_len + n tokens
    (the LM head only on the last position, as ``transformers`` does with use_cache=False).
    """
    ids = input_ids
    sampler.observe(ids)
    for step in range(max_new_tokens):
        logits = model(ids, last_only=True)[:, -1]  # (1, vocab)
        _check_finite(logits, f"at generated token {step}")
        token = sampler(logits)  # (1,)
        ids = torch.cat([ids, token[:, None]], dim=1)  # the sequence grows by one
        yield token[:, None].cpu()


@torch.inference_mode()
def cached_tokens(runner: CachedRunner, input_ids: torch.Tensor, valid: torch.Tensor | None,
                  sampler: Sampler, max_new_tokens: int, sync_every: int = 16) -> Iterator[torch.Tensor]:
    """Prefill the prompt once, then decode one token per step from the KV cache.

    input_ids: (batch, prompt_len), left-padded where ``valid`` (same shape) is False.
    """
    sampler.observe(input_ids, valid)
    logits = runner.prefill(input_ids, valid, max_new_tokens)  # (batch, vocab)
    _check_finite(logits, "after prefill")
    token = sampler(logits)  # (batch,)
    yield token[:, None].cpu()  # the first token: this sync is what TTFT measures
    pending: list[torch.Tensor] = []
    bad = torch.zeros((), dtype=torch.bool, device=token.device)
    for step in range(1, max_new_tokens):
        logits = runner.decode(token)  # (batch, vocab)
        bad |= ~torch.isfinite(logits).all()  # checked at the next sync, not now
        token = sampler(logits)
        pending.append(token)
        if len(pending) == sync_every or step == max_new_tokens - 1:
            chunk = torch.stack(pending, dim=1).cpu()  # (batch, n): one sync for n tokens
            if bad.item():
                raise NonFiniteLogitsError(f"NaN or Inf in the logits before generated token {step + 1}")
            pending.clear()
            yield chunk
