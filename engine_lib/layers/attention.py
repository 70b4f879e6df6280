"""Grouped-query self-attention with q/k/v bias, RoPE and an optional KV cache.

Defined in chapter 03 (attention); the KV cache path in chapter 05, the packed
q/k/v projection and ``scaled_dot_product_attention`` in chapter 07.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rope, apply_rope_


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
    scores = scores.view(b, kvh, g, t, s)
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]
    if mask is not None:  # mask: (batch or 1, 1, q_len, kv_len), True = may attend
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = probs.view(b, kvh, g * t, s) @ v  # (batch, kv_heads, groups * q_len, head_dim)
    return out.view(b, h, t, d)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The same maths through PyTorch's fused ``scaled_dot_product_attention`` kernel."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Qwen2 self-attention. Parameter names mirror the checkpoint (``self_attn.q_proj`` ...)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=True)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=True)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None
        self.use_sdpa = False

    def pack(self) -> None:
        """Fuse q/k/v into one (hidden + 2*kv_dim, hidden) projection: one GEMM instead of three."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features,
                          bias=True, device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        fused.requires_grad_(False)
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # (batch, seq, (heads + 2*kv_heads) * head_dim)
            qkv = qkv.view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            return q, k, v
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v  # (batch, heads or kv_heads, seq, head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, causal: bool, kv=None) -> torch.Tensor:
        """x: (batch, seq, hidden) -> (batch, seq, hidden).

        ``kv`` is an optional ``LayerKV`` view of the cache: new keys/values are written
        into it and attention then reads every cached position it exposes.
        """
        b, t, _ = x.shape
        q, k, v = self._project(x)
        if self.qkv_proj is not None:
            # q/k are strided views of the fused output; rotate them in place, no new tensors
            q, k = apply_rope_(q, cos, sin), apply_rope_(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv.update(k, v)  # (batch, kv_heads, kv_len, head_dim)
        attend = sdpa_attention if self.use_sdpa else explicit_attention
        out = attend(q, k, v, mask, causal)  # (batch, heads, seq, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
