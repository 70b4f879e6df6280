"""Grouped-query self-attention with q/k/v bias, RoPE and an optional KV cache.

Defined in chapter 03 (attention); the KV cache path in chapter 05, the SDPA kernel in
chapters 05-06, the packed q/k/v projection and the folded GQA decode in chapter 07.
"""

from __future__ import annotations

import torch
from torch import nn

from ...cpu import kv_attention as cpu_kv
from ...quant.linear import make_linear
from .rope import apply_rope, apply_rope_
from .sdpa import sdpa

# Up to this many query rows per KV head (groups x new tokens), GQA is folded into the
# query axis; longer queries (a prefill) repeat K/V instead, which costs one small copy.
FOLD_MAX_ROWS = 128
# With our Triton kernels (chapter 14), forwards of up to this many new tokens (decode, and
# speculative verify) rotate, write and attend through them; longer ones (a prefill) take SDPA.
KERNEL_MAX_QUERY = 8


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, written out, with the softmax in fp32.

    q: (batch, heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim).
    GQA without copying k/v: the ``groups`` query heads that share one kv head are
    folded into the query-length axis, so one batched matmul serves them all.
    """
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    q = (q * d**-0.5).reshape(b, kvh, g * t, d)  # scale first: keeps fp16 scores in range
    scores = q @ k.transpose(-1, -2)  # (batch, kv_heads, groups * q_len, kv_len)
    scores = scores.unflatten(2, (g, t))  # (batch, kv_heads, groups, q_len, kv_len)
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]
    if mask is not None:  # mask: (batch or 1, 1, q_len, kv_len), True = may attend
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = probs.flatten(2, 3) @ v  # (batch, kv_heads, groups * q_len, head_dim)
    return out.reshape(b, h, t, d)  # a view when the matmul's layout allows it


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The same maths through PyTorch's fused ``scaled_dot_product_attention`` kernel.

    No call passes ``enable_gqa``: on CUDA only the flash kernel takes it, and flash takes
    no mask and needs sm_80, so every masked or T4 call would fall back to the slow math
    kernel. Instead a short query (decode, verify) folds the query heads that share a KV
    head into the query axis, and a long one (prefill) repeats K/V; both leave equal head
    counts, which the memory-efficient and cuDNN kernels accept, with or without a mask.
    The CUDA kernel of each call is chosen in ``sdpa.py``: on a T4 (sm_75) every call runs
    memory-efficient attention; on an H200 (sm_90) unmasked fp16/bf16 calls (prefill, eager
    batch-1 decode) run flash, masked or fp32 ones (compiled decode, verify, serving)
    memory-efficient. The output's layout is the kernel's: it is reshaped, never viewed.
    """
    b, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    if g == 1:
        return sdpa(q, k, v, mask, causal)
    if not causal and g * t <= FOLD_MAX_ROWS:
        return folded_sdpa(q, k, v, mask)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (batch, heads, kv_len, head_dim)
    return sdpa(q, k, v, mask, causal)


def folded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """GQA as plain attention: query head ``kv * g + j`` at row t becomes row ``j * t_len + t``
    of KV head ``kv``. q: (batch, heads, q_len, head_dim) -> same shape."""
    b, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qf = q.reshape(b, kvh, g * t, d)  # (batch, kv_heads, groups * q_len, head_dim)
    if mask is not None:  # (batch or 1, 1, q_len, kv_len): the same rows for every group
        mask = mask.unsqueeze(2).expand(-1, -1, g, -1, -1).reshape(mask.shape[0], 1, g * t, mask.shape[-1])
    out = sdpa(qf, k, v, mask)  # (batch, kv_heads, groups * q_len, head_dim), laid out as the kernel chose
    # memory-efficient attention stores it as (batch, groups * q_len, kv_heads, head_dim):
    # merging kv_heads and groups is then no view, so reshape (a copy only where needed)
    return out.reshape(b, h, t, d)


class Attention(nn.Module):
    """Qwen2 self-attention. Parameter names mirror the checkpoint (``self_attn.q_proj`` ...).

    ``packed=True`` holds q/k/v as one projection, ``qkv_proj``; the loader fills it by
    concatenating the checkpoint's three tensors. ``sdpa`` picks the attention kernel.
    ``quant`` (``"int8"``/``"int4"``, chapter 10) makes every projection a ``QuantLinear``.
    ``kernels=True`` (chapter 14) runs decode and verify through our Triton kernels.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, packed: bool = False,
                 sdpa: bool = False, quant: str | None = None, kernels: bool = False):
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.q_dim, self.kv_dim = hidden_size, num_kv_heads * self.head_dim
        self.packed = packed
        self.attend = sdpa_attention if sdpa else explicit_attention
        if packed:
            self.qkv_proj = make_linear(hidden_size, self.q_dim + 2 * self.kv_dim, bias=True, quant=quant)
        else:
            self.q_proj = make_linear(hidden_size, self.q_dim, bias=True, quant=quant)
            self.k_proj = make_linear(hidden_size, self.kv_dim, bias=True, quant=quant)
            self.v_proj = make_linear(hidden_size, self.kv_dim, bias=True, quant=quant)
        self.o_proj = make_linear(hidden_size, hidden_size, bias=False, quant=quant)

    def packed_sources(self) -> dict[str, list[tuple[str, int]]]:
        """Packed parameter -> the checkpoint tensors it concatenates (suffix, rows)."""
        if not self.packed:
            return {}
        rows = [("q_proj", self.q_dim), ("k_proj", self.kv_dim), ("v_proj", self.kv_dim)]
        return {f"qkv_proj.{p}": [(f"{name}.{p}", n) for name, n in rows] for p in ("weight", "bias")}

    def _project(self, x: torch.Tensor, ctx=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        unpack = ctx.unpack if ctx is not None else (lambda y: y)  # packed real tokens -> (batch, seq, ...)
        if self.packed:
            qkv = unpack(self.qkv_proj(x))  # (batch, seq, (heads + 2*kv_heads) * head_dim)
            b, t, _ = qkv.shape
            qkv = qkv.view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim).transpose(1, 2)
            return qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k, v = (unpack(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        b, t, _ = q.shape
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v  # (batch, heads or kv_heads, seq, head_dim)

    def forward(self, x: torch.Tensor, ctx, kv=None) -> torch.Tensor:
        """x: (batch, seq, hidden) -> (batch, seq, hidden).

        ``ctx`` (a ``StepContext``) carries RoPE's cos/sin, the mask and where to write;
        ``kv`` is this layer's cache (``KVCache``'s ``KVLayer`` or the paged cache's ``PagedLayer``):
        its ``write_read`` writes the new keys/values at ``ctx.cache_pos`` and returns what
        attention reads, the first ``ctx.kv_len`` slots (all if None).
        """
        q, k, v = self._project(x, ctx)
        b, _, t, _ = q.shape  # x may hold only the real tokens of a padded batch (``StepContext.tokens``)
        pack = ctx.pack
        if self.kernels and kv is not None and t <= KERNEL_MAX_QUERY:
            out = self._kernel_attention(q, k, v, ctx, kv)  # (batch, heads, seq, head_dim)
            return self.o_proj(pack(out.transpose(1, 2).reshape(b, t, -1)))
        if self.packed:
            # q/k are strided views of the packed output; rotate them in place, no new tensors
            q, k = apply_rope_(q, ctx.cos, ctx.sin), apply_rope_(k, ctx.cos, ctx.sin)
        else:
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        if kv is not None and getattr(kv, "kernels", False) and cpu_kv.takes(q, ctx.causal):
            # a cache our CPU kernel reads itself: an int8 one's integers and scales (no dequantized copy), or a
            # bf16 one (a decode step's few hundred keys cost less there than SDPA's set-up)
            if kv.k_scale is not None:
                out = cpu_kv.int8_kv_attention(q, *kv.write_read_int8(k, v, ctx), ctx.mask)
            else:
                out = cpu_kv.kv_attention(q, *kv.write_read(k, v, ctx), ctx.mask)
            return self.o_proj(pack(out.transpose(1, 2).reshape(b, t, -1)))
        if kv is not None:
            k, v = kv.write_read(k, v, ctx)  # (batch, kv_heads, kv_len, head_dim)
        out = self.attend(q, k, v, ctx.mask, ctx.causal)  # (batch, heads, seq, head_dim)
        return self.o_proj(pack(out.transpose(1, 2).reshape(b, t, -1)))

    @staticmethod
    def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, kv) -> torch.Tensor:
        """Decode or verify through our Triton kernels: RoPE on q and k fused with the cache write,
        then split-KV attention straight over the cache (contiguous or paged), no mask tensor."""
        from ...kernels.decode_attention import decode_attention
        from ...kernels.rope_kv_write import rope_kv_write_

        cache = kv.kernel_view(ctx, q.shape[0], q.shape[2])
        # an int8 cache's scales (None for a cache in the model's dtype): written and read beside the integers
        rope_kv_write_(q, k, v, ctx.positions, ctx.rotary.cos_table, ctx.rotary.sin_table,
                       cache.k, cache.v, cache.write_slots, cache.k_scale, cache.v_scale)
        # a query at slot p sees slots <= p that hold real tokens (kv_cache.visible_slots's rule)
        return decode_attention(q, cache.k, cache.v, ctx.cache_pos, ctx.key_valid, cache.block_table,
                                cache.block_size, cache.kv_len, cache.chunk, cache.k_scale, cache.v_scale)
