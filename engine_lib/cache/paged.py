"""A paged KV cache: fixed-size blocks of slots, a block table per sequence, a free list.

Defined in chapter 12 (serving many users). The engine's ``KVCache`` gives every request
one row of ``max_len`` slots, reserved up front: a server holding many requests of unknown
length would waste most of it. Here every layer has one pool of slots, cut into blocks of
``BLOCK_SIZE``; a sequence owns a list of blocks (its *block table*) and gets a new one only
when it fills its last. Logical position ``p`` of a sequence lives in physical slot
``table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE``.

Attention reads through the block table: each layer writes the new keys/values into their
slots, then gathers every row's slots into a contiguous (batch, kv_heads, kv_len, head_dim)
tensor for the usual SDPA call, with the model's mask hiding what a row does not own.
``PagedLayer.write_read`` answers the same question as the engine cache's ``KVLayer.write_read``,
so ``Attention.forward`` calls it without asking which cache it has.

Blocks of a common prefix can be shared between sequences: ``prefix_cache.PrefixCachingAllocator``
adds reference counts and a table of cached full blocks to this free list.
"""

from __future__ import annotations

import torch

from ..tracking import note
from . import quantized
from .blocks import BlockAllocator
from .contiguous import KernelCache
from .quantized import bytes_per_token, dequantize, kernels_take

BLOCK_SIZE = 16
ZERO_BLOCK, SCRATCH_BLOCK = 0, 1  # never handed out: read padding (stays zero), write padding
RESERVED = 2


class PagedKVCache:
    """Per layer one K and one V pool, (num_blocks * block_size, kv_heads, head_dim) each.

    Before each forward the scheduler calls ``prepare``: where each new token's keys and
    values go (``write_slots``) and which slots each row reads (``read_slots``). ``kv_cache_dtype="int8"``
    stores int8 pools and an fp32 scale per slot and head, (slots, kv_heads) per layer (``cache/quantized.py``).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = BLOCK_SIZE,
                 kv_cache_dtype: str | None = None):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, RESERVED)
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype  # the model's dtype; None or "int8"
        stored = torch.int8 if kv_cache_dtype == "int8" else dtype
        self.k = [torch.zeros(shape, dtype=stored, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=stored, device=device) for _ in range(num_layers)]
        scales = num_layers if kv_cache_dtype == "int8" else 0
        self.k_scale = [torch.zeros(shape[:2], device=device) for _ in range(scales)]  # (slots, kv_heads)
        self.v_scale = [torch.zeros(shape[:2], device=device) for _ in range(scales)]
        # our CPU kernels write and read an int8 one; a bf16 one stays with SDPA here: a server's mixed steps put a
        # row's few prompt tokens beside other rows' decode, and its reply must not depend on which kernel took it
        self.kernels = kv_cache_dtype == "int8" and kernels_take(device)
        self.device = torch.device(device)
        self.one_block_per_sequence = False  # a sequence takes a new block as it grows
        self.write_slots: torch.Tensor | None = None  # (batch * seq,)
        self.read_slots: torch.Tensor | None = None  # (batch * kv_len,)
        self.tables: torch.Tensor | None = None  # (batch, max_blocks): what our Triton attention reads
        self.batch, self.max_len = 1, num_blocks * block_size  # what the memory budget prices
        note(self, "kv_cache")

    @classmethod
    def from_budget(cls, cfg, gib: float, dtype: torch.dtype, device, block_size: int = BLOCK_SIZE,
                    kv_cache_dtype: str | None = None) -> PagedKVCache:
        """As many blocks as ``gib`` GiB holds (the two reserved ones included), scales included."""
        per_block = block_size * bytes_per_token(cfg, dtype, kv_cache_dtype)
        num_blocks = int(gib * 2**30) // per_block
        if num_blocks <= RESERVED:
            raise ValueError(f"--kv-cache-gib {gib} holds {num_blocks} blocks of {block_size} tokens "
                             f"({per_block} bytes each); at least {RESERVED + 1} are needed")
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks, dtype, device, block_size,
                   kv_cache_dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)

    @property
    def pools(self) -> list[torch.Tensor]:
        """Every tensor of the cache (values, then any scales), each laid out (slots, kv_heads, ...)."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold (every usable block)."""
        return self.allocator.usable * self.block_size

    def slots(self, tables: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Physical slots of logical ``positions`` (batch, n) given block ``tables`` (batch, max_blocks).

        Positions at or past a row's ``length`` map to the zero block, which is never written,
        so a read of them gives zeros (finite, and masked anyway) rather than a stale value.
        """
        bs = self.block_size
        idx = (positions // bs).clamp(max=tables.shape[1] - 1)
        out = tables.gather(1, idx) * bs + positions % bs
        if lengths is not None:
            out = torch.where(positions < lengths[:, None], out, ZERO_BLOCK * bs)
        return out

    def prepare(self, write_slots: torch.Tensor, read_slots: torch.Tensor, tables: torch.Tensor | None = None) -> None:
        """The next forward's slots, (batch, new) to write and (batch, kv_len) to read, flattened
        once for every layer, and the rows' block ``tables`` (read by our Triton attention, chapter 14)."""
        self.write_slots, self.read_slots = write_slots.flatten(), read_slots.flatten()
        self.tables = tables

    def layers(self, slots=None) -> list[PagedLayer]:
        """One view per layer. ``slots`` says where each forward writes and reads (``write_slots``,
        ``read_slots``, ``tables``, ``span_positions``): this cache itself, as ``prepare`` set them (the
        prefill path), or a decode state that computes them on the device (``step/paged.py``)."""
        scales = zip(self.k_scale, self.v_scale) if self.k_scale else [(None, None)] * len(self.k)
        return [PagedLayer(self.k[i], self.v[i], slots or self, self.block_size, ks, vs, self.dtype, self.kernels)
                for i, (ks, vs) in enumerate(scales)]


class PagedLayer:
    """One layer's view of the paged cache, passed to the model where the engine passes a ``KVLayer``."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots, block_size: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None, kernels: bool = False):
        self.k, self.v, self.slots, self.block_size = k, v, slots, block_size  # k, v: (slots, kv_heads, head_dim)
        self.k_scale, self.v_scale, self.dtype = k_scale, v_scale, dtype  # an int8 cache's: (slots, kv_heads)
        self.kernels = kernels  # our CPU kernels write it and attend over it (int8 only)

    @property
    def read_span(self) -> int | None:
        """The fixed read span of a fixed-shape step (``kv_len=None``): each row reads this many positions. From a
        decode state, the size of its ``span_positions`` buffer, which stays a symbol in the compiled step (an int
        would make every read span a compile of its own)."""
        span = getattr(self.slots, "span_positions", None)
        return None if span is None else span.shape[0]

    def write_read(self, k: torch.Tensor, v: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (batch, kv_heads, seq, head_dim) -> the rows' gathered keys and values,
        (batch, kv_heads, kv_len, head_dim). Writes first, so a token sees itself."""
        if self.k_scale is not None:
            kq, ks, vq, vs = self.write_read_int8(k, v, ctx)
            return dequantize(kq, ks, self.dtype), dequantize(vq, vs, self.dtype)  # what plain attention reads
        b, kvh, t, d = k.shape
        write, read = self.slots.write_slots, self.slots.read_slots
        out = []
        for pool, new in ((self.k, k), (self.v, v)):
            # index_copy_/index_select, not pool[slots]: advanced indexing is many times slower here
            pool.index_copy_(0, write, new.transpose(1, 2).reshape(b * t, kvh, d).to(pool.dtype))
            out.append(pool.index_select(0, read).unflatten(0, (b, -1)).transpose(1, 2))
        return out[0], out[1]

    def write_read_int8(self, k: torch.Tensor, v: torch.Tensor, ctx) -> tuple[torch.Tensor, ...]:
        """An int8 cache's ``write_read`` for a kernel that reads integers: quantizes and writes the new keys and
        values, then gathers the rows' (k, k_scale, v, v_scale), (batch, kv_heads, kv_len[, head_dim]): half the
        bytes of a 16-bit gather."""
        b, kvh, t, d = k.shape
        write, read = self.slots.write_slots, self.slots.read_slots
        out = []
        for pool, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            # (tokens, kv_heads, head_dim) int8, (tokens, kv_heads) fp32
            q, scale = quantized.write_quantize(new.transpose(1, 2).reshape(b * t, kvh, d), self.kernels)
            pool.index_copy_(0, write, q)
            scales.index_copy_(0, write, scale)
            out += [pool.index_select(0, read).unflatten(0, (b, -1)).transpose(1, 2),  # (batch, kv_heads, span, d)
                    scales.index_select(0, read).unflatten(0, (b, -1)).transpose(1, 2)]  # (batch, kv_heads, span)
        return tuple(out)

    def kernel_view(self, ctx, batch: int, seq: int) -> KernelCache:
        """The layer's pools, the physical slots to write and the block tables to read through."""
        from ..kernels.decode_attention import chunk_size  # Triton: imported only where the kernels run

        tables = self.slots.tables
        if tables is None:
            raise RuntimeError("the paged cache was prepared without block tables (prepare(..., tables))")
        kv_len = ctx.kv_len if ctx.kv_len is not None else self.read_span
        # chunks sized for one row, not the batch: a row's sums then do not depend on its neighbours
        # (the scheduler's batch invariance), as long as the read span is fixed (``read_span``)
        chunk = chunk_size(kv_len, 1, self.k.shape[1])
        return KernelCache(self.k, self.v, self.slots.write_slots.view(batch, seq), kv_len, tables,
                           self.block_size, chunk, self.k_scale, self.v_scale)
