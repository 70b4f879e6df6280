"""cpu.kv_attention: attention straight over the int8 KV cache (C++) against the fp32 attention of the
dequantized cache, on the views the caches hand it (a slice of the buffer, a paged gather), with and
without a mask, and inside a compiled function; the same loops over a bf16 or fp32 cache (``kv_attention``),
and a half-precision model on a CPU whose decode steps use it, against SDPA's logits.

Skipped where our CPU kernels cannot be built (not x86 AVX2, no compiler)."""

import pytest
import torch

from engine_lib.cache.quantized import quantize
from engine_lib.cpu import kernels as cpu_kernels
from engine_lib.cpu import kv_attention
from engine_lib.cpu.kv_attention import MAX_QUERY, int8_kv_attention, reference
from engine_lib.cpu.kv_attention import kv_attention as float_kv_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"our CPU kernels: {cpu_kernels.unavailable_reason()}")
D = 128
BATCH = 2


def _cache(heads_kv: int, s: int, layout: str, seed: int = 0):
    """int8 k, v (BATCH, heads_kv, s, D) and their fp32 scales, as views like the caches': "slice" takes the
    first s slots of a longer (batch, kv_heads, max_len, D) buffer, "gather" transposes a (batch, s, kv_heads, D)
    gather of the paged pool."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for spread in (3.0, 1.0):  # keys with a few large channels, as Qwen's
        x = torch.randn(BATCH, heads_kv, s + 5, D, generator=g) * spread
        x[..., 7] *= 8
        q, scale = quantize(x)
        if layout == "slice":
            out += [q[:, :, :s], scale[:, :, :s]]
        else:  # the pool as (tokens, kv_heads, D) gathered per row, then (batch, kv_heads, s, D)
            qt, st = q.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()  # (batch, s + 5, kv_heads, ...)
            out += [qt[:, 2:s + 2].transpose(1, 2), st[:, 2:s + 2].transpose(1, 2)]
    k, ks, v, vs = out
    return k, ks, v, vs


def _mask(t: int, s: int, kind: str):
    if kind == "none":
        return None
    if kind == "expanded":  # one (1, 1, t, s) mask for every row of the batch, a stride-0 view along t
        return torch.ones(1, 1, 1, s, dtype=torch.bool).expand(1, 1, t, s)
    g = torch.Generator().manual_seed(s + t)
    m = torch.rand(BATCH, 1, t, s, generator=g) < 0.7
    m[..., 0] = True  # every row sees a key, apart from the one below
    m[1, 0, t - 1] = False  # the last row of the second sequence sees nothing
    return m


def _check(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.isfinite(got).all()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # the same fp32 sums to fp32 rounding, each rounded once to bf16: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("s,layout", [(1, "slice"), (17, "gather"), (300, "slice"), (2048, "gather")])
@pytest.mark.parametrize("heads,heads_kv", [(12, 2), (2, 2)])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_equals_the_fp32_attention_of_the_dequantized_cache(dtype, t, heads, heads_kv, s, layout):
    """Groups of 6 (Qwen's 12 heads over 2 KV heads) and of 1; one key, part of a chunk, several chunks with a
    last part; both cache views; no mask, a random one (a row that sees nothing), an expanded one."""
    k, ks, v, vs = _cache(heads_kv, s, layout, seed=s)
    q = torch.randn(BATCH, t, heads, D, generator=torch.Generator().manual_seed(t)).to(dtype).transpose(1, 2)
    for kind in ("none", "random", "expanded"):
        mask = _mask(t, s, kind)
        got = int8_kv_attention(q, k, ks, v, vs, mask)
        _check(got, reference(q, k, ks, v, vs, mask))
        if kind == "random":
            assert not got[1, :, t - 1].any()  # a row with no visible key: zeros, not NaN


def test_avx2_and_avx512_forms_agree_with_the_reference():
    """Where the CPU has AVX-512, the wider loops run; held to AVX2 (``forced_isa``) the AVX2 ones."""
    k, ks, v, vs = _cache(2, 700, "slice")
    q = torch.randn(BATCH, 12, 3, D)
    mask = _mask(3, 700, "random")
    want = reference(q, k, ks, v, vs, mask)
    for isa in ("auto", "avx2"):
        with cpu_kernels.forced_isa(isa):
            _check(int8_kv_attention(q, k, ks, v, vs, mask), want)


def test_the_result_does_not_depend_on_the_thread_count():
    k, ks, v, vs = _cache(2, 1000, "gather")
    q = torch.randn(BATCH, 12, 2, D)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(int8_kv_attention(q, k, ks, v, vs))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_other_head_sizes_and_no_keys():
    """head_dim 24 (not a multiple of 16: the AVX2 loops) and 64, groups of 4; an empty cache gives zeros."""
    for d, heads, heads_kv in ((24, 8, 2), (64, 4, 1)):
        kq, kscale = quantize(torch.randn(1, heads_kv, 130, d))
        vq, vscale = quantize(torch.randn(1, heads_kv, 130, d))
        q = torch.randn(1, heads, 3, d)
        _check(int8_kv_attention(q, kq, kscale, vq, vscale), reference(q, kq, kscale, vq, vscale))
    empty = torch.zeros(1, 2, 0, D, dtype=torch.int8)
    out = int8_kv_attention(torch.randn(1, 4, 1, D), empty, torch.zeros(1, 2, 0), empty, torch.zeros(1, 2, 0))
    assert out.shape == (1, 4, 1, D) and not out.any()


def test_bad_operands_get_a_clear_error():
    k, ks, v, vs = _cache(2, 10, "slice")
    q = torch.randn(BATCH, 12, 1, D)
    with pytest.raises(RuntimeError, match="q must be fp32 or bf16"):
        int8_kv_attention(q.half(), k, ks, v, vs)
    with pytest.raises(RuntimeError, match="k and v must be int8"):
        int8_kv_attention(q, k.float(), ks, v, vs)
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be fp32"):
        int8_kv_attention(q, k, ks.bfloat16(), v, vs)
    with pytest.raises(RuntimeError, match="not a multiple of the 2 KV heads"):
        int8_kv_attention(torch.randn(BATCH, 5, 1, D), k, ks, v, vs)
    with pytest.raises(RuntimeError, match="head_dim must be contiguous"):
        int8_kv_attention(torch.randn(BATCH, 12, D, 2).transpose(2, 3), k, ks, v, vs)
    with pytest.raises(RuntimeError, match="k's and v's head_dim must be contiguous"):
        int8_kv_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), ks, v, vs)
    with pytest.raises(RuntimeError, match="q has head_dim 64"):
        int8_kv_attention(q[..., :64], k, ks, v, vs)
    with pytest.raises(RuntimeError, match=r"k_scale and v_scale must be \(batch, kv_heads, S\)"):
        int8_kv_attention(q, k, ks[:, :, :5], v, vs)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        int8_kv_attention(q, k, ks, v, vs, torch.ones(1, 1, 1, 10))
    with pytest.raises(RuntimeError, match="mask must be"):
        int8_kv_attention(q, k, ks, v, vs, torch.ones(1, 1, 1, 9, dtype=torch.bool))


def test_takes_decode_and_verify_rows_not_a_causal_prefill():
    q = torch.randn(1, 12, 1, D)
    assert kv_attention.takes(q.bfloat16(), mask_is_causal=False)
    assert not kv_attention.takes(q.half(), mask_is_causal=False)  # fp16 on a CPU: dequantized, then SDPA
    assert kv_attention.takes(q, mask_is_causal=False)
    assert not kv_attention.takes(q, mask_is_causal=True)
    assert kv_attention.takes(torch.randn(1, 12, MAX_QUERY, D), mask_is_causal=False)
    assert not kv_attention.takes(torch.randn(1, 12, MAX_QUERY + 1, D), mask_is_causal=False)
    assert not kv_attention.takes(q.to("meta"), mask_is_causal=False)


def test_a_compiled_function_calls_it_without_a_graph_break():
    """The fake implementation gives the output's shape and dtype: one graph, and the same numbers."""
    k, ks, v, vs = _cache(2, 33, "gather")
    mask = _mask(2, 33, "random")

    def attend(q, mask):
        return int8_kv_attention(q, k, ks, v, vs, mask).sum(-1)

    q = torch.randn(BATCH, 12, 2, D).bfloat16()
    compiled = torch.compile(attend, fullgraph=True)
    assert torch.equal(compiled(q, mask), attend(q, mask))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_query_makes_its_row_non_finite(bad):
    """A NaN score must not drop out of the softmax: the row comes out NaN, as a float attention's would (the
    engine's check of the logits reports it); the other rows are untouched."""
    k, ks, v, vs = _cache(2, 300, "slice")
    q = torch.randn(BATCH, 12, 2, D)
    q[1, 7, 1, 5] = bad
    out = int8_kv_attention(q, k, ks, v, vs)
    assert out[1, 7, 1].isnan().all()
    out[1, 7, 1] = 0
    want = reference(q, k, ks, v, vs)
    want[1, 7, 1] = 0
    _check(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_write_quantizes_as_the_torch_reference_bit_for_bit(dtype):
    """The int8 cache's write (one call of our kernel) gives cache.quantized.quantize's integers and scales: rows
    of very different sizes, an all-zero row, and ties (0.5 rounds away from zero)."""
    from engine_lib.cache.quantized import kernels_take, write_quantize
    from engine_lib.cache.quantized import quantize as reference_quantize

    x = torch.randn(9, 3, 2, 128) * torch.logspace(-4, 3, 9)[:, None, None, None]
    x[0, 0, 0] = 0.0
    x[1, 0, 0] = 0.0
    x[1, 0, 0, :3] = torch.tensor([0.5, -0.5, 127.0])
    x = x.to(dtype)
    assert kernels_take("cpu")
    q, scale = write_quantize(x, kernel=True)
    want_q, want_scale = reference_quantize(x)
    assert q.dtype == torch.int8 and torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert q[1, 0, 0, :3].tolist() == [1, -1, 127]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s,layout", [(1, "slice"), (300, "gather")])
@pytest.mark.parametrize("t", [1, 3])
def test_a_float_cache_equals_the_fp32_attention_of_its_values(cache_dtype, t, s, layout):
    """The same loops over bf16 or fp32 keys and values (every scale 1): both cache views, GQA groups of 6, each
    mask kind, AVX-512 where the CPU has it and held to AVX2."""
    k8, ks, v8, vs = _cache(2, s, layout, seed=s)
    # the dequantized values in the cache's dtype, laid out as the int8 views are (the same strides)
    k = torch.empty_strided(k8.shape, k8.stride(), dtype=cache_dtype).copy_(k8.float() * ks[..., None])
    v = torch.empty_strided(v8.shape, v8.stride(), dtype=cache_dtype).copy_(v8.float() * vs[..., None])
    q = torch.randn(BATCH, t, 12, D, generator=torch.Generator().manual_seed(t)).to(cache_dtype).transpose(1, 2)
    for kind in ("none", "random", "expanded"):
        mask = _mask(t, s, kind)
        want = reference(q, k, None, v, None, mask)
        for isa in ("auto", "avx2"):
            with cpu_kernels.forced_isa(isa):
                _check(float_kv_attention(q, k, v, mask), want)


def test_a_float_cache_gets_a_clear_error_for_mixed_or_unsupported_dtypes():
    q = torch.randn(1, 4, 1, D)
    k = torch.randn(1, 2, 9, D)
    with pytest.raises(RuntimeError, match="kv_attention: k and v must both be bf16 or both fp32"):
        float_kv_attention(q, k.bfloat16(), k)
    with pytest.raises(RuntimeError, match="kv_attention: k and v must both be bf16 or both fp32"):
        float_kv_attention(q, k.half(), k.half())
    with pytest.raises(RuntimeError, match="kv_attention: q must be fp32 or bf16"):
        float_kv_attention(q.half(), k, k)


def test_a_compiled_function_calls_the_float_form_without_a_graph_break():
    k, v = torch.randn(BATCH, 2, 40, D).bfloat16(), torch.randn(BATCH, 2, 40, D).bfloat16()

    def attend(q):
        return float_kv_attention(q, k, v).sum(-1)

    q = torch.randn(BATCH, 12, 1, D).bfloat16()
    assert torch.equal(torch.compile(attend, fullgraph=True)(q), attend(q))


def test_a_half_model_decodes_through_it_as_through_sdpa(engines, prompts, monkeypatch):
    """A bf16 model on a CPU: its cache says our kernel serves it, every decode step's every layer calls it
    (counted), and greedy replies match the same engine with SDPA in its place (the half rung's logits against
    transformers are tests/test_model_half_precision.py's, through this kernel now)."""
    from engine_lib.model.layers import attention

    engine = engines("half", torch.bfloat16)
    ours = attention.cpu_kv.kv_attention
    calls = []

    def counted(*args):
        calls.append(args[1].dtype)
        return ours(*args)

    def sdpa_instead(q, k, v, mask):
        return attention.sdpa_attention(q, k, v, mask, False)

    replies = {}
    for name, fn in (("kernel", counted), ("sdpa", sdpa_instead)):
        monkeypatch.setattr(attention.cpu_kv, "kv_attention", fn)
        replies[name] = [engine.generate(p, max_new_tokens=8, temperature=0).token_ids for p in prompts[:2]]
    layers = engine.config.num_hidden_layers
    assert len(calls) == 2 * 7 * layers and set(calls) == {torch.bfloat16}  # 7 decode steps a reply, each layer
    assert replies["kernel"] == replies["sdpa"]
