"""RoPE on q and k, fused with the KV-cache write: one pass over the new q, k and v.

Defined in chapter 14 (writing our own kernels). The unfused step rotates q and k in place
(``model.layers.rope.apply_rope_``: read, write each) and then copies k and v into the cache (read,
write again), with the cos/sin rows gathered and cast into temporaries first. Here every
element of q, k and v is read once and written once: q back in place, the rotated k and
the plain v straight into the cache (``bytes_moved``). k itself is left as it came: attention
reads the keys from the cache, so writing them back would only cost bytes.

Grid: one program per (token, head), over the q heads and then the kv heads. A q program
rotates its head in place; a kv program rotates its k head into the cache and copies the v
head beside it. Each program handles the two halves of one head, (x[i], x[i + d/2]), the
pairs that "rotate half" RoPE turns by the same angle.

Both caches are handled through strides: the engine's ``KVCache`` layer, (batch, kv_heads,
max_len, head_dim) with ``slots`` the slot in each row, and the paged pool of
``cache/paged.py``, (num_slots, kv_heads, head_dim) with ``slots`` the physical slot,
where the row stride is 0 because all rows share one pool.

Numerics: as in the engine, the fp32 cos/sin tables are first rounded to q's dtype; then
``x1 * c - x2 * s`` and ``x2 * c + x1 * s`` are computed in fp32 and rounded once, where
torch rounds each product and the sum. The two agree bit for bit in fp32 up to fp32
rounding, and in bf16/fp16 to within an ulp of the inputs' size (the rounded products).

An int8 cache (``cache/quantized.py``: int8 values and an fp32 scale per slot and KV head) is
written in the same pass: the kv program quantizes its rotated k head, rounded to q's dtype
as above, and its v head in registers (amax over the head, ``scale = amax / 127``, values
rounded half away from zero) and stores the integers and the two scales: 2 (head_dim + 4)
bytes a KV head where a 16-bit cache takes 4 head_dim. The quantization is ``quantize``'s
rounding exactly (IEEE divisions, products and sums rounded one by one, no FMA), so the
integers are those of ``quantize`` applied to the kernel's rotated k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_cache_dtypes, unavailable_reason
from .rounding import round_to_dtype

QMAX = tl.constexpr(127.0)  # cache/quantized.py's (the kernels import nothing of the engine)
SCALE_BYTES = 4  # an fp32 scale per (token, KV head)


@triton.jit
def _rotate(base_ptr, dim_stride, offs, mask, c, s, HALF: tl.constexpr):
    """Load one head's halves at ``base_ptr`` and rotate them: (r1, r2) in fp32."""
    x1 = tl.load(base_ptr + offs * dim_stride, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_ptr + (offs + HALF) * dim_stride, mask=mask, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _quantize_store(dst, dim_stride, scale_dst, x1, x2, offs, mask, HALF: tl.constexpr):
    """Store one head, its halves ``x1``, ``x2`` (fp32, 0 where masked), as int8 at ``dst`` and its scale at
    ``scale_dst``: ``cache/quantized.quantize``'s arithmetic, op for op."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=0), tl.max(tl.abs(x2), axis=0))
    # div_rn: IEEE division as torch's (a plain fp32 "/" is approximate on a GPU)
    scale = tl.math.div_rn(amax, QMAX)
    inv = tl.where(amax > 0, tl.math.div_rn(QMAX, tl.where(amax > 0, amax, 1.0)), 0.0)  # an all-zero head: 0s
    tl.store(dst + offs * dim_stride, _round_int8(x1, inv), mask=mask)
    tl.store(dst + (offs + HALF) * dim_stride, _round_int8(x2, inv), mask=mask)
    tl.store(scale_dst, scale)


@triton.jit
def _round_int8(x, inv):
    """``x * inv`` rounded half away from zero, at most 127 in magnitude, as int8."""
    mag = tl.minimum(tl.floor(tl.abs(x) * inv + 0.5), QMAX)
    return tl.where(x < 0, -mag, mag).to(tl.int8)


@triton.jit
def _rope_kv_write_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        seq, heads, table_stride,
        q_sb, q_sh, q_st, q_sd, k_sb, k_sh, k_st, k_sd, v_sb, v_sh, v_st, v_sd,
        pos_sb, pos_st, slot_sb, slot_st,
        cache_sb, cache_sh, cache_ss, cache_sd,  # row (0 for the paged pool), head, slot, dim
        k_scale_ptr, v_scale_ptr, scale_sb, scale_sh, scale_ss,  # an int8 cache's scales: row, head, slot
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # int64: offsets into big caches pass 2^31
    head = tl.program_id(1)
    b, t = token // seq, token % seq
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF

    # the angle of pair (i, i + d/2) is in column i (and again in column i + d/2) of the tables
    pos = tl.load(pos_ptr + b * pos_sb + t * pos_st)
    dtype = q_ptr.dtype.element_ty
    c = round_to_dtype(tl.load(cos_ptr + pos * table_stride + offs, mask=mask, other=0.0), dtype).to(tl.float32)
    s = round_to_dtype(tl.load(sin_ptr + pos * table_stride + offs, mask=mask, other=0.0), dtype).to(tl.float32)

    if head < heads:  # a query head: rotate in place
        base = q_ptr + b * q_sb + head * q_sh + t * q_st
        r1, r2 = _rotate(base, q_sd, offs, mask, c, s, HALF)
        tl.store(base + offs * q_sd, round_to_dtype(r1, dtype), mask=mask)
        tl.store(base + (offs + HALF) * q_sd, round_to_dtype(r2, dtype), mask=mask)
    else:  # a kv head: rotated k and plain v into the cache slot
        kv_head = head - heads
        slot = tl.load(slot_ptr + b * slot_sb + t * slot_st)
        cache_offset = b * cache_sb + kv_head * cache_sh + slot * cache_ss
        r1, r2 = _rotate(k_ptr + b * k_sb + kv_head * k_sh + t * k_st, k_sd, offs, mask, c, s, HALF)
        k_dst = k_cache_ptr + cache_offset
        v_src = v_ptr + b * v_sb + kv_head * v_sh + t * v_st
        v_dst = v_cache_ptr + cache_offset
        if QUANT:  # the head in the model's dtype, as the engine would cache it, then quantized
            scale_offset = b * scale_sb + kv_head * scale_sh + slot * scale_ss
            _quantize_store(k_dst, cache_sd, k_scale_ptr + scale_offset, round_to_dtype(r1, dtype).to(tl.float32),
                            round_to_dtype(r2, dtype).to(tl.float32), offs, mask, HALF)
            v1 = tl.load(v_src + offs * v_sd, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + (offs + HALF) * v_sd, mask=mask, other=0.0).to(tl.float32)
            _quantize_store(v_dst, cache_sd, v_scale_ptr + scale_offset, v1, v2, offs, mask, HALF)
        else:
            tl.store(k_dst + offs * cache_sd, round_to_dtype(r1, dtype), mask=mask)
            tl.store(k_dst + (offs + HALF) * cache_sd, round_to_dtype(r2, dtype), mask=mask)
            tl.store(v_dst + offs * cache_sd, tl.load(v_src + offs * v_sd, mask=mask), mask=mask)
            tl.store(v_dst + (offs + HALF) * cache_sd, tl.load(v_src + (offs + HALF) * v_sd, mask=mask), mask=mask)


def _check(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    """ValueError (or RuntimeError: no way to run) before anything is launched."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be (batch, heads, seq, head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, _, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq, head_dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must be "
                         "(batch, kv_heads, seq, head_dim) with q's batch, seq and head_dim")
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs: head_dim must be even, got {head_dim}")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, idx in (("positions", positions), ("slots", slots)):
        if idx.shape != (batch, seq) or idx.is_floating_point() or idx.dtype == torch.bool:
            raise ValueError(f"{name} must be integer (batch, seq) = {(batch, seq)}, got {idx.dtype} "
                             f"{tuple(idx.shape)}")
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.ndim != 2 or table.shape[1] != head_dim or table.dtype != torch.float32 or table.stride(1) != 1:
            raise ValueError(f"{name} must be fp32 (max_positions, head_dim={head_dim}) with contiguous rows, "
                             f"got {table.dtype} {tuple(table.shape)}")
    if cos_table.shape != sin_table.shape or cos_table.stride() != sin_table.stride():
        raise ValueError("cos_table and sin_table must have the same shape and strides")
    _check_caches(k_cache, v_cache, batch, kv_heads, head_dim, q.dtype, k_scale, v_scale)
    tensors = (q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots,
               *(t for t in (k_scale, v_scale) if t is not None))
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"tensors on different devices: {sorted({str(t.device) for t in tensors})}")
    reason = unavailable_reason(q.device, q.dtype)
    if reason is not None:
        raise RuntimeError(reason)


def _check_caches(k_cache, v_cache, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  k_scale=None, v_scale=None) -> None:
    """Either layout, k and v alike (the kernel shares their strides), in the keys' dtype or int8 with scales."""
    if k_cache.ndim not in (3, 4):
        raise ValueError(f"k_cache must be 4-d (a row per sequence) or 3-d (a paged pool), got {tuple(k_cache.shape)}")
    if k_cache.ndim == 4 and (k_cache.shape[:2] != (batch, kv_heads) or k_cache.shape[3] != head_dim):
        raise ValueError(f"a contiguous cache must be (batch={batch}, kv_heads={kv_heads}, max_len, head_dim={head_dim}), "
                         f"got {tuple(k_cache.shape)}")
    if k_cache.ndim == 3 and k_cache.shape[1:] != (kv_heads, head_dim):
        raise ValueError(f"a paged pool must be (num_slots, kv_heads={kv_heads}, head_dim={head_dim}), "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)} and strides")
    check_cache_dtypes(k_cache, v_cache, k_scale, v_scale, dtype)


def rope_kv_write_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Rotate q in place; write rotated k and plain v into the caches at ``slots``. k and v are not changed.

    q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim); any strides (the
    slices of one packed projection are fine). positions, slots: (batch, seq) integers.
    cos_table, sin_table: fp32 (max_positions, head_dim), ``RotaryEmbedding``'s buffers.
    k_cache, v_cache: (batch, kv_heads, max_len, head_dim), ``slots`` the slot in each row; or a
    paged pool (num_slots, kv_heads, head_dim), ``slots`` physical. Slots are not range-checked:
    that would cost a host sync. An int8 cache (``cache/quantized.py``) passes its fp32 scales,
    k_scale/v_scale (batch, kv_heads, max_len) or (num_slots, kv_heads): each written head is quantized.
    """
    _check(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots, k_scale, v_scale)
    _launch(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots, k_scale, v_scale)


def _launch(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    """The launch, on checked inputs (the resource contract records it from here)."""
    batch, heads, seq, head_dim = q.shape
    if batch * seq == 0:
        return
    if k_cache.ndim == 4:
        cache_strides = k_cache.stride()  # (row, head, slot, dim)
    else:
        cache_strides = (0, k_cache.stride(1), k_cache.stride(0), k_cache.stride(2))  # one pool for all rows
    quant = k_scale is not None
    if not quant:  # stand-ins, never read
        k_scale = v_scale = k_cache
        scale_strides = (0, 0, 0)
    elif k_scale.ndim == 3:
        scale_strides = k_scale.stride()  # (row, head, slot)
    else:
        scale_strides = (0, k_scale.stride(1), k_scale.stride(0))  # one pool for all rows
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    grid = (batch * seq, heads + k.shape[1])
    # no FMA contraction for the int8 cache: torch rounds |x| * inv and its + 0.5 one by one, and a fused
    # multiply-add would move a value sitting on a rounding tie to the other integer
    fusion = {"enable_fp_fusion": False} if quant else {}
    _rope_kv_write_kernel[grid](
        q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots,
        seq, heads, cos_table.stride(0),
        *q.stride(), *k.stride(), *v.stride(), *positions.stride(), *slots.stride(), *cache_strides,
        k_scale, v_scale, *scale_strides,
        HALF=half, BLOCK_HALF=block_half, QUANT=quant, num_warps=max(1, min(block_half // 64, 4)), **fusion)


def bytes_moved(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int, int8_cache: bool = False) -> int:
    """tokens * (2 (heads + 2 kv_heads) head_dim dtype_bytes + 4 head_dim + 16): q, k, v each read and written once,
    half a row each of fp32 cos and sin, an int64 position and slot. An int8 cache writes k and v as
    2 kv_heads (head_dim + 4) bytes (the integers and an fp32 scale each) instead of 2 kv_heads head_dim dtype_bytes."""
    written = 2 * kv_heads * (head_dim + SCALE_BYTES) if int8_cache else 2 * kv_heads * head_dim * dtype_bytes
    return tokens * (2 * (heads + kv_heads) * head_dim * dtype_bytes + written + 2 * (head_dim // 2) * 4 + 2 * 8)
