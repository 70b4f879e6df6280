"""Attention over the KV cache on a CPU, reading the int8 (or bf16) keys and values themselves (C++, AVX2 and FMA).

Defined in chapter 05 (the KV cache). The int8 cache (``cache/quantized.py``) halves the bytes a token
keeps, but a decode step that dequantizes it first (``dequantize``, then a float attention) writes a
model-dtype copy of every key and value and reads it again: at long context, where the cache is most of
what a step reads, it pays more bytes than the bf16 cache would. ``kv_attention.cpp`` reads each int8 key
and value row once, for all the query rows that use it (the query heads of its KV head, times the few rows
of a decode step or a speculative verify), widens it to fp32 in registers, and keeps the softmax online
over chunks of keys that run on every core (a flash-decoding merge, so one sequence with 2 KV heads still
uses them all). All its arithmetic is fp32: the result is the fp32 attention of the dequantized cache to
fp32 rounding (``reference``), and it does not depend on the thread count. Measured on a 2-core AMD EPYC (Zen 5)
VM, 2 threads, batch 1, Qwen's 12 query heads over 2 KV heads, one query row (medians, cache warm): 16 / 93 us
at 512 / 4096 keys, against 87 / 575 us to dequantize into bf16 and call SDPA, and 42 / 293 us for SDPA over a
bf16 cache; held to AVX2 (``kernels.forced_isa``) the kernel took 21 / 153 us.

The same loops read a bf16 cache (``kv_attention``: every scale 1), for a half-precision model's decode step,
where PyTorch's SDPA pays a set-up on every call that a few hundred keys do not repay. Measured on the same VM held
to AVX2, 2 threads, 12 query heads over 2 KV heads, one bf16 query row (medians of 200): 9 / 38 / 295 us at 80 /
512 / 4096 keys, against 21 / 66 / 504 us for the engine's SDPA call (``sdpa_attention``); in a 28-layer decode
step of the half rung at about 90 tokens of context (the profiler's per-call times, with the step's mask): 27
against 114 us a layer, 2.4 ms of a 120 to 130 ms step. An fp32 cache (the kv_cache rung, chapter 05's subject)
stays with SDPA, and so does the server's paged bf16 cache (a mixed step puts one row's few prompt tokens
beside other rows' decode: a reply must not depend on which kernel took its tokens).

It runs where the cache found our kernels built (``cache.quantized.kernels_take``, decided once, outside any compiled
step) and ``takes`` says: a CPU tensor, at most ``MAX_QUERY`` query rows and not a causal prefill (a long prompt's
attention is a matmul, SDPA's work).
"""

from __future__ import annotations

import math

import torch

MAX_QUERY = 8  # query rows (q_len) the kernel takes: a decode step's 1, a speculative verify's few


def int8_kv_attention(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
                      v_scale: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v with k = k_int8 * k_scale, v = v_int8 * v_scale, all in fp32.

    q (batch, heads, q_len, head_dim) fp32 or bf16; k, v (batch, kv_heads, S, head_dim) int8; k_scale,
    v_scale (batch, kv_heads, S) fp32; mask None (every key visible) or bool (batch or 1, 1, q_len, S),
    True = may attend. heads is a multiple of kv_heads (GQA: query head h reads KV head h // groups);
    head_dim a multiple of 8, contiguous in q, k and v; every other stride may be anything (a slice of the
    cache's buffer, a transposed gather of the paged cache, an expanded mask). Returns (batch, heads,
    q_len, head_dim) contiguous in q's dtype; a row that sees no key gives zeros."""
    return torch.ops.engine_lib_cpu.int8_kv_attention(q, k, k_scale, v, v_scale, mask)


def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_kv_attention`` over a float cache: k, v (batch, kv_heads, S, head_dim) both bf16 or both fp32, every
    scale 1; the same strides, mask and result rules. Returns (batch, heads, q_len, head_dim) in q's dtype."""
    return torch.ops.engine_lib_cpu.kv_attention(q, k, v, mask)


TAKES_DTYPES = (torch.float32, torch.bfloat16)  # the kernel's q and output
CACHE_DTYPES = (torch.int8, torch.bfloat16)  # caches it reads in a model's decode step (an fp32 one goes to SDPA)


def takes(q: torch.Tensor, mask_is_causal: bool) -> bool:
    """Whether attention of q (batch, heads, q_len, head_dim) over an int8 cache whose layers have our kernels runs
    here: a CPU tensor in fp32 or bf16 (fp16 is dequantized and goes to SDPA), at most ``MAX_QUERY`` rows, head_dim
    a multiple of 8, and not a causal prefill. Shapes and dtype only: a compiled step already guards on both."""
    return (q.device.type == "cpu" and q.dtype in TAKES_DTYPES and not mask_is_causal and q.shape[-2] <= MAX_QUERY
            and q.shape[-1] % 8 == 0)


def reference(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, v: torch.Tensor,
              v_scale: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention in plain torch, for the tests: the cache dequantized to fp32 (scales None: a float
    cache, widened), the scores, a softmax and the weighted values in fp32 (a row with no visible key: zeros),
    rounded once to q's dtype."""
    groups = q.shape[1] // k.shape[1]
    kf, vf = k.float(), v.float()
    if k_scale is not None:
        kf, vf = kf * k_scale[..., None], vf * v_scale[..., None]  # the cache's values, dequantized
    kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (batch, heads, q_len, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf: NaN -> zeros
    return (p @ vf).to(q.dtype)
