"""Split-KV ("flash-decoding") attention for one or a few query tokens over a KV cache.

Defined in chapter 13 (writing our own kernels). A decode step has one query token per row
(a speculative verify a few), and after GQA folding the natural unit of work is one
(row, KV head): all ``groups`` query heads that share a KV head read its keys once. At
batch 1 that is only ``batch x kv_heads = 2`` work items; a kernel that gives each one
thread block uses 2 of a 132-SM GPU's SMs and streams the whole cache through them.

Flash-decoding splits the key axis too: one program per (row, KV head, key chunk). Each
program runs an online softmax over its chunk for every query row of its group and writes
a *partial* output, normalised within the chunk, with the chunk's log-sum-exp. A second,
small kernel merges the chunks of each (row, KV head): with ``L = logsumexp_c(lse_c)``,
``out = sum_c exp(lse_c - L) * o_c``, which is exactly the softmax over all keys.

CUDA graphs: the launch grid depends only on shapes and ``kv_len``, never on tensor values
(the query positions live on the device), so a captured step replays for any position.
A program whose chunk lies past every key its queries see runs no loop iteration and
writes a -inf log-sum-exp and a zero partial, which the merge weights by zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache import visible_slots
from . import interpreting

BLOCK_N = 64  # keys per sub-block of a chunk (one tl.dot); 32 in fp32, whose tiles would overflow a T4's 64 KiB of shared memory
MIN_CHUNK, MAX_CHUNK = 64, 1024
TARGET_PROGRAMS = 256
LOG2E = 1.4426950408889634


def chunk_size(span: int, batch: int, kv_heads: int) -> int:
    """Keys per program for ``span`` keys over ``batch x kv_heads`` (row, KV head) pairs."""
    # the smallest power of two giving at most TARGET_PROGRAMS programs, kept in
    # [MIN_CHUNK, MAX_CHUNK]: enough programs to fill a GPU, enough keys to amortise each
    keys_per_program = -(-span * batch * kv_heads // TARGET_PROGRAMS)
    return min(MAX_CHUNK, max(MIN_CHUNK, triton.next_power_of_2(keys_per_program)))


def bytes_moved(batch: int, heads: int, kv_heads: int, q_len: int, head_dim: int, kv_len: int,
                dtype_bytes: int) -> int:
    """(2 * batch * kv_heads * kv_len + 2 * batch * heads * q_len) * head_dim * dtype_bytes: K, V, q, out."""
    return (2 * batch * kv_heads * kv_len + 2 * batch * heads * q_len) * head_dim * dtype_bytes


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b in fp32; exact for fp32 inputs (no tf32)."""
    if UPCAST:  # Triton's interpreter multiplies bf16 operands as their raw uint16 bits (triton#11584)
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, valid_ptr, table_ptr, o_ptr, lse_ptr,
                    sq_b, sq_h, sq_t, sq_d,
                    sk_b, sk_h, sk_n, sk_d,
                    sv_b, sv_h, sv_n, sv_d,
                    spos_b, spos_t, svalid_b, svalid_n, stable_b, stable_n,
                    kv_len, num_chunks, qk_scale,
                    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, Q_LEN: tl.constexpr, M: tl.constexpr,
                    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_VALID: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr):
    """One (row, KV head, key chunk): the partial output (M, HEAD_DIM) and its log2-sum-exp (M,)."""
    pid, chunk = tl.program_id(0), tl.program_id(1)
    row, kv = (pid // KV_HEADS).to(tl.int64), pid % KV_HEADS
    # query row m is token m % Q_LEN of head kv * GROUPS + m // Q_LEN; rows past GROUPS * Q_LEN are padding
    m = tl.arange(0, M)
    m_ok = m < GROUPS * Q_LEN
    head, tok = kv * GROUPS + m // Q_LEN, m % Q_LEN
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * sq_b + head[:, None] * sq_h + tok[:, None] * sq_t + d[None, :] * sq_d,
                mask=m_ok[:, None], other=0.0)  # (M, HEAD_DIM)
    pos = tl.load(pos_ptr + row * spos_b + tok * spos_t, mask=m_ok, other=-1)  # (M,)

    # keys past the last query's position are invisible to all: skip them (no iteration at all
    # when the chunk starts past them: the cheap exit the fixed grid needs)
    start = chunk * CHUNK
    stop = tl.minimum(tl.minimum(start + CHUNK, kv_len), tl.max(pos, axis=0) + 1)

    m_i = tl.full((M,), float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros((M,), tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((M, HEAD_DIM), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        if PAGED:  # logical position -> physical slot through the block table
            block = tl.load(table_ptr + row * stable_b + (n // PAGE) * stable_n, mask=n_ok, other=0)
            slot, k_row, v_row = block * PAGE + n % PAGE, kv * sk_h, kv * sv_h
        else:
            slot, k_row, v_row = n.to(tl.int64), row * sk_b + kv * sk_h, row * sv_b + kv * sv_h
        k = tl.load(k_ptr + k_row + slot[:, None] * sk_n + d[None, :] * sk_d, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + v_row + slot[:, None] * sv_n + d[None, :] * sv_d, mask=n_ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale  # (M, BLOCK_N)

        causal = n[None, :] <= pos[:, None]
        if HAS_VALID:  # left padding hides keys, but a query always sees its own slot
            valid = tl.load(valid_ptr + row * svalid_b + n * svalid_n, mask=n_ok, other=0) != 0
            causal = (causal & valid[None, :]) | (n[None, :] == pos[:, None])
        s = tl.where(causal & n_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # (M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    seen = l_i > 0.0  # False when the chunk saw no key of this row: lse -inf, output zero
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    part = (pid * num_chunks + chunk).to(tl.int64) * M + m  # (M,) index into (batch * kv_heads, chunks, M)
    tl.store(lse_ptr + part, lse)
    tl.store(o_ptr + part[:, None] * HEAD_DIM + d[None, :], out)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, num_chunks,
                  KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, Q_LEN: tl.constexpr, M: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """One (row, KV head): out = sum_c exp2(lse_c - L) o_c / sum_c exp2(lse_c - L), written per query head."""
    pid = tl.program_id(0)
    m = tl.arange(0, M)
    d = tl.arange(0, HEAD_DIM)
    big = tl.full((M,), float("-inf"), tl.float32)  # running max of the chunks' lse
    total = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, HEAD_DIM), tl.float32)
    for c in range(num_chunks):
        part = (pid * num_chunks + c).to(tl.int64) * M + m
        lse = tl.load(lse_ptr + part)
        o = tl.load(o_ptr + part[:, None] * HEAD_DIM + d[None, :])
        big_new = tl.maximum(big, lse)
        safe = tl.where(big_new == float("-inf"), 0.0, big_new)
        alpha, w = tl.exp2(big - safe), tl.exp2(lse - safe)
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        big = big_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    # out is (batch, heads, q_len, head_dim) contiguous: row m is head kv * GROUPS + m // Q_LEN, token m % Q_LEN
    row, kv = pid // KV_HEADS, pid % KV_HEADS
    flat = ((row * KV_HEADS + kv) * GROUPS * Q_LEN + m).to(tl.int64)  # = (row * heads + head) * q_len + token
    tl.store(out_ptr + flat[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(m < GROUPS * Q_LEN)[:, None])


def _check(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size, kv_len) -> int:
    """Validate the inputs; return the span, the number of key positions considered."""
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, q_len, head_dim), got shape {tuple(q.shape)}")
    batch, heads, q_len, head_dim = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache must match q's dtype {q.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    others = [t for t in (k_cache, v_cache, q_pos, key_valid, block_table) if t is not None]
    if any(t.device != q.device for t in others):
        raise ValueError(f"every tensor must be on q's device {q.device}")
    if block_table is None:
        if k_cache.dim() != 4 or k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous cache must be (batch={batch}, kv_heads, max_len, head_dim), "
                             f"got {tuple(k_cache.shape)}")
        buffer = k_cache.shape[2]
    else:
        if k_cache.dim() != 3:
            raise ValueError(f"a paged cache must be (num_slots, kv_heads, head_dim), got {tuple(k_cache.shape)}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_table must be (batch={batch}, max_blocks) int32/int64, "
                             f"got {tuple(block_table.shape)} {block_table.dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        buffer = block_table.shape[1] * block_size
    kv_heads = k_cache.shape[1]  # both layouts
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"the cache's head_dim {k_cache.shape[-1]} differs from q's {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if q_pos.shape != (batch, q_len) or q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"q_pos must be (batch={batch}, q_len={q_len}) int64, got {tuple(q_pos.shape)} {q_pos.dtype}")
    span = buffer if kv_len is None else kv_len
    if not 0 < span <= buffer:
        raise ValueError(f"kv_len must be in [1, {buffer}], got {kv_len}")
    if key_valid is not None and (key_valid.dtype != torch.bool or key_valid.dim() != 2
                                  or key_valid.shape[0] != batch or key_valid.shape[1] < span):
        raise ValueError(f"key_valid must be (batch={batch}, >= {span}) bool, got {tuple(key_valid.shape)} {key_valid.dtype}")
    return span


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                     key_valid: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     block_size: int = 16, kv_len: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v over the cache's first ``kv_len`` positions, in two Triton launches.

    q: (batch, heads, q_len, head_dim), any strides. Contiguous cache: k/v_cache (batch, kv_heads,
    max_len, head_dim); paged (``block_table`` (batch, max_blocks)): pools (num_slots, kv_heads, head_dim).
    Key p is visible to query j of row r iff p <= q_pos[r, j] and key_valid[r, p] (or p == q_pos[r, j]).
    ``chunk`` (a power of two >= 16) overrides ``chunk_size``. Returns (batch, heads, q_len, head_dim), q's dtype.
    """
    span = _check(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size, kv_len)
    batch, heads, q_len, head_dim = q.shape
    kv_heads = k_cache.shape[1]  # (batch, kv_heads, ...) or (num_slots, kv_heads, ...)
    groups = heads // kv_heads
    chunk = chunk_size(span, batch, kv_heads) if chunk is None else chunk
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    num_chunks = triton.cdiv(span, chunk)
    block_n = min(BLOCK_N // 2 if q.dtype == torch.float32 else BLOCK_N, chunk)
    m = max(16, triton.next_power_of_2(groups * q_len))  # tl.dot needs >= 16 rows

    o_part = torch.empty(batch * kv_heads, num_chunks, m, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch * kv_heads, num_chunks, m, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, q_len, head_dim, dtype=q.dtype, device=q.device)

    paged = block_table is not None
    if paged:  # pools: (num_slots, kv_heads, head_dim); the slot replaces the (row, position) pair
        k_strides = (0, k_cache.stride(1), k_cache.stride(0), k_cache.stride(2))
        v_strides = (0, v_cache.stride(1), v_cache.stride(0), v_cache.stride(2))
    else:
        k_strides, v_strides = k_cache.stride(), v_cache.stride()
    valid = q_pos if key_valid is None else key_valid.view(torch.uint8)  # a stand-in pointer when absent
    table = q_pos if block_table is None else block_table

    _partial_kernel[(batch * kv_heads, num_chunks)](
        q, k_cache, v_cache, q_pos, valid, table, o_part, lse_part,
        *q.stride(), *k_strides, *v_strides,
        *q_pos.stride(), *valid.stride(), *table.stride(),
        span, num_chunks, head_dim**-0.5 * LOG2E,
        KV_HEADS=kv_heads, GROUPS=groups, Q_LEN=q_len, M=m, HEAD_DIM=head_dim, CHUNK=chunk,
        BLOCK_N=block_n, HAS_VALID=key_valid is not None, PAGED=paged, PAGE=block_size,
        UPCAST=interpreting() and q.dtype == torch.bfloat16)
    _merge_kernel[(batch * kv_heads,)](o_part, lse_part, out, num_chunks,
                                       KV_HEADS=kv_heads, GROUPS=groups, Q_LEN=q_len, M=m, HEAD_DIM=head_dim)
    return out


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
