"""Split-KV ("flash-decoding") attention for one or a few query tokens over a KV cache.

Defined in chapter 14 (writing our own kernels). A decode step has one query token per row
(a speculative verify a few), and after GQA folding the natural unit of work is one
(row, KV head): all ``groups`` query heads that share a KV head read its keys once. At
batch 1 that is only ``batch x kv_heads = 2`` work items; a kernel that gives each one
thread block uses 2 of a 132-SM GPU's SMs and streams the whole cache through them.

Flash-decoding splits the key axis too: one program per (row, KV head, key chunk). Each
program runs an online softmax over its chunk for every query row of its group and writes
a *partial* output, normalised within the chunk, with the chunk's log-sum-exp. A second,
small kernel merges the chunks of each (row, KV head): with ``L = logsumexp_c(lse_c)``,
``out = sum_c exp(lse_c - L) * o_c``, which is exactly the softmax over all keys.

The merge runs one program per (row, KV head, query row): 12 at batch 1 for this model's 6
query heads per KV head, each reading one (head_dim,) partial per chunk, not two programs
walking every chunk's whole (M, head_dim) tile in turn.

CUDA graphs: the launch grids depend only on shapes and ``kv_len``, never on tensor values
(the query positions live on the device), so a captured step replays for any position.
The cache buffer sets the number of chunks, the live context the work: a chunk past every
key its row's queries see ("empty") exits at once and writes nothing, and the merge,
which reads the same positions, stops before it. A short context in a long buffer costs
one program per empty chunk that reads the positions and stops.

An int8 cache (``cache/quantized.py``: int8 K/V, an fp32 scale per slot and KV head) is read as
it is stored: each K/V tile is loaded as int8 (half the bytes of fp16) and converted to q's
dtype, exactly (integers up to 127 are exact in fp16 and bf16); a key's scale multiplies its
column of scores after the dot, ``dot(q, k_int8^T) * k_scale[key]``, and a value's scale is
folded into the probabilities before the second dot, ``(p * v_scale[key]) @ v_int8``, so no
tile is ever dequantized.

Tiles: ``tiles`` picks the key block, warps and pipeline stages from the compute
capability. It is the one source of truth for the launcher and for the resource contract
(``contracts.py``, ``tests/test_kernels_contracts.py``), which compiles every configuration
the engine launches for a T4 and an H200 and checks registers, spills and shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import check_cache_dtypes, device_capability, interpreting

MIN_CHUNK, MAX_CHUNK = 64, 1024
TARGET_PROGRAMS = 256
MERGE_BLOCK = 16  # chunks the merge reads per iteration
LOG2E = 1.4426950408889634
SCALE_BYTES = 4  # an int8 cache's fp32 scale per (slot, KV head)


@dataclass(frozen=True)
class Tiles:
    """How a ``_partial_kernel`` program is laid out: keys per ``tl.dot``, warps, pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# The tiles before issue 26, on every GPU: 64 keys (32 in fp32), 4 warps, 3 stages. On a T4 they
# spill registers and fill its 64 KiB of shared memory; the contract test keeps them to show it.
LEGACY_TILES = {torch.float32: Tiles(32), torch.float16: Tiles(64), torch.bfloat16: Tiles(64)}


def tiles(capability: tuple[int, int] | None, dtype: torch.dtype, m: int) -> Tiles:
    """The tiles for ``m`` padded query rows (``rows_padded``) in ``dtype`` on a GPU of ``capability``
    (None: the interpreter), over a cache in ``dtype`` or an int8 one.

    Measured with the resource contract (``python -m engine_lib.kernels.contracts``), not guessed:
    - 16-bit dots from sm_80 run on tensor cores, with room to spare (an H200 block: 227 KiB of shared
      memory, 72-172 registers): 64 keys a block, loads pipelined over 3 stages;
    - below sm_80 (a T4: no tensor-core path in Triton, 64 KiB a block), and for fp32 anywhere (exact
      "ieee" dots), Triton multiplies with FMA and holds far more of each tile in registers: 64 keys in
      4 warps spill at every query length, and 32 still spill from 5 query tokens (M=32) on. 16 keys
      fit, within 48 KiB of shared memory, in 8 warps up to M=32 and in 16 at M=64 (6 to 8 tokens of a
      verify), where 8 warps sit at the register limit (fp32 on sm_90 spills there).
    The same tiles serve an int8 cache: its int8 tiles take less shared memory where loads are pipelined
    (sm_90: 23-83 KiB against 39-112), and the conversion and scales fit the registers (sm_90: 64-168, T4:
    64-128, no spill).
    """
    if capability is None:  # the interpreter: the block only changes the order of the sums
        return Tiles(32 if dtype == torch.float32 else 64)
    if capability >= (8, 0) and dtype != torch.float32:
        return Tiles(64)
    return Tiles(16, num_warps=8 if m <= 32 else 16, num_stages=1)


def chunk_size(span: int, batch: int, kv_heads: int) -> int:
    """Keys per program for ``span`` keys over ``batch x kv_heads`` (row, KV head) pairs."""
    # the smallest power of two giving at most TARGET_PROGRAMS programs, kept in
    # [MIN_CHUNK, MAX_CHUNK]: enough programs to fill a GPU, enough keys to amortise each
    keys_per_program = -(-span * batch * kv_heads // TARGET_PROGRAMS)
    return min(MAX_CHUNK, max(MIN_CHUNK, triton.next_power_of_2(keys_per_program)))


def bytes_moved(batch: int, heads: int, kv_heads: int, q_len: int, head_dim: int, kv_len: int,
                dtype_bytes: int, int8_cache: bool = False) -> int:
    """(2 * batch * kv_heads * kv_len + 2 * batch * heads * q_len) * head_dim * dtype_bytes: K, V, q, out.
    An int8 cache's K and V are 2 * batch * kv_heads * kv_len * (head_dim + 4) bytes: the integers and a scale."""
    if int8_cache:
        return 2 * batch * kv_heads * kv_len * (head_dim + SCALE_BYTES) + 2 * batch * heads * q_len * head_dim * dtype_bytes
    return (2 * batch * kv_heads * kv_len + 2 * batch * heads * q_len) * head_dim * dtype_bytes


def merge_bytes(batch: int, heads: int, q_len: int, head_dim: int, live_chunks: int) -> int:
    """2 * batch * heads * q_len * live_chunks * (head_dim + 1) * 4: each live chunk's fp32 partial output and
    lse, written by the partial kernel and read by the merge (empty chunks move nothing)."""
    return 2 * batch * heads * q_len * live_chunks * (head_dim + 1) * 4


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b in fp32; exact for fp32 inputs (no tf32)."""
    if UPCAST:  # Triton's interpreter multiplies bf16 operands as their raw uint16 bits (triton#11584)
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit(do_not_specialize=["kv_len", "num_chunks"])  # both change every step: no recompiles for them
def _partial_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, valid_ptr, table_ptr, o_ptr, lse_ptr,
                    sq_b, sq_h, sq_t, sq_d,
                    sk_b, sk_h, sk_n, sk_d,
                    sv_b, sv_h, sv_n, sv_d,
                    sks_b, sks_h, sks_n, svs_b, svs_h, svs_n,
                    spos_b, spos_t, svalid_b, svalid_n, stable_b, stable_n,
                    kv_len, num_chunks, qk_scale,
                    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, Q_LEN: tl.constexpr, M: tl.constexpr,
                    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_VALID: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
                    QUANT: tl.constexpr):
    """One (row, KV head, key chunk): the partial output (M, HEAD_DIM) and its log2-sum-exp (M,).

    An empty chunk (past the row's last query position) writes nothing: the merge never reads it.
    ``QUANT``: K/V are int8 with a scale per slot at ``ks_ptr``/``vs_ptr`` (row stride 0 when paged)."""
    pid, chunk = tl.program_id(0), tl.program_id(1)
    row, kv = (pid // KV_HEADS).to(tl.int64), pid % KV_HEADS
    # query row m is token m % Q_LEN of head kv * GROUPS + m // Q_LEN; rows past GROUPS * Q_LEN are padding
    m = tl.arange(0, M)
    m_ok = m < GROUPS * Q_LEN
    head, tok = kv * GROUPS + m // Q_LEN, m % Q_LEN
    pos = tl.load(pos_ptr + row * spos_b + tok * spos_t, mask=m_ok, other=-1)  # (M,)
    # keys past the last query's position are invisible to all: the live context ends there
    live = tl.minimum(tl.max(pos, axis=0) + 1, kv_len)
    start = chunk * CHUNK
    if start < live:
        stop = tl.minimum(start + CHUNK, live)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row * sq_b + head[:, None] * sq_h + tok[:, None] * sq_t + d[None, :] * sq_d,
                    mask=m_ok[:, None], other=0.0)  # (M, HEAD_DIM)
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
            k = tl.load(k_ptr + k_row + slot[:, None] * sk_n + d[None, :] * sk_d, mask=n_ok[:, None], other=0)
            v = tl.load(v_ptr + v_row + slot[:, None] * sv_n + d[None, :] * sv_d, mask=n_ok[:, None], other=0)
            if QUANT:  # int8 tiles: the integers are exact in q's dtype; each key's scale multiplies its column
                if UPCAST:  # the interpreter casts int8 to bf16 as raw bits: through fp32 (exact either way)
                    k, v = k.to(tl.float32), v.to(tl.float32)
                k, v = k.to(q.dtype), v.to(q.dtype)  # (BLOCK_N, HEAD_DIM)
                k_scale = tl.load(ks_ptr + row * sks_b + kv * sks_h + slot * sks_n, mask=n_ok, other=0.0)  # (BLOCK_N,)
                v_scale = tl.load(vs_ptr + row * svs_b + kv * svs_h + slot * svs_n, mask=n_ok, other=0.0)
                s = _dot(q, tl.trans(k), UPCAST) * (k_scale * qk_scale)[None, :]  # (M, BLOCK_N)
            else:
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
            if QUANT:  # the values' scales ride on p: the sum l_i above is of the unscaled p
                pv = p * v_scale[None, :]  # (M, BLOCK_N)
            else:
                pv = p
            acc = acc * alpha[:, None] + _dot(pv.to(v.dtype), v, UPCAST)
            m_i = m_new

        seen = l_i > 0.0  # False when the chunk saw no key of this query row (an earlier verify token)
        l_safe = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
        out = acc / l_safe[:, None]
        part = (pid * num_chunks + chunk).to(tl.int64) * M + m  # (M,) index into (batch * kv_heads, chunks, M)
        tl.store(lse_ptr + part, lse, mask=m_ok)  # padding rows: nothing to merge, nothing written
        tl.store(o_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=m_ok[:, None])


@triton.jit(do_not_specialize=["kv_len", "num_chunks"])
def _merge_kernel(o_ptr, lse_ptr, pos_ptr, out_ptr, spos_b, spos_t, kv_len, num_chunks,
                  KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, Q_LEN: tl.constexpr, M: tl.constexpr,
                  HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """One (row, KV head, query row m): out = sum_c exp2(lse_c - L) o_c / sum_c exp2(lse_c - L)
    over the live chunks c, with L their largest lse; written to its (head, token) of the output."""
    pid, m = tl.program_id(0), tl.program_id(1)
    row = pid // KV_HEADS
    # the live chunks, as the partial kernel counts them: up to the row's last query position
    last = tl.load(pos_ptr + row * spos_b)
    for t in tl.static_range(1, Q_LEN):
        last = tl.maximum(last, tl.load(pos_ptr + row * spos_b + t * spos_t))
    live_chunks = (tl.minimum(last + 1, kv_len) + CHUNK - 1) // CHUNK

    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, HEAD_DIM)
    base = pid.to(tl.int64) * num_chunks  # partials are (batch * kv_heads, chunks, M[, HEAD_DIM])
    # two passes over the lse (a few bytes a chunk): the largest first, so no running rescale
    big = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    for c0 in range(0, live_chunks, BLOCK_C):
        ok = c0 + c < live_chunks
        big = tl.maximum(big, tl.load(lse_ptr + (base + c0 + c) * M + m, mask=ok, other=float("-inf")))
    top = tl.max(big, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key seen at all (a position past kv_len): output 0
    total = tl.zeros((BLOCK_C,), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for c0 in range(0, live_chunks, BLOCK_C):
        ok = c0 + c < live_chunks
        part = (base + c0 + c) * M + m  # (BLOCK_C,)
        w = tl.exp2(tl.load(lse_ptr + part, mask=ok, other=float("-inf")) - top)  # (BLOCK_C,), 0 where masked
        o = tl.load(o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)  # (BLOCK_C, HEAD_DIM)
        total += w
        acc += tl.sum(w[:, None] * o, axis=0)
    norm = tl.sum(total, axis=0)
    out = acc / tl.where(norm == 0.0, 1.0, norm)
    # out is (batch, heads, q_len, head_dim) contiguous: query row m is head kv * GROUPS + m // Q_LEN,
    # token m % Q_LEN, so its flat row is pid * GROUPS * Q_LEN + m
    flat = pid.to(tl.int64) * (GROUPS * Q_LEN) + m
    tl.store(out_ptr + flat * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def _check(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size, kv_len, k_scale=None, v_scale=None) -> int:
    """Validate the inputs; return the span, the number of key positions considered."""
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, q_len, head_dim), got shape {tuple(q.shape)}")
    batch, heads, q_len, head_dim = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    check_cache_dtypes(k_cache, v_cache, k_scale, v_scale, q.dtype)
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    others = [t for t in (k_cache, v_cache, k_scale, v_scale, q_pos, key_valid, block_table) if t is not None]
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
                     block_size: int = 16, kv_len: int | None = None, chunk: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v over the cache's first ``kv_len`` positions, in two Triton launches.

    q: (batch, heads, q_len, head_dim), any strides. Contiguous cache: k/v_cache (batch, kv_heads,
    max_len, head_dim); paged (``block_table`` (batch, max_blocks)): pools (num_slots, kv_heads, head_dim).
    An int8 cache (``cache/quantized.py``) passes its fp32 scales, k_scale/v_scale (batch, kv_heads, max_len)
    or (num_slots, kv_heads): attention is over ``k_cache * k_scale`` and ``v_cache * v_scale``.
    Key p is visible to query j of row r iff p <= q_pos[r, j] and key_valid[r, p] (or p == q_pos[r, j]).
    ``chunk`` (a power of two >= 16) overrides ``chunk_size``. Returns (batch, heads, q_len, head_dim), q's dtype.
    """
    span = _check(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size, kv_len, k_scale, v_scale)
    batch = q.shape[0]
    kv_heads = k_cache.shape[1]  # (batch, kv_heads, ...) or (num_slots, kv_heads, ...)
    chunk = chunk_size(span, batch, kv_heads) if chunk is None else chunk
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    capability = None if interpreting() else device_capability(q.device)
    return _launch(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size, span, chunk,
                   tiles(capability, q.dtype, rows_padded(q.shape[1] // kv_heads, q.shape[2])), k_scale, v_scale)


def rows_padded(groups: int, q_len: int) -> int:
    """The query rows a program multiplies at once, ``groups * q_len`` padded: tl.dot needs >= 16."""
    return max(16, triton.next_power_of_2(groups * q_len))


def _partials(programs: int, num_chunks: int, m: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised buffers for the partial outputs (programs, chunks, m, head_dim) and lse (programs, chunks, m):
    only live chunks' real rows are written, and only those are read."""
    o_part = torch.empty(programs, num_chunks, m, head_dim, dtype=torch.float32, device=device)
    return o_part, torch.empty(programs, num_chunks, m, dtype=torch.float32, device=device)


def _launch(q, k_cache, v_cache, q_pos, key_valid, block_table, block_size: int, span: int, chunk: int,
            tile: Tiles, k_scale=None, v_scale=None) -> torch.Tensor:
    """The two launches, on checked inputs; ``tile`` from ``tiles`` (the contract test passes others)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    groups = heads // kv_heads
    num_chunks = triton.cdiv(span, chunk)
    block_n = min(tile.block_n, chunk)
    m = rows_padded(groups, q_len)
    o_part, lse_part = _partials(batch * kv_heads, num_chunks, m, head_dim, q.device)
    out = torch.empty(batch, heads, q_len, head_dim, dtype=q.dtype, device=q.device)

    paged = block_table is not None
    if paged:  # pools: (num_slots, kv_heads, head_dim); the slot replaces the (row, position) pair
        k_strides = (0, k_cache.stride(1), k_cache.stride(0), k_cache.stride(2))
        v_strides = (0, v_cache.stride(1), v_cache.stride(0), v_cache.stride(2))
    else:
        k_strides, v_strides = k_cache.stride(), v_cache.stride()
    valid = q_pos if key_valid is None else key_valid.view(torch.uint8)  # a stand-in pointer when absent
    table = q_pos if block_table is None else block_table
    quant = k_scale is not None
    if not quant:  # stand-ins, never read
        k_scale = v_scale = q_pos
        ks_strides = vs_strides = (0, 0, 0)
    elif paged:  # (num_slots, kv_heads): as the pools, no row stride
        ks_strides = (0, k_scale.stride(1), k_scale.stride(0))
        vs_strides = (0, v_scale.stride(1), v_scale.stride(0))
    else:  # (batch, kv_heads, max_len)
        ks_strides, vs_strides = k_scale.stride(), v_scale.stride()

    # grids from shapes and host ints only (CUDA graphs): (row x KV head, chunk), then (row x KV head, query row)
    _partial_kernel[(batch * kv_heads, num_chunks)](
        q, k_cache, v_cache, k_scale, v_scale, q_pos, valid, table, o_part, lse_part,
        *q.stride(), *k_strides, *v_strides, *ks_strides, *vs_strides,
        *q_pos.stride(), *valid.stride(), *table.stride(),
        span, num_chunks, head_dim**-0.5 * LOG2E,
        KV_HEADS=kv_heads, GROUPS=groups, Q_LEN=q_len, M=m, HEAD_DIM=head_dim, CHUNK=chunk,
        BLOCK_N=block_n, HAS_VALID=key_valid is not None, PAGED=paged, PAGE=block_size,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, QUANT=quant,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    _merge_kernel[(batch * kv_heads, groups * q_len)](
        o_part, lse_part, q_pos, out, *q_pos.stride(), span, num_chunks,
        KV_HEADS=kv_heads, GROUPS=groups, Q_LEN=q_len, M=m, HEAD_DIM=head_dim, CHUNK=chunk, BLOCK_C=MERGE_BLOCK,
        num_warps=1 if head_dim <= 64 else 2)
    return out
