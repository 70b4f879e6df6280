"""engine_lib/kernels/rope_kv_write.py under Triton's interpreter: RoPE fused with the KV-cache write,
against its reference and the engine's own ``apply_rope_`` + ``write_kv`` / ``PagedLayer`` (chapter 14)."""

import pytest
import torch

pytest.importorskip("triton")

# CPU tensors under Triton's interpreter; on a GPU, tests/test_gpu.py runs these kernels compiled
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: on a GPU see tests/test_gpu.py")

from engine_lib.book.kernel_references import rope_kv_write_reference  # noqa: E402
from engine_lib.cache.contiguous import write_kv  # noqa: E402
from engine_lib.cache.paged import PagedKVCache  # noqa: E402
from engine_lib.kernels.rope_kv_write import bytes_moved, rope_kv_write_  # noqa: E402
from engine_lib.model.layers.rope import RotaryEmbedding, apply_rope_  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MAX_POS, NUM_BLOCKS = 4096, 6  # the pool: 6 blocks of 16 slots


def packed_qkv(batch, seq, heads, kv_heads, head_dim, dtype, seed=0):
    """One packed projection output and its q, k, v views, as ``Attention._project`` makes them."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    return qkv, *split(qkv, heads, kv_heads, head_dim)


def split(qkv, heads, kv_heads, head_dim):
    b, t, _ = qkv.shape
    views = qkv.view(b, t, heads + 2 * kv_heads, head_dim).transpose(1, 2)
    return views.split([heads, kv_heads, kv_heads], dim=1)  # (batch, heads or kv_heads, seq, head_dim)


def pair_tolerance(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An ulp of each pair's size: the kernel rounds once where torch rounds each product."""
    half = x.shape[-1] // 2
    size = x[..., :half].float().abs() + x[..., half:].float().abs()
    return torch.cat([size, size], dim=-1) * torch.finfo(dtype).eps


def assert_rope_close(got, want, original, dtype):
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert ((got.float() - want.float()).abs() <= pair_tolerance(original, dtype)).all()


def random_caches(paged: bool, batch, kv_heads, head_dim, dtype, max_len=10):
    """k and v caches filled with noise, so a write outside the slots would show."""
    shape = (NUM_BLOCKS * 16, kv_heads, head_dim) if paged else (batch, kv_heads, max_len, head_dim)
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def pick_slots(paged: bool, batch: int, seq: int, max_len=10):
    g = torch.Generator().manual_seed(2)
    if paged:  # rows share the pool: distinct physical slots scattered over blocks 2.. (0, 1 reserved)
        return (32 + torch.randperm(NUM_BLOCKS * 16 - 32, generator=g)[:batch * seq]).view(batch, seq)
    return torch.stack([torch.randperm(max_len, generator=g)[:seq] for _ in range(batch)])


def engine_write(k_cache, v_cache, k, v, slots):
    """The engine's own cache write into copies of the caches: ``write_kv``, or ``PagedLayer.write_read``."""
    if k_cache.ndim == 4:
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        write_kv(k_cache, v_cache, k, v, torch.arange(k.shape[0])[:, None], slots, None)
        return k_cache, v_cache
    pool = PagedKVCache(1, k.shape[1], k.shape[3], NUM_BLOCKS, k.dtype, "cpu")
    pool.k[0].copy_(k_cache)
    pool.v[0].copy_(v_cache)
    pool.prepare(slots, slots)
    pool.layers()[0].write_read(k, v, None)
    return pool.k[0], pool.v[0]


def cache_rows(cache, slots):
    """What the slots hold, one row per token: (batch, seq, kv_heads, head_dim)."""
    if cache.ndim == 3:
        return cache[slots]
    return cache[torch.arange(slots.shape[0])[:, None], :, slots]


CASES = [  # (batch, seq, heads, kv_heads, head_dim): GQA, a prefill and decode steps, half = 48 is masked
    (2, 3, 4, 2, 64),
    (3, 1, 4, 2, 96),
    (1, 5, 2, 1, 32),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
@pytest.mark.parametrize("batch,seq,heads,kv_heads,head_dim", CASES)
def test_matches_engine_and_reference(batch, seq, heads, kv_heads, head_dim, paged, dtype):
    rope = RotaryEmbedding(head_dim, MAX_POS, 1e6)
    positions = torch.randint(0, MAX_POS, (batch, seq), generator=torch.Generator().manual_seed(3))
    slots = pick_slots(paged, batch, seq)
    qkv, q, k, v = packed_qkv(batch, seq, heads, kv_heads, head_dim, dtype)
    original = qkv.clone()
    q0, k0, _ = split(original, heads, kv_heads, head_dim)
    k_cache, v_cache = random_caches(paged, batch, kv_heads, head_dim, dtype)
    k_before = k_cache.clone()

    # the engine: apply_rope_ on views of its own copy of the projection, then its cache write
    eq, ek, ev = split(original.clone(), heads, kv_heads, head_dim)
    cos, sin = rope(positions, dtype)
    apply_rope_(eq, cos, sin)
    apply_rope_(ek, cos, sin)
    want_k, want_v = engine_write(k_cache, v_cache, ek, ev, slots)
    # the reference is the engine's code: the same bits
    rq, rk, rv = split(original.clone(), heads, kv_heads, head_dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    rope_kv_write_reference(rq, rk, rv, positions, rope.cos_table, rope.sin_table, ref_k, ref_v, slots)
    assert torch.equal(rq, eq) and torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)

    rope_kv_write_(q, k, v, positions, rope.cos_table, rope.sin_table, k_cache, v_cache, slots)

    # q rotated in place, inside the packed buffer; k and v left as they came
    q_cols = heads * head_dim
    assert not torch.equal(qkv[..., :q_cols], original[..., :q_cols])
    assert torch.equal(qkv[..., q_cols:], original[..., q_cols:])
    assert_rope_close(q, eq, q0, dtype)
    # the caches: v copied exactly, k rotated, every other slot untouched
    assert torch.equal(v_cache, want_v)
    written = torch.zeros(k_cache.shape[:-1], dtype=torch.bool)
    if paged:
        written[slots.flatten()] = True
    else:
        written[torch.arange(batch)[:, None], :, slots] = True
    assert torch.equal(k_cache[~written], k_before[~written])
    assert_rope_close(cache_rows(k_cache, slots), cache_rows(want_k, slots), k0.transpose(1, 2), dtype)


def test_bad_inputs_raise():
    rope = RotaryEmbedding(64, 128, 1e6)
    _, q, k, v = packed_qkv(1, 2, 4, 2, 64, F32)
    positions = slots = torch.zeros(1, 2, dtype=torch.long)
    k_cache, v_cache = torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64)
    args = dict(positions=positions, cos_table=rope.cos_table, sin_table=rope.sin_table, slots=slots)
    with pytest.raises(ValueError, match="share one floating dtype"):
        rope_kv_write_(q, k.bfloat16(), v, k_cache=k_cache, v_cache=v_cache, **args)
    with pytest.raises(ValueError, match="caches in"):
        rope_kv_write_(q, k, v, k_cache=k_cache.half(), v_cache=v_cache.half(), **args)
    with pytest.raises(ValueError, match="positions must be integer"):
        rope_kv_write_(q, k, v, k_cache=k_cache, v_cache=v_cache, **{**args, "positions": positions.float()})
    with pytest.raises(ValueError, match="4-d .* or 3-d"):
        rope_kv_write_(q, k, v, k_cache=k_cache[None], v_cache=v_cache[None], **args)
    with pytest.raises(ValueError, match="paged pool must be"):
        rope_kv_write_(q, k, v, k_cache=torch.zeros(8, 3, 64), v_cache=torch.zeros(8, 3, 64), **args)
    with pytest.raises(ValueError, match="head_dim must be even"):
        odd = torch.zeros(1, 1, 2, 63)
        rope_kv_write_(odd, odd, odd, k_cache=torch.zeros(1, 1, 8, 63), v_cache=torch.zeros(1, 1, 8, 63), **args)


def test_bytes_moved():
    # a decode token of Qwen2.5-0.5B in bf16: 14 query heads, 2 kv heads, head_dim 64
    per_token = 2 * (14 + 2 * 2) * 64 * 2 + 64 * 4 + 16
    assert bytes_moved(1, 14, 2, 64, 2) == per_token
    assert bytes_moved(5, 14, 2, 64, 2) == 5 * per_token
    # op by op: q and k rotated in place (read + write), then k and v read and written into the cache
    unfused = 2 * (14 + 2) * 64 * 2 + 2 * (2 * 2) * 64 * 2
    assert bytes_moved(1, 14, 2, 64, 2) < unfused


def kernel_rotation(k, positions, rope, dtype):
    """The kernel's rotated k in torch: cos/sin rounded to ``dtype``, fp32 products and sums, rounded once to
    ``dtype``. (batch, kv_heads, seq, head_dim)."""
    half = k.shape[-1] // 2
    cos = rope.cos_table[positions].to(dtype).float()[:, None, :, :half]  # (batch, 1, seq, half)
    sin = rope.sin_table[positions].to(dtype).float()[:, None, :, :half]
    k1, k2 = k.float()[..., :half], k.float()[..., half:]
    return torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1).to(dtype)


def int8_caches(paged: bool, batch, kv_heads, head_dim, max_len=10):
    """int8 k and v caches and their fp32 scales, filled with noise: a write outside the slots would show."""
    k_cache, v_cache = (x.mul(40).clamp(-127, 127).to(torch.int8)
                        for x in random_caches(paged, batch, kv_heads, head_dim, F32, max_len))
    g = torch.Generator().manual_seed(4)
    k_scale, v_scale = torch.rand(k_cache.shape[:-1], generator=g), torch.rand(k_cache.shape[:-1], generator=g)
    return k_cache, v_cache, k_scale, v_scale


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_int8_cache_holds_quantize_of_the_rotated_keys(paged, dtype):
    """The kernel quantizes as ``cache.quantized.quantize`` does, bit for bit: the same integers, the same scales."""
    from engine_lib.cache.quantized import quantize

    batch, seq, heads, kv_heads, head_dim = 2, 3, 4, 2, 96  # half = 48 of a 64 block: masked lanes must not count
    rope = RotaryEmbedding(head_dim, MAX_POS, 1e6)
    positions = torch.randint(0, MAX_POS, (batch, seq), generator=torch.Generator().manual_seed(3))
    slots = pick_slots(paged, batch, seq)
    qkv, q, k, v = packed_qkv(batch, seq, heads, kv_heads, head_dim, dtype)
    # ties of the rounding (amax 127: scale 1, x.5 rounds away from zero), and an all-zero head (scale 0)
    v[0, 0, 0] = 0.0
    v[0, 0, 0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, -126.5])
    v[1, 1, 2] = 0.0
    original = qkv.clone()
    q0, _, _ = split(original, heads, kv_heads, head_dim)
    k_cache, v_cache, k_scale, v_scale = int8_caches(paged, batch, kv_heads, head_dim)
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]

    rope_kv_write_(q, k, v, positions, rope.cos_table, rope.sin_table, k_cache, v_cache, slots, k_scale, v_scale)

    # q rotated in place exactly as with a model-dtype cache; k and v left as they came
    eq, _, _ = split(original.clone(), heads, kv_heads, head_dim)
    cos, sin = rope(positions, dtype)
    apply_rope_(eq, cos, sin)
    assert_rope_close(q, eq, q0, dtype)
    assert torch.equal(qkv[..., heads * head_dim:], original[..., heads * head_dim:])
    rotated = kernel_rotation(k, positions, rope, dtype)
    if dtype == F32:  # the kernel's rotation is the engine's in fp32
        ek = k.clone()
        apply_rope_(ek, cos, sin)
        assert torch.equal(rotated, ek)
    for cache, scale, new in ((k_cache, k_scale, rotated), (v_cache, v_scale, v)):
        want_q, want_scale = quantize(new.transpose(1, 2))  # (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads)
        assert torch.equal(cache_rows(cache, slots), want_q)
        assert torch.equal(cache_rows(scale[..., None], slots)[..., 0], want_scale)
    assert cache_rows(v_cache, slots)[0, 0, 0, :6].tolist() == [127, 3, -4, 1, -1, -127]
    assert cache_rows(v_scale[..., None], slots)[1, 2, 1].item() == 0.0
    # every other slot untouched, values and scales
    written = torch.zeros(k_cache.shape[:-1], dtype=torch.bool)
    if paged:
        written[slots.flatten()] = True
    else:
        written[torch.arange(batch)[:, None], :, slots] = True
    for now, then in zip((k_cache, v_cache, k_scale, v_scale), before):
        assert torch.equal(now[~written], then[~written])


def test_bad_scales_raise():
    rope = RotaryEmbedding(64, 128, 1e6)
    _, q, k, v = packed_qkv(1, 2, 4, 2, 64, F32)
    positions = slots = torch.zeros(1, 2, dtype=torch.long)
    k_cache, v_cache = torch.zeros(1, 2, 8, 64, dtype=torch.int8), torch.zeros(1, 2, 8, 64, dtype=torch.int8)
    scale = torch.zeros(1, 2, 8)
    args = dict(positions=positions, cos_table=rope.cos_table, sin_table=rope.sin_table, slots=slots)
    with pytest.raises(ValueError, match="an int8 cache needs k_scale and v_scale"):
        rope_kv_write_(q, k, v, k_cache=k_cache, v_cache=v_cache, **args)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        rope_kv_write_(q, k, v, k_cache=k_cache, v_cache=v_cache, k_scale=scale, **args)
    with pytest.raises(ValueError, match="go with an int8 cache"):
        rope_kv_write_(q, k, v, k_cache=k_cache.float(), v_cache=v_cache.float(), k_scale=scale, v_scale=scale, **args)
    with pytest.raises(ValueError, match=r"v_scale must be fp32 \(1, 2, 8\)"):
        rope_kv_write_(q, k, v, k_cache=k_cache, v_cache=v_cache, k_scale=scale, v_scale=scale.bfloat16(), **args)
    with pytest.raises(ValueError, match=r"k_scale must be fp32 \(16, 2\)"):  # a paged pool's: (num_slots, kv_heads)
        pool = torch.zeros(16, 2, 64, dtype=torch.int8)
        rope_kv_write_(q, k, v, k_cache=pool, v_cache=pool, k_scale=scale, v_scale=scale, **args)
    with pytest.raises(ValueError, match="strides"):
        rope_kv_write_(q, k, v, k_cache=k_cache, v_cache=v_cache, k_scale=scale,
                       v_scale=torch.zeros(1, 8, 2).transpose(1, 2), **args)


def test_bytes_moved_int8_cache():
    # Qwen2.5-1.5B in bf16: 12 query heads, 2 kv heads, head_dim 128; k and v go into the cache as int8 and a scale
    per_token = 2 * (12 + 2) * 128 * 2 + 2 * 2 * (128 + 4) + 128 * 4 + 16
    assert bytes_moved(3, 12, 2, 128, 2, int8_cache=True) == 3 * per_token
    assert bytes_moved(1, 12, 2, 128, 2) - bytes_moved(1, 12, 2, 128, 2, int8_cache=True) == 2 * 2 * (128 * 2 - 128 - 4)
