"""Split-KV decode attention (chapter 14) against its PyTorch reference and SDPA.

On a CPU the kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``),
so shapes stay small; small chunks make even short caches span many chunks.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine_lib.book.kernel_references import decode_attention_reference  # noqa: E402
from engine_lib.kernels.decode_attention import (  # noqa: E402
    MAX_CHUNK,
    MIN_CHUNK,
    bytes_moved,
    chunk_size,
    decode_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def last_positions(batch, q_len, kv_len):
    """Every row's queries are the last q_len positions of kv_len: (batch, q_len) int64."""
    return torch.arange(kv_len - q_len, kv_len, device=DEVICE).expand(batch, q_len).contiguous()


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 32), (4, 2, 64), (6, 2, 32)])
def test_matches_reference_and_sdpa(dtype, q_len, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    batch, max_len, kv_len = 2, 48, 40  # 40 keys in chunks of 16: the last chunk is ragged
    q = randn(batch, heads, q_len, head_dim, dtype=dtype)
    k, v = randn(batch, kv_heads, max_len, head_dim, dtype=dtype), randn(batch, kv_heads, max_len, head_dim, dtype=dtype)
    q_pos = last_positions(batch, q_len, kv_len)

    out = decode_attention(q, k, v, q_pos, kv_len=kv_len, chunk=16)
    assert_close(out, decode_attention_reference(q, k, v, q_pos, kv_len=kv_len), dtype)

    g = heads // kv_heads
    mask = torch.arange(kv_len, device=DEVICE) <= q_pos[:, None, :, None]  # (batch, 1, q_len, kv_len)
    kr, vr = (x[:, :, :kv_len].float().repeat_interleave(g, dim=1) for x in (k, v))
    sdpa = F.scaled_dot_product_attention(q.float(), kr, vr, attn_mask=mask).to(dtype)
    assert_close(out, sdpa, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ragged_rows_left_padding_and_early_exit(dtype):
    torch.manual_seed(1)
    batch, heads, kv_heads, q_len, d, max_len, kv_len = 4, 6, 2, 2, 32, 80, 70
    q = randn(batch, heads, q_len, d, dtype=dtype)
    k, v = randn(batch, kv_heads, max_len, d, dtype=dtype), randn(batch, kv_heads, max_len, d, dtype=dtype)
    q_pos = torch.tensor([[68, 69],  # sees every chunk, the last ragged
                          [9, 10],  # visible keys end in the first chunk: the other four exit early
                          [40, 41],  # left padded below
                          [30, 31]], device=DEVICE)  # a padding row: no valid key, sees only itself
    key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=DEVICE)
    key_valid[2, :7] = False
    key_valid[3] = False

    out = decode_attention(q, k, v, q_pos, key_valid=key_valid, kv_len=kv_len, chunk=16)
    ref = decode_attention_reference(q, k, v, q_pos, key_valid=key_valid, kv_len=kv_len)
    assert out.isfinite().all()
    assert_close(out, ref, dtype)
    # the padding row's queries attend only to their own slot: the output is that slot's value
    own = v[3].repeat_interleave(heads // kv_heads, dim=0)[:, 30:32]  # (heads, q_len, head_dim)
    assert_close(out[3], own, dtype)


def test_strided_q_from_packed_projection():
    torch.manual_seed(2)
    batch, heads, kv_heads, q_len, d, max_len = 2, 4, 2, 3, 32, 64
    qkv = randn(batch, q_len, heads + 2 * kv_heads, d).transpose(1, 2)  # as Attention._project views it
    q = qkv[:, :heads]  # (batch, heads, q_len, head_dim), not contiguous
    assert not q.is_contiguous()
    k, v = randn(batch, kv_heads, max_len, d), randn(batch, kv_heads, max_len, d)
    q_pos = torch.tensor([[20, 21, 22], [50, 51, 52]], device=DEVICE)

    out = decode_attention(q, k, v, q_pos, chunk=32)
    assert_close(out, decode_attention_reference(q, k, v, q_pos), torch.float32)
    assert_close(out, decode_attention(q.contiguous(), k, v, q_pos, chunk=32), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_matches_contiguous(dtype):
    torch.manual_seed(3)
    batch, heads, kv_heads, q_len, d, block_size, max_blocks = 2, 4, 2, 1, 32, 16, 4
    num_blocks = batch * max_blocks + 3
    k_pool, v_pool = (randn(num_blocks * block_size, kv_heads, d, dtype=dtype) for _ in range(2))  # pools: (slots, kv_heads, d)
    block_table = torch.randperm(num_blocks, device=DEVICE)[: batch * max_blocks].view(batch, max_blocks)
    # the contiguous cache with the same keys: logical position p of row r from its physical slot
    p = torch.arange(max_blocks * block_size, device=DEVICE)
    slots = block_table[:, p // block_size] * block_size + p % block_size  # (batch, max_len)
    k, v = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)  # (batch, kv_heads, max_len, head_dim)
    q = randn(batch, heads, q_len, d, dtype=dtype)
    q_pos = torch.tensor([[57], [21]], device=DEVICE)
    key_valid = torch.ones(batch, max_blocks * block_size, dtype=torch.bool, device=DEVICE)
    key_valid[1, :3] = False

    for kv_len in (None, 58):
        paged = decode_attention(q, k_pool, v_pool, q_pos, key_valid=key_valid, block_table=block_table,
                                 block_size=block_size, kv_len=kv_len, chunk=16)
        contiguous = decode_attention(q, k, v, q_pos, key_valid=key_valid, kv_len=kv_len, chunk=16)
        ref = decode_attention_reference(q, k_pool, v_pool, q_pos, key_valid=key_valid, block_table=block_table,
                                         block_size=block_size, kv_len=kv_len)
        assert_close(paged, ref, dtype)
        assert_close(paged, contiguous, dtype)


def test_default_chunk():
    for span, batch, kv_heads in [(1, 1, 2), (40, 1, 2), (8192, 1, 2), (32768, 1, 4), (4096, 64, 4)]:
        c = chunk_size(span, batch, kv_heads)
        assert MIN_CHUNK <= c <= MAX_CHUNK and c & (c - 1) == 0
    assert 2 * -(-8192 // chunk_size(8192, 1, 2)) >= 128  # batch 1, 2 KV heads: still enough programs
    torch.manual_seed(4)
    q, k, v = randn(1, 2, 1, 32), randn(1, 1, 150, 32), randn(1, 1, 150, 32)
    q_pos = last_positions(1, 1, 150)
    assert_close(decode_attention(q, k, v, q_pos), decode_attention_reference(q, k, v, q_pos), torch.float32)


def test_bytes_moved_grows_linearly_with_kv_len():
    sizes = [bytes_moved(1, 14, 2, 1, 64, n, 2) for n in (1000, 2000, 3000)]
    assert sizes[1] - sizes[0] == sizes[2] - sizes[1] == 2 * 2 * 1000 * 64 * 2
    assert sizes[0] == (2 * 2 * 1000 + 2 * 14) * 64 * 2


def test_bad_input_raises_value_error():
    q, k, q_pos = randn(1, 3, 1, 32), randn(1, 2, 16, 32), last_positions(1, 1, 16)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        decode_attention(q, k, k, q_pos)
    with pytest.raises(ValueError, match="batch, heads, q_len, head_dim"):
        decode_attention(q[0], k, k, q_pos)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q[:, :2], k.bfloat16(), k.bfloat16(), q_pos)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(randn(1, 2, 1, 24), randn(1, 2, 16, 24), randn(1, 2, 16, 24), q_pos)
    with pytest.raises(ValueError, match="chunk"):
        decode_attention(q[:, :2], k, k, q_pos, chunk=24)
    with pytest.raises(ValueError, match="kv_len"):
        decode_attention(q[:, :2], k, k, q_pos, kv_len=17)
    with pytest.raises(ValueError, match="key_valid"):
        decode_attention(q[:, :2], k, k, q_pos, key_valid=torch.ones(1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="paged cache"):
        decode_attention(q[:, :2], k, k, q_pos, block_table=torch.zeros(1, 1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("paged", [False, True])
def test_empty_chunks_are_skipped_and_the_merge_matches_the_softmax(monkeypatch, paged):
    """Chunks past a row's last query position are neither written nor read: the partial buffers start as
    NaN, so one read of an unwritten chunk (or padding row) would poison the output."""
    import engine_lib.kernels.decode_attention as attention

    real = attention._partials
    monkeypatch.setattr(attention, "_partials", lambda *a: tuple(t.fill_(float("nan")) for t in real(*a)))
    torch.manual_seed(5)
    batch, heads, kv_heads, q_len, d, block_size, max_blocks = 3, 6, 2, 2, 32, 16, 10
    span = block_size * max_blocks  # 160 keys in 10 chunks of 16
    q = randn(batch, heads, q_len, d)
    q_pos = torch.tensor([[4, 5],  # one live chunk of ten
                          [15, 16],  # two: token 0 sees nothing of the second (its lse is -inf there)
                          [158, 159]], device=DEVICE)  # every chunk
    key_valid = torch.ones(batch, span, dtype=torch.bool, device=DEVICE)
    key_valid[1, :3] = False
    if paged:
        k = randn(batch * max_blocks * block_size, kv_heads, d)  # (num_slots, kv_heads, head_dim)
        v = randn(batch * max_blocks * block_size, kv_heads, d)
        table = torch.randperm(batch * max_blocks, device=DEVICE).view(batch, max_blocks)
    else:
        k, v, table = randn(batch, kv_heads, span, d), randn(batch, kv_heads, span, d), None
    out = decode_attention(q, k, v, q_pos, key_valid=key_valid, block_table=table, block_size=block_size,
                           kv_len=span, chunk=16)
    ref = decode_attention_reference(q, k, v, q_pos, key_valid=key_valid, block_table=table,
                                     block_size=block_size, kv_len=span)
    assert out.isfinite().all()
    assert_close(out, ref, torch.float32)


def test_launch_grids_come_from_shapes_not_positions():
    """CUDA graphs replay the grids they captured: the same shapes at other positions must launch alike,
    and the merge runs one program per (row x KV head, query row), not one per (row, KV head)."""
    from engine_lib.kernels.contracts import recording
    from engine_lib.kernels.decode_attention import Tiles, _launch

    batch, heads, kv_heads, q_len, d, span = 2, 6, 2, 3, 32, 128
    q, k = randn(batch, heads, q_len, d), randn(batch, kv_heads, span, d)
    grids = []
    for last in (10, 120):
        with recording() as calls:
            _launch(q, k, k, last_positions(batch, q_len, last + 1), None, None, 16, span, 32, Tiles(32))
        grids.append([grid for _, grid, _, _ in calls])
    assert grids[0] == grids[1] == [(batch * kv_heads, span // 32), (batch * kv_heads, heads // kv_heads * q_len)]


@pytest.mark.parametrize("capability", [(7, 5), (9, 0)])
def test_the_launch_takes_its_tiles_from_the_device_capability(monkeypatch, capability):
    """decode_attention launches what ``tiles`` says for the device: the function the contract test compiles."""
    import engine_lib.kernels.decode_attention as attention
    from engine_lib.kernels.contracts import recording

    monkeypatch.setattr(attention, "interpreting", lambda: False)
    monkeypatch.setattr(attention, "device_capability", lambda device: capability)
    q, k = randn(1, 12, 8, 128, dtype=torch.float16), randn(1, 2, 256, 128, dtype=torch.float16)
    with recording() as calls:
        decode_attention(q, k, k, last_positions(1, 8, 256))
    want = attention.tiles(capability, torch.float16, attention.rows_padded(6, 8))
    _, _, _, kwargs = calls[0]  # the partial kernel's launch
    assert (kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (want.block_n, want.num_warps,
                                                                           want.num_stages)


def int8_cache(shape, g):
    """Noisy keys or values whose size changes from slot to slot (so the per-slot scales matter), quantized:
    int8 (..., head_dim) and fp32 scales (...)."""
    from engine_lib.cache.quantized import quantize

    size = torch.rand(shape[:-1], generator=g)[..., None] + 0.5  # (..., 1): scales 3x apart
    return quantize(torch.randn(shape, generator=g) * size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_int8_cache_matches_attention_over_the_dequantized_cache(dtype, paged):
    """Over an int8 cache the kernel computes attention over ``dequantize``'s values: the scales applied per key
    column (K) and folded into p (V), with left padding, ragged chunks, an early exit and a verify's two tokens."""
    from engine_lib.cache.quantized import dequantize

    g = torch.Generator().manual_seed(6)
    batch, heads, kv_heads, q_len, d, block_size, max_blocks = 2, 6, 2, 2, 32, 16, 4
    span = block_size * max_blocks
    if paged:  # pools (num_slots, kv_heads, head_dim), scales (num_slots, kv_heads)
        (k, k_scale), (v, v_scale) = (int8_cache(((batch * max_blocks + 2) * block_size, kv_heads, d), g) for _ in "kv")
        table = 2 + torch.randperm(batch * max_blocks, generator=g).view(batch, max_blocks)
    else:  # (batch, kv_heads, max_len, head_dim), scales (batch, kv_heads, max_len)
        (k, k_scale), (v, v_scale) = (int8_cache((batch, kv_heads, span, d), g) for _ in "kv")
        table = None
    q = torch.randn(batch, heads, q_len, d, generator=g).to(dtype)
    q_pos = torch.tensor([[56, 57],  # four chunks of 16, the last ragged
                          [20, 21]])  # two live chunks, two that exit at once
    key_valid = torch.ones(batch, span, dtype=torch.bool)
    key_valid[1, :5] = False
    q, k, v, k_scale, v_scale, q_pos, key_valid = (t.to(DEVICE) for t in (q, k, v, k_scale, v_scale, q_pos, key_valid))
    table = None if table is None else table.to(DEVICE)

    out = decode_attention(q, k, v, q_pos, key_valid=key_valid, block_table=table, kv_len=58, chunk=16,
                           k_scale=k_scale, v_scale=v_scale)
    ref = decode_attention_reference(q, dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype), q_pos,
                                     key_valid=key_valid, block_table=table, kv_len=58)
    assert out.isfinite().all()
    # bf16: the reference rounds every dequantized value to bf16, the kernel rounds p * v_scale instead
    assert_close(out, ref, dtype)


def test_bad_scales_raise_value_error():
    q, q_pos = randn(1, 4, 1, 32), last_positions(1, 1, 16)
    k = torch.zeros(1, 2, 16, 32, dtype=torch.int8, device=DEVICE)
    scale = torch.ones(1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="an int8 cache needs k_scale and v_scale"):
        decode_attention(q, k, k, q_pos)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        decode_attention(q, k, k, q_pos, v_scale=scale)
    with pytest.raises(ValueError, match="go with an int8 cache"):
        decode_attention(q, k.float(), k.float(), q_pos, k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match=r"k_scale must be fp32 \(1, 2, 16\)"):
        decode_attention(q, k, k, q_pos, k_scale=scale.half(), v_scale=scale)
    with pytest.raises(ValueError, match=r"v_scale must be fp32 \(1, 2, 16\)"):
        decode_attention(q, k, k, q_pos, k_scale=scale, v_scale=scale[:, :, :8])
    with pytest.raises(ValueError, match=r"k_scale must be fp32 \(32, 2\)"):  # a pool's: (num_slots, kv_heads)
        pool = torch.zeros(32, 2, 32, dtype=torch.int8, device=DEVICE)
        decode_attention(q, pool, pool, q_pos, block_table=torch.zeros(1, 2, dtype=torch.long, device=DEVICE),
                         k_scale=scale, v_scale=scale)


def test_bytes_moved_int8_cache():
    # K and V as int8 plus an fp32 scale per key and KV head; q and out in the model's dtype
    assert bytes_moved(1, 12, 2, 1, 128, 1000, 2, int8_cache=True) == 2 * 2 * 1000 * (128 + 4) + 2 * 12 * 128 * 2
    assert bytes_moved(1, 12, 2, 1, 128, 1000, 2, int8_cache=True) < 0.55 * bytes_moved(1, 12, 2, 1, 128, 1000, 2)
