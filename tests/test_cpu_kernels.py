"""cpu_kernels: our C++ matvec kernels (bf16, int8, int4) against the fp32 matmul of the same
(dequantized) weights, the layers that choose them, and a compiled step that calls them.

Skipped where they cannot be built (not x86 AVX2, no compiler): the layers then keep PyTorch's
kernels, which the rest of the suite covers."""

import pytest
import torch
import torch.nn.functional as F

from engine_lib.cpu import kernels as cpu_kernels
from engine_lib.cpu.kernels import INT4_GEMV, INT8_GEMV, INT8_TILES
from engine_lib.cpu.matmul import Linear, use_cpu_kernels
from engine_lib.cpu.routing import INT4_AMX_MAX_ROWS, TILES_MAX_ROWS
from engine_lib.quant.formats import dequantize_int4, quantize_int4, quantize_int8
from engine_lib.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"our CPU kernels: {cpu_kernels.unavailable_reason()}")
ops = torch.ops.engine_lib_cpu

# (rows of x, out features, in features): one and several decode rows, an out count that is not
# a multiple of the four rows a block takes, in-features that take each activation block size
SHAPES = [(1, 64, 128), (3, 37, 96), (5, 130, 64), (2, 9, 1536)]


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_matvec_equals_the_fp32_matmul(m, n, k):
    torch.manual_seed(0)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k)
    torch.testing.assert_close(ops.bf16_gemv(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (2, 9, 1536), (7, 105, 96), (35, 203, 2064)])
def test_bf16_gemm_equals_the_fp32_matmul(m, n, k):
    """The GEMM of many rows: a lone row and odd rows (a zero row pads the last pair), out counts that are not
    multiples of its tile of 5 or its block of 100, and in features past its block of 2048 (two partial sums)."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k)
    torch.testing.assert_close(ops.bf16_gemm(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_matvec_matches_the_dequantized_matmul(m, n, k):
    """Activations rounded to 16-bit integers per block: about 1e-5 of the largest output, where
    bf16 itself rounds each value by up to 4e-3."""
    torch.manual_seed(1)
    q, s = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k) * 3
    x[:, 5] = 40.0  # an outlier sets its block's step; the other blocks keep theirs
    assert _rel(ops.int8_gemv(x, q, s), F.linear(x, q.float()) * s.float()) < 1e-4


@pytest.mark.parametrize("group", [32, 64, 96, 128])
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (4, 37, 256), (3, 9, 96), (2, 11, 288)])
def test_int4_matvec_and_dequantize_match_the_reference(m, n, k, group):
    """Activations rounded to 8 bits per 32 inputs (as llama.cpp's Q8_0): the sums move by about a
    tenth of what rounding the weights to int4 moved them (0.05 to 0.09 here), a fifth beside an
    outlier activation. k = 96 and 288 end in a 32 that fills no 64; groups of 96 span two 64s."""
    if k % group:
        pytest.skip(f"in_features {k} is not a multiple of the group size {group}")
    torch.manual_seed(2)
    w_full = torch.randn(n, k)
    q, scales, zeros = quantize_int4(w_full, torch.bfloat16, group)
    plain = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()  # (groups, out, 2), the layer's layout
    w = dequantize_int4(q, scales, zeros).float()
    x = torch.randn(m, k)
    got, want = ops.int4_gemv(x, plain, sz, group), F.linear(x, w)
    norm_rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert norm_rel(got, want) < 0.12 * norm_rel(want, F.linear(x, w_full))
    x[:, 5] = 40.0  # an outlier sets its 32's step; the other 32s keep theirs
    got, want = ops.int4_gemv(x, plain, sz, group), F.linear(x, w)
    assert norm_rel(got, want) < 0.25 * norm_rel(want, F.linear(x, w_full))
    out = torch.empty(n * k)
    block = cpu_kernels.int4_dequantize(plain, sz, group, 3, n - 1, out)
    torch.testing.assert_close(block, w[3:n - 1], rtol=1e-6, atol=1e-6)
    half = cpu_kernels.int4_dequantize(plain, sz, group, 3, n - 1, torch.empty(n * k, dtype=torch.bfloat16))
    assert torch.equal(half, block.bfloat16())  # rounded to nearest even, as PyTorch rounds


@pytest.mark.parametrize("kernel", ["bf16", "bf16_gemm", "int8", "int4"])
@pytest.mark.parametrize("n,k", [(37, 256), (9, 1536)])
def test_each_row_equals_its_own_one_row_call_bit_for_bit(kernel, n, k):
    """The bf16 and int8 kernels take activation rows in pairs (each weight vector read and widened
    once for both), int4's AVX-512 VNNI form four at a time (then a last 3, 2 or 1: 7 and 10 rows take
    each), its AVX2 form pairs, the bf16 GEMM pairs against 5 weight rows; a row's sums take the
    same steps in the same order either way: a row's result does not depend on the rows beside it (the
    kernel chosen by row count may: ``bf16_linear``)."""
    torch.manual_seed(3)
    w = torch.randn(n, k)
    if kernel == "bf16":
        run = lambda x: ops.bf16_gemv(x, w.bfloat16())  # noqa: E731
    elif kernel == "bf16_gemm":
        run = lambda x: ops.bf16_gemm(x, w.bfloat16())  # noqa: E731
    elif kernel == "int8":
        q, s = quantize_int8(w)
        run = lambda x: ops.int8_gemv(x, q, s)  # noqa: E731
    else:
        q, scales, zeros = quantize_int4(w, torch.bfloat16, 128)
        plain = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
        run = lambda x: ops.int4_gemv(x, plain, sz, 128)  # noqa: E731
    for rows in (7, 10):
        x = torch.randn(rows, k)
        together = run(x)
        assert torch.equal(together, torch.cat([run(x[i:i + 1].contiguous()) for i in range(rows)]))
        assert not torch.equal(together[0], together[1])  # the rows differ: a mix-up would show


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (1, 37, 96), (3, 9, 1536), (1, 259, 8960)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_bf16_layer_in_one_call_is_the_matvec_plus_bias_rounded_bit_for_bit(m, n, k, bias):
    """bf16 in and out, the bias added inside: every bit what the five-op form (widen, matvec, widen the bias,
    add, round) gives, NaN where it gives NaN (the rows of a NaN activation)."""
    torch.manual_seed(5)
    x, w = (torch.randn(m, k) * 3).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    if m > 1:
        x[1, 7] = float("nan")
    want = ops.bf16_gemv(x.float(), w)
    want = (want + b.float() if bias else want).bfloat16()
    got = ops.bf16_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))


def test_an_eager_bf16_decode_row_takes_the_one_call_layer_and_a_compiled_one_the_matvec():
    """An eager step's bf16 row goes to ``bf16_linear`` (one op), a compiled step's to the matvec on fp32 rows
    (inductor fuses the conversions around it); both give the same bits."""
    from engine_lib.bench.measure import top_level_op_names

    torch.manual_seed(6)
    lin = Linear(128, 48, bias=True).bfloat16()
    use_cpu_kernels(lin)
    lin.packed = lin.native_gemm = False  # as on a CPU without bf16 instructions
    x = torch.randn(1, 1, 128).bfloat16()
    with torch.inference_mode():
        names = top_level_op_names(lambda: lin(x))
        eager = lin(x)
        compiled = torch.compile(lin, fullgraph=True)(x)
    assert names["engine_lib_cpu.bf16_linear"] == 1 and "engine_lib_cpu.bf16_gemv" not in names
    assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16))


def test_bad_shapes_get_a_clear_error():
    with pytest.raises(RuntimeError, match="x must be"):
        ops.bf16_gemv(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x must be"):
        ops.bf16_linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.bf16_linear(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(4))
    with pytest.raises(RuntimeError, match="multiple of 16, got 40"):
        ops.bf16_gemm(torch.randn(2, 40), torch.randn(4, 40).bfloat16())
    with pytest.raises(RuntimeError, match="divisible by 32"):
        ops.int8_gemv(torch.randn(1, 40), torch.zeros(4, 40, dtype=torch.int8), torch.ones(4))
    with pytest.raises(RuntimeError, match="scales_and_zeros must be"):
        ops.int4_gemv(torch.randn(1, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2, 2), 32)


def test_the_layers_choose_our_kernels_and_keep_their_results():
    torch.manual_seed(3)
    w = torch.randn(48, 128)
    x = torch.randn(2, 128).bfloat16()
    q8 = QuantLinear(128, 48, mode="int8")
    q8.quantize_(w, torch.bfloat16)
    q4 = QuantLinear(128, 48, mode="int4", group_size=64)
    q4.quantize_(w, torch.bfloat16)
    assert (q8.kernel, q4.kernel) == (INT8_GEMV, INT4_GEMV)
    torch.testing.assert_close(q8(x).float(), F.linear(x.float(), q8.dense_weight(0, 48, torch.float32)),
                               rtol=2 ** -8, atol=1e-3)
    # int4: 8-bit activations (see the int4 test above)
    assert _rel(q4(x).float(), F.linear(x.float(), q4.dense_weight(0, 48, torch.float32))) < 2e-2
    lin = Linear(128, 48, bias=True).bfloat16()
    use_cpu_kernels(lin)
    assert lin.gemv
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()),
                               rtol=2 ** -8, atol=1e-3)


def test_a_compiled_step_calls_them_without_a_graph_break():
    """The shape functions let inductor treat each op as an extern kernel: one graph, any batch."""
    q, s = quantize_int8(torch.randn(40, 64))
    w = torch.randn(24, 64).bfloat16()

    def step(x):
        return ops.int8_gemv(x, q, s).sum(-1) + ops.bf16_gemv(x, w).sum(-1) + ops.bf16_gemm(x, w).sum(-1)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for rows in (1, 7):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), step(x), rtol=1e-4, atol=1e-3)


def test_turned_off_they_say_why(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert cpu_kernels._missing() == f"{cpu_kernels.ENV}=0"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_makes_its_row_non_finite(bad):
    """Integers cannot hold NaN or an infinity: the row must still come out non-finite (as a float
    matmul's would), so the engine's check of the logits reports it; the other rows are untouched."""
    torch.manual_seed(4)
    w = torch.randn(8, 64)
    q8, s8 = quantize_int8(w)
    q, scales, zeros = quantize_int4(w, torch.bfloat16, 32)
    plain = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
    x = torch.randn(2, 64)
    x[1, 3] = bad
    for out in (ops.int8_gemv(x, q8, s8), ops.int4_gemv(x, plain, sz, 32), ops.bf16_gemv(x, w.bfloat16()),
                ops.bf16_gemm(x, w.bfloat16())):
        assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1]).any()


def test_a_native_bf16_gemm_takes_many_rows_unless_rows_are_summed_alone():
    """Where the CPU multiplies bf16 in hardware, 2 rows and more go to its GEMM (it reads the weights once for all
    rows), even inside a decode step; a lone row stays ours; under rows_alone (batch invariance) every row is ours."""
    one, many = torch.randn(1, 64), torch.randn(4, 64)
    with cpu_kernels.every_row():
        assert cpu_kernels.takes(one, native_gemm=True) and not cpu_kernels.takes(many, native_gemm=True)
        assert cpu_kernels.takes(many, native_gemm=False)
    with cpu_kernels.rows_alone():
        assert cpu_kernels.takes(many, native_gemm=True) and cpu_kernels.takes(torch.randn(40, 64), native_gemm=True)
    assert not cpu_kernels.ROWS_ALONE and not cpu_kernels.takes(many, native_gemm=True)


def test_bf16_rows_take_the_gemm_from_two_unless_summed_alone(monkeypatch):
    """On a CPU without bf16 instructions a bf16 layer runs a lone row through the matvec and 2 rows or more (a
    short prefill, a decode batch, a long prefill) through the GEMM; under rows_alone every row count takes the
    matvec, so a row's numbers are those of its one-row call; an input width that is not a multiple of 16 keeps
    the matvec (few rows) or the fp32 blocks (many)."""
    from engine_lib.cpu import matmul as cpu_matmul

    monkeypatch.setattr(cpu_matmul, "half_matmul_is_native", lambda: False)

    def called(lin, rows):
        x = torch.randn(rows, lin.in_features).bfloat16()
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = lin(x)
        torch.testing.assert_close(y.float(), F.linear(x.float(), lin.weight.float()), rtol=2 ** -7, atol=1e-2)
        return {e.name for e in prof.events()} & {"engine_lib_cpu::bf16_gemv", "engine_lib_cpu::bf16_gemm",
                                                  "engine_lib_cpu::bf16_linear"}

    MATVEC = {"engine_lib_cpu::bf16_linear"}  # an eager call's matvec: the whole layer in one op, bf16 in and out
    torch.manual_seed(6)
    lin = Linear(64, 48, bias=False).bfloat16()
    use_cpu_kernels(lin)
    lin.packed = lin.native_gemm = False  # as on a CPU without bf16 instructions
    assert called(lin, 1) == MATVEC
    assert called(lin, 3) == called(lin, 40) == {"engine_lib_cpu::bf16_gemm"}
    with cpu_kernels.rows_alone():
        assert called(lin, 3) == called(lin, 40) == MATVEC
    odd = Linear(40, 48, bias=False).bfloat16()
    use_cpu_kernels(odd)
    odd.packed = odd.native_gemm = False
    assert called(odd, 3) == MATVEC and called(odd, 40) == set()


def test_every_row_takes_any_count_and_flops_are_counted():
    """Outside a decode step many rows go to the fp32 blocks (or, bf16, our GEMM: ``bf16_linear``); under every_row
    (each decode step), every row count takes the kernels. FlopCounterMode counts 2 per weight and row."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(12, 64)
    assert not cpu_kernels.takes(x)
    with cpu_kernels.every_row():
        assert cpu_kernels.takes(x)
    assert not cpu_kernels.takes(x)
    w = torch.randn(24, 64).bfloat16()
    with FlopCounterMode(display=False) as flops:
        ops.bf16_gemv(x, w)
        ops.bf16_gemm(x, w)
    assert flops.get_total_flops() == 2 * 2 * 12 * 64 * 24


def test_int24_rows_hold_every_activation_near_the_row_maximum_and_give_the_fp32_matmul():
    """A prefill's rows as 24-bit integers (three int8 parts, one scale per row) for the int8 GEMM: the parts
    give back each bf16 value to a step or two of max|row| / 8355711, a massive activation (1e4 x the rest) leaves its
    row's other values their precision, a NaN row comes out NaN and a zero row zero, and each row's result is
    the fp32 matmul of the dequantized weight to fp32 rounding, the same whatever other rows are in the call.
    Not on AVX2 code paths (a CPU held to AVX2): there oneDNN's int8 GEMM saturates, and the engine never runs it
    (``int8_gemm_is_native``)."""
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("oneDNN's int8 GEMM saturates on AVX2 code paths; the engine never takes int24 there")
    torch.manual_seed(7)
    n, k = 40, 1544  # k not a multiple of 8: the scalar tail of the split
    q, s = quantize_int8(torch.randn(n, k))
    x = torch.randn(9, k)
    x[4, 10] = 3e4
    x[5] = 0.0
    x[6, 3] = float("nan")
    x = x.bfloat16()
    parts, scale = ops.int24_split(x)
    assert parts.shape == (27, k) and parts.dtype == torch.int8 and scale.shape == (9,)
    ints = parts[:9].long() * 65536 + parts[9:18].long() * 256 + parts[18:].long()
    ok = torch.tensor([r not in (5, 6) for r in range(9)])
    back = ints.double() * scale.double()[:, None]
    # within 2 steps: half a step of rounding, and the fp32 products x * (1 / step) and q * step
    assert ((back - x.double()).abs()[ok] <= 2 * scale.double()[ok, None]).all()
    assert torch.isnan(scale[6]) and scale[5] == 0 and not ints[5].any()
    want = F.linear(x.float(), q.float() * s.float()[:, None])
    got = cpu_kernels.int24_linear(x.float(), q, s)
    assert torch.isnan(got[6]).all() and not got[5].any() and torch.isfinite(got[ok]).all()
    per_row = ((got - want).norm(dim=1) / want.norm(dim=1))[ok]
    assert per_row.max() < 1e-5  # the row with 3e4 included: its other values kept their precision
    alone = torch.cat([cpu_kernels.int24_linear(x[i:i + 1].float(), q, s) for i in range(9)])
    assert torch.equal(alone[ok], got[ok])


def test_an_int8_prefill_of_a_few_rows_takes_the_int8_gemm_where_the_cpu_has_amx(monkeypatch):
    from engine_lib.cpu import routing

    if not cpu_kernels.int8_gemm_is_native():
        pytest.skip("no AMX here: int8 prefills keep the bf16 (or fp32) blocks")
    torch.manual_seed(8)
    layer = QuantLinear(256, 80, mode="int8")  # 80 outputs: not whole 32s, so not in AMX tiles (next test)
    layer.quantize_(torch.randn(80, 256), torch.bfloat16)
    assert layer.kernel == INT8_GEMV
    calls = []
    monkeypatch.setattr(cpu_kernels, "int24_linear", lambda *a: calls.append(1) or ops_int24(*a))
    for rows, taken in ((routing.INT24_MAX_ROWS, 1), (routing.INT24_MAX_ROWS + 1, 0)):
        calls.clear()
        x = torch.randn(rows, 256).bfloat16()
        with torch.inference_mode():
            got = layer(x).float()
        want = F.linear(x.float(), layer.dense_weight(0, 80, torch.float32))
        assert len(calls) == taken
        # each row: the output's rounding to bf16 (2^-9 of each value; the bf16 blocks round twice)
        assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < 4e-3


needs_amx = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.int8_tiles_fit(32, 64)),
                               reason="no AMX with AVX-512 VNNI here: int8 weights stay in the plain layout")


@needs_amx
@pytest.mark.parametrize("n, k", [(96, 256), (256, 1536), (65536, 64)])  # the last: rows in chunks
def test_int8_weights_in_amx_tiles_give_the_exact_integer_sums_at_every_row_count(n, k):
    torch.manual_seed(n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n) * 0.01 + 1e-3
    tiles, colsum = cpu_kernels.int8_tiles_pack(q)
    assert tiles.shape == (n // 16, k // 64, 16, 16, 4) and tiles.dtype == torch.int8
    assert torch.equal(cpu_kernels.int8_tiles_unpack(tiles), q)  # the same bytes, reordered
    assert torch.equal(colsum, q.int().sum(1).int())
    out = torch.empty(n * k, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.int8_tiles_bf16_rows(tiles, 16, 64, out), q[16:64].bfloat16())  # exact
    x = torch.randn(200, k).bfloat16()
    want = ops_int24(x, q, scales)  # PyTorch's int8 GEMM of the same 24-bit rows (exact int32 sums)
    for rows in (1, 2, 3, 17, 200):  # one row: AVX-512 VNNI over the tiles; more: the AMX unit
        got = cpu_kernels.int8_tiles_linear(x[:rows], tiles, colsum, scales)
        assert torch.equal(got, want[:rows]), rows
    # a row's result does not depend on its neighbours (a batch-invariant server relies on it)
    alone = cpu_kernels.int8_tiles_linear(x[5:6], tiles, colsum, scales)
    assert torch.equal(alone, cpu_kernels.int8_tiles_linear(x[:9], tiles, colsum, scales)[5:6])


@needs_amx
def test_an_int8_layer_lives_in_amx_tiles_where_it_fits_and_not_under_forced_avx2():
    torch.manual_seed(3)
    w = torch.randn(96, 256)
    layer = QuantLinear(256, 96, mode="int8")
    layer.quantize_(w, torch.bfloat16)
    assert layer.kernel == INT8_TILES and layer.qweight.dim() == 5
    q, _ = quantize_int8(w, torch.bfloat16)  # what quantize_ computed
    assert torch.equal(layer.int8_weight(), q)
    for rows in (1, 4, 70, TILES_MAX_ROWS + 1):  # the last: bf16 blocks made from the tiles
        x = torch.randn(rows, 256).bfloat16()
        want = F.linear(x.float(), layer.dense_weight(0, 96, torch.float32))
        assert ((layer(x).float() - want).norm(dim=1) / want.norm(dim=1)).max() < 4e-3
    with cpu_kernels.forced_isa("avx2"):
        plain = QuantLinear(256, 96, mode="int8")
        plain.quantize_(w, torch.bfloat16)
    assert plain.kernel == INT8_GEMV and torch.equal(plain.qweight, q)


needs_amx_bf16 = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.int4_amx_fit(32, 64, 32)),
                                    reason="no AMX-BF16 with AVX-512 here: int4 prefills take bf16 blocks")


@needs_amx_bf16
@pytest.mark.parametrize("n, k, group", [(96, 256, 32), (256, 1536, 128), (64, 8960, 128)])
def test_an_int4_prefill_on_amx_multiplies_the_dequantized_bf16_weights_row_by_row(n, k, group):
    torch.manual_seed(n + k)
    q, scales, zeros = quantize_int4(torch.randn(n, k), torch.bfloat16, group)
    plain = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
    w = cpu_kernels.int4_dequantize(plain, sz, group, 0, n, torch.empty(n * k, dtype=torch.bfloat16)).float()
    x = torch.randn(70, k).bfloat16()
    x[:, 3] = 60.0  # a large activation: bf16 products, fp32 sums, nothing rounded to a coarser step
    for rows in (2, 16, 17, 33, 70):  # whole 32s, a last 16, a row past them
        got = cpu_kernels.int4_amx_linear(x[:rows], plain, sz, group).float()
        want = F.linear(x[:rows].float(), w)  # the same bf16 weights, summed in fp32
        # each output is its fp32 sum rounded once to bf16 (half a step, 2^-9 of it), in another order
        assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * want.abs().max()).all(), rows
    # the weights it multiplies are int4_dequantize's bf16 values, bit for bit: a row of the identity
    # picks one input, so its outputs are single products, exact in fp32 and in bf16
    eye = torch.eye(k).bfloat16()
    for a in range(0, k, 512):
        assert torch.equal(cpu_kernels.int4_amx_linear(eye[a:a + 512], plain, sz, group).float(), w[:, a:a + 512].t())
    # a row's result does not depend on the other rows of the call
    full = cpu_kernels.int4_amx_linear(x, plain, sz, group)
    assert torch.equal(cpu_kernels.int4_amx_linear(x[40:41], plain, sz, group), full[40:41])
    x[5, 9] = float("nan")  # a non-finite activation makes its own row non-finite, and only that row
    bad = cpu_kernels.int4_amx_linear(x[:9], plain, sz, group)
    assert bad[5].isnan().all() and torch.equal(bad[[0, 1, 2, 3, 4, 6, 7, 8]], full[[0, 1, 2, 3, 4, 6, 7, 8]])


@needs_amx_bf16
def test_an_int4_layer_takes_amx_for_prefills_of_6_to_the_limit_in_rows(monkeypatch):
    torch.manual_seed(4)
    layer = QuantLinear(256, 96, mode="int4", group_size=64)
    layer.quantize_(torch.randn(96, 256), torch.bfloat16)
    assert layer.kernel == INT4_GEMV
    calls = []
    real = cpu_kernels.int4_amx_linear
    monkeypatch.setattr(cpu_kernels, "int4_amx_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 5, 6, 70, INT4_AMX_MAX_ROWS, INT4_AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 256).bfloat16()
        with torch.inference_mode():
            got = layer(x).float()
        want = F.linear(x.float(), layer.dense_weight(0, 96, torch.float32))
        limit = 4e-3 if rows > 5 else 0.02  # the matvec rounds activations to 8 bits per 32 inputs
        assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < limit, rows
    assert calls == [6, 70, INT4_AMX_MAX_ROWS]  # one and five rows: the int4 matvec; past the limit: blocks
    calls.clear()
    with cpu_kernels.forced_isa("avx2"):
        layer(torch.randn(40, 256).bfloat16())
    assert calls == []


def ops_int24(x2, q, scales):
    parts, row_scale = ops.int24_split(x2)
    return ops.int24_combine(torch._int_mm(parts, q.t()), row_scale, scales.float().contiguous()).to(x2.dtype)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_is_left(tmp_path, monkeypatch):
    """An interrupted build leaves PyTorch's lock file, and every later build would wait for it forever."""
    import os
    import time

    import torch.utils.cpp_extension as ext

    from engine_lib.cpu import kernels as k

    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose=False: str(tmp_path))
    lock = tmp_path / "lock"
    lock.touch()
    k._clear_stale_lock("x")
    assert lock.exists()  # a build may be running now
    old = time.time() - k.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        k._clear_stale_lock("x")
    assert not lock.exists()
