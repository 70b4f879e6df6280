"""The naive token loop (chapter 04): no cache, the whole sequence through the model for every token.

It is the baseline the book measures every rung against, so it stays this short: the engine hands its
tokens to the token loop's output processor (``output.OutputProcessor``), which stops, decodes and times
them as it does every other generation's. ``stepwise_logits`` is chapter 00's contrast: the same logits,
one position per forward through a KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..cache.contiguous import KVCache
from ..errors import NonFiniteLogitsError
from ..sampling import SamplingParams, SamplingState, non_finite


@torch.inference_mode()
def naive_tokens(model, input_ids: torch.Tensor, params: SamplingParams, max_new_tokens: int) -> Iterator[int]:
    """No cache: every step runs the model over the whole sequence so far.

    input_ids: (1, prompt_len). Step n costs a forward pass over prompt_len + n tokens
    (the LM head only on the last position, as ``transformers`` does with use_cache=False).
    Yields each new token id as soon as it is on the host.
    """
    sampling = SamplingState(1, model.config.vocab_size, input_ids.device)
    mode = sampling.load([params])
    sampling.observe(input_ids)
    ids = input_ids
    for step in range(max_new_tokens):
        logits = model(ids, last_only=True)[:, -1]  # (1, vocab)
        if bool(non_finite(logits)[0]):
            raise NonFiniteLogitsError(f"at generated token {step}", logits.device)
        sampling.draw_noise()
        token = sampling.pick(logits, mode)  # (1,)
        ids = torch.cat([ids, token[:, None]], dim=1)  # the sequence grows by one
        yield int(token)


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
