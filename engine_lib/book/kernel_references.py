"""What each of our Triton kernels (chapter 14) must compute, written with the engine's own operations.

Each reference does op by op what the engine does where the kernel is not used, so a kernel that matches
its reference matches the engine: RMSNorm's arithmetic, ``write_kv``'s and ``PagedLayer``'s cache writes,
``apply_rope_``, ``visible_slots`` and ``dequantize_int8``. They live with the book, not beside the
kernels, so the kernels import nothing of the engine and the engine's layers can call them.
"""

from __future__ import annotations

import torch

from engine_lib.cache.contiguous import visible_slots
from engine_lib.model.layers.rope import apply_rope_
from engine_lib.quant.formats import dequantize_int8


def add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) in PyTorch, op by op, nothing mutated: what the kernel must match."""
    new_residual = x + residual  # promoted dtype, the residual's
    h = new_residual.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(weight.dtype), new_residual


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, block_size: int, span: int) -> torch.Tensor:
    """Positions [0, span) of every row out of a paged pool: (num_slots, kv_heads, head_dim) ->
    (batch, kv_heads, span, head_dim)."""
    p = torch.arange(span, device=pool.device)
    slots = block_table[:, p // block_size] * block_size + p % block_size  # (batch, span)
    return pool[slots].transpose(1, 2)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                               key_valid: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                               block_size: int = 16, kv_len: int | None = None) -> torch.Tensor:
    """What ``decode_attention`` computes, in plain PyTorch: gather, repeat K/V, mask, fp32 softmax."""
    from engine_lib.kernels.decode_attention import _check  # the kernel's own checks (imported here: it needs Triton)

    span = _check(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size, kv_len)
    if block_table is not None:
        k, v = (gather_pages(c, block_table, block_size, span) for c in (k_cache, v_cache))
    else:
        k, v = k_cache[:, :, :span], v_cache[:, :, :span]
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)  # (batch, heads, span, head_dim)
    scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (batch, heads, q_len, span)
    scores = scores.masked_fill(~visible_slots(q_pos, key_valid, span), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


def int8_matvec_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then an fp32 matmul, rounded once to x's dtype: what the kernel must match."""
    y = x.float() @ dequantize_int8(qweight, scales).T  # (..., out)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _write(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """new (batch, kv_heads, seq, head_dim) into ``cache`` at ``slots`` (batch, seq), as the engine writes."""
    b, kv_heads, t, d = new.shape
    if cache.ndim == 3:  # the paged pool: PagedLayer.write_read's index_copy_
        cache.index_copy_(0, slots.flatten(), new.transpose(1, 2).reshape(b * t, kv_heads, d))
    else:  # the engine's cache: kv_cache.write_kv's indexed assignment
        rows = torch.arange(b, device=cache.device)[:, None]
        cache[rows, :, slots] = new.transpose(1, 2)


def rope_kv_write_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_table: torch.Tensor, sin_table: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The same mutation in PyTorch, op by op as the engine does it: q rotated in place, caches written."""
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)  # (batch, 1, seq, head_dim), as RotaryEmbedding.forward
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    apply_rope_(q, cos, sin)
    _write(k_cache, apply_rope_(k.clone(), cos, sin), slots)  # a copy: k is not changed
    _write(v_cache, v, slots)
