"""A preallocated, fixed-shape key/value cache: one K and one V buffer per layer.

Defined in chapter 05 (the KV cache). The cache holds buffers only. Where a forward
writes (``cache_pos``) and how far it reads (``kv_len``) are arguments of that forward,
so nothing about a request hides in the cache, and re-running a step is harmless: it
writes the same values to the same slots. Buffers never change shape, so a decode step
can be captured once as a CUDA graph; each layer's buffer is its own tensor, written in
place, so a compiled step never copies the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cpu.kv_attention import CACHE_DTYPES
from ..tracking import note
from . import quantized
from .blocks import BlockAllocator
from .quantized import dequantize, kernels_take


class KernelCache(NamedTuple):
    """What our Triton kernels (chapter 14) need to write and read one layer's cache directly.

    Contiguous: ``k``/``v`` are (batch, kv_heads, max_len, head_dim) and ``write_slots``
    (batch, seq) are slots of each row. Paged: ``k``/``v`` are pools (slots, kv_heads, head_dim),
    ``write_slots`` physical slots, and ``block_table`` (batch, max_blocks) maps position p of
    row r to slot ``block_table[r, p // block_size] * block_size + p % block_size``.
    """

    k: torch.Tensor
    v: torch.Tensor
    write_slots: torch.Tensor
    kv_len: int | None  # positions attention considers; None: the whole buffer
    block_table: torch.Tensor | None = None
    block_size: int = 16
    chunk: int | None = None  # keys per attention program; None: the kernel's choice for the batch
    k_scale: torch.Tensor | None = None  # an int8 cache's fp32 scales: (batch, kv_heads, max_len) or (slots, kv_heads)
    v_scale: torch.Tensor | None = None


class KVLayer(NamedTuple):
    """One layer's (k, v) buffers, (batch, kv_heads, max_len, head_dim) each: what the model gets per layer.

    ``write_read`` is the one question attention asks of a cache; the paged cache's layer
    (``cache/paged.py``) answers it too, so attention never asks which cache it has. An int8 cache
    (``cache/quantized.py``) also has a scale per slot and head, (batch, kv_heads, max_len) each, and gives
    attention its values back in the model's ``dtype``.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # what an int8 cache's values are read back as
    kernels: bool = False  # our CPU kernels attend over it, and write it where it is int8 (``quantized.kernels_take``)

    @property
    def read_span(self) -> int:
        """Slots a fixed-shape step (``kv_len=None``) reads: the whole buffer."""
        return self.k.shape[2]

    def write_read(self, k: torch.Tensor, v: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values at ``ctx.cache_pos`` and return the span attention reads (``write_kv``)."""
        if self.k_scale is None:
            return write_kv(self.k, self.v, k, v, ctx.rows, ctx.cache_pos, ctx.kv_len)
        kq, ks, vq, vs = self.write_read_int8(k, v, ctx)
        return dequantize(kq, ks, self.dtype), dequantize(vq, vs, self.dtype)  # what plain attention reads

    def write_read_int8(self, k: torch.Tensor, v: torch.Tensor, ctx) -> tuple[torch.Tensor, ...]:
        """An int8 cache's ``write_read`` for a kernel that reads integers: writes, then returns the span's
        (k, k_scale, v, v_scale), (batch, kv_heads, kv_len[, head_dim]) views of the buffers, nothing copied."""
        span = slice(None) if ctx.kv_len is None else slice(0, ctx.kv_len)
        out = []
        for buf, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            # (batch, seq, kv_heads, head_dim) int8, (batch, seq, kv_heads) fp32
            q, scale = quantized.write_quantize(new.transpose(1, 2), self.kernels)
            buf[ctx.rows, :, ctx.cache_pos] = q
            scales[ctx.rows, :, ctx.cache_pos] = scale
            out += [buf[:, :, span], scales[:, :, span]]
        return tuple(out)

    def kernel_view(self, ctx, batch: int, seq: int) -> KernelCache:
        """The buffers themselves: each row writes its own slots ``ctx.cache_pos``."""
        return KernelCache(self.k, self.v, ctx.cache_pos, ctx.kv_len, k_scale=self.k_scale, v_scale=self.v_scale)


class KVCache:
    """``k[layer]``, ``v[layer]``: (batch, kv_heads, max_len, head_dim) each.

    The token loop (chapter 12) hands its rows out as blocks, one per sequence: a sequence's position
    ``p`` lives in slot ``p`` of its row, for ``block_size`` positions. The row's last slot is its
    scratch slot, which no position maps to: a row that sits out a forward, and the left padding of a
    ragged one, write there (``step.contiguous_forward``), and no real query ever reads it.
    """

    one_block_per_sequence = True  # a sequence's row holds all of it: it never takes a second block

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str | None = None):
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype  # the model's dtype; None or "int8"
        stored = torch.int8 if kv_cache_dtype == "int8" else dtype
        self.k = [torch.zeros(shape, dtype=stored, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=stored, device=device) for _ in range(num_layers)]
        scales = num_layers if kv_cache_dtype == "int8" else 0
        self.k_scale = [torch.zeros(shape[:3], device=device) for _ in range(scales)]  # (batch, kv_heads, max_len)
        self.v_scale = [torch.zeros(shape[:3], device=device) for _ in range(scales)]
        self.batch, self.max_len = batch, max_len
        self.device = torch.device(device)
        self.kernels = stored in CACHE_DTYPES and kernels_take(self.device)
        self.allocator = BlockAllocator(batch, reserved=0)  # block i is row i
        note(self, "kv_cache")

    @property
    def block_size(self) -> int:
        """Positions a row holds: every slot but the scratch slot."""
        return self.max_len - 1

    @property
    def scratch_slot(self) -> int:
        return self.max_len - 1

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold: one row."""
        return self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor of the cache (values, then any scales), each laid out (batch, kv_heads, max_len, ...)."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def layers(self) -> list[KVLayer]:
        if not self.k_scale:
            return [KVLayer(k, v, kernels=self.kernels) for k, v in zip(self.k, self.v)]
        return [KVLayer(k, v, ks, vs, self.dtype, self.kernels)
                for k, v, ks, vs in zip(self.k, self.v, self.k_scale, self.v_scale)]


def kv_bytes_per_token(cfg, bytes_per_element: int, kv_heads: int | None = None) -> int:
    """One token's keys and values: 2 (K and V) x layers x kv_heads x head_dim x bytes per element.

    ``kv_heads`` defaults to the model's; pass the query-head count for what the cache
    would take without grouped-query attention.
    """
    heads = cfg.num_key_value_heads if kv_heads is None else kv_heads
    return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * bytes_per_element


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
             cache_pos: torch.Tensor, kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k/v (batch, kv_heads, seq, head_dim) into the slots ``cache_pos`` (batch, seq), in place.

    ``rows`` is ``arange(batch)[:, None]``: row i of the batch writes row i of the buffer.

    Returns the span attention reads: the first ``kv_len`` slots, or the whole buffer when
    ``kv_len`` is None (the fixed-shape step, where the mask hides what is not written yet).
    """
    k_buf[rows, :, cache_pos] = k.transpose(1, 2)  # indexed view: (batch, seq, kv_heads, head_dim)
    v_buf[rows, :, cache_pos] = v.transpose(1, 2)
    if kv_len is None:
        return k_buf, v_buf
    return k_buf[:, :, :kv_len], v_buf[:, :, :kv_len]


def visible_slots(cache_pos: torch.Tensor, key_valid: torch.Tensor | None, kv_len: int) -> torch.Tensor:
    """Which cache slots each new token may attend to: (batch, 1, seq, kv_len), True = visible.

    A slot is visible to a query when it is at or before the query's own slot (causal) and
    holds a real token (``key_valid``, (batch, >= kv_len), False for left padding). A query
    always sees itself, so even a padding row's softmax stays finite.
    """
    slots = torch.arange(kv_len, device=cache_pos.device)  # (kv_len,)
    own = cache_pos[:, :, None]  # (batch, seq, 1)
    allowed = slots <= own  # (batch, seq, kv_len)
    if key_valid is not None:
        allowed = (allowed & key_valid[:, None, :kv_len]) | (slots == own)
    return allowed[:, None]
