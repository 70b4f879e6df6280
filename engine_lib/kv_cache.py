"""A preallocated, fixed-shape key/value cache.

Defined in chapter 05 (the KV cache). Buffers never change shape, so a decode step
can be captured once as a CUDA graph and replayed; new entries are written in place.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for every layer: (layers, batch, kv_heads, max_len, head_dim) each."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        # (batch, max_len) True where a real token sits. Allocated once and filled in place,
        # so a captured CUDA graph keeps reading the right memory. None: nothing is masked.
        self.key_valid_buffer = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.key_valid: torch.Tensor | None = None
        self.padded = False  # does any row of this request start with padding?
        # where this forward pass writes: (seq,) cache indices; how far it reads (None = all)
        self.write_pos: torch.Tensor | None = None
        self.read_len: int | None = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def layer(self, index: int) -> LayerKV:
        return LayerKV(self, index)


class LayerKV:
    """One layer's view of the cache, handed to that layer's attention."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (batch, kv_heads, seq, head_dim) at ``write_pos``; return the readable span."""
        c = self.cache
        k_buf, v_buf = c.k[self.index], c.v[self.index]  # (batch, kv_heads, max_len, head_dim)
        k_buf.index_copy_(2, c.write_pos, k)
        v_buf.index_copy_(2, c.write_pos, v)
        if c.read_len is None:  # static shape: read the whole buffer, the mask hides the rest
            return k_buf, v_buf
        return k_buf[:, :, : c.read_len], v_buf[:, :, : c.read_len]
