"""What an int8 KV cache costs in accuracy: the next-token distribution beside the model-dtype cache's.

Defined in chapter 05 (the KV cache). The same model reads the same text twice, through two caches that
differ only in how keys and values are stored (``cache/quantized.py``). Each window of ``context`` tokens
starts from an empty cache and goes in chunks of ``chunk`` tokens, as a server's chunked prefill does, so
every position attends to keys and values read back from the cache, its own included. At every position:

- the KL divergence KL(p_ref || p_int8) of the next-token distributions, in nats (llama.cpp's users
  judge a quantized cache by it: perplexity alone can hide changes that cancel on average);
- the negative log-likelihood of the actual next token, so the perplexity of each;
- whether the greedy (argmax) token is the same.

Everything is computed in fp32 from the logits, a few hundred rows at a time.
"""

from __future__ import annotations

import math
import time

import torch

from ..cache.contiguous import KVCache

ROWS = 256  # positions whose (rows, vocab) log-softmax is held at once


@torch.inference_mode()
def _window_logits(model, ids: torch.Tensor, kv_cache_dtype: str | None, chunk: int) -> torch.Tensor:
    """ids (n,) through a fresh cache, ``chunk`` tokens a forward -> logits (n, vocab), the model's dtype."""
    cfg, n = model.config, ids.numel()
    cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, n + 1, model.dtype,
                    ids.device, kv_cache_dtype)
    out = []
    for a in range(0, n, chunk):
        pos = torch.arange(a, min(a + chunk, n), device=ids.device)[None]  # (1, t)
        out.append(model(ids[None, pos[0]], pos, cache.layers(), pos, None, kv_len=pos[0, -1].item() + 1)[0])
    return torch.cat(out)


def compare_caches(model, token_ids, context: int = 512, chunk: int = 128, kv_cache_dtype: str = "int8",
                   progress: bool = False) -> dict:
    """Both caches over ``token_ids`` in windows of ``context`` -> mean and largest KL divergence (nats), both
    perplexities and their change, greedy agreement, and how many positions were scored (each window's last
    position has no next token)."""
    from tqdm.auto import tqdm

    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().to(next(model.parameters()).device)
    kl_sum, kl_max, nll = 0.0, 0.0, {"ref": 0.0, "int8": 0.0}
    agree, scored, t0 = 0, 0, time.perf_counter()
    starts = range(0, ids.numel() - 1, context)
    for a in tqdm(starts, desc="KV cache quality", unit="window", disable=not progress):
        win = ids[a:a + context]
        ref, quant = (_window_logits(model, win, d, chunk) for d in (None, kv_cache_dtype))
        target = win[1:]
        for r in range(0, target.numel(), ROWS):
            lp = ref[r:r + ROWS][:target.numel() - r].float().log_softmax(-1)  # (rows, vocab)
            lq = quant[r:r + ROWS][:target.numel() - r].float().log_softmax(-1)
            kl = (lp.exp() * (lp - lq)).sum(-1)  # (rows,) KL(ref || int8)
            kl_sum += kl.double().sum().item()
            kl_max = max(kl_max, kl.max().item())
            tgt = target[r:r + lp.shape[0], None]
            nll["ref"] -= lp.gather(1, tgt).double().sum().item()
            nll["int8"] -= lq.gather(1, tgt).double().sum().item()
            agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
            scored += lp.shape[0]
    ppl = {k: math.exp(v / scored) for k, v in nll.items()}
    return {"tokens": scored, "context": context, "chunk": chunk, "mean_kl_nats": kl_sum / scored,
            "max_kl_nats": kl_max, "ppl_ref": ppl["ref"], "ppl_int8": ppl["int8"],
            "ppl_change": ppl["int8"] / ppl["ref"] - 1, "greedy_agreement": agree / scored,
            "seconds": time.perf_counter() - t0}
