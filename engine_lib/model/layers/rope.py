"""Rotary position embeddings (RoPE), "rotate half" layout as in transformers' Qwen2.

Defined in chapter 03 (attention); the in-place form in chapter 07.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """A cos/sin table for every position up to ``max_positions``, made once at load time.

    Position p rotates the pair (x[i], x[i + d/2]) by the angle p * theta^(-2i/d).
    The table is computed in fp32: angles at position 30,000 need fp32 to stay exact.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        # always on the CPU, then moved: a model built on the meta device (the loader) still gets a real table,
        # and meta's arithmetic (Python reference kernels) would import torch._dynamo, most of a second per start
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (head_dim/2,) radians per position
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` (batch, seq) -> each (batch, 1, seq, head_dim)."""
        return self.cos_table[positions].unsqueeze(1).to(dtype), self.sin_table[positions].unsqueeze(1).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by the angles in cos/sin (batch, 1, seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In-place RoPE for the fused stage: writes the rotation back into x, no new q/k tensors."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]  # cos/sin repeat across the two halves
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    x1.copy_(r1)
    x2.copy_(r2)
    return x
