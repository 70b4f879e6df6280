"""cpu_kernels on both instruction sets: the AVX2 int8 and int4 kernels and their AVX-512 VNNI variants
(chosen at run time where the CPU has it) each against the fp32 matmul of the dequantized weights, and
against each other: int8 gives the same sums bit for bit, int4 the same integers and scales summed in
another order (within fp32 rounding).

The AVX2 half runs on every host that builds the kernels; the AVX-512 half and the comparison are
skipped on a CPU without AVX-512 VNNI (an AVX2-only CI host), where ``isa()`` must say "avx2"."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_lib.cpu import kernels as cpu_kernels
from engine_lib.quant.formats import dequantize_int4, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"our CPU kernels: {cpu_kernels.unavailable_reason()}")
ops = torch.ops.engine_lib_cpu


def _has_avx512_vnni() -> bool:
    if not cpu_kernels.available():
        return False
    with cpu_kernels.forced_isa("auto") as widest:  # restores whatever was in use (ENGINE_LIB_CPU_ISA)
        return widest == "avx512_vnni"


WIDE = _has_avx512_vnni()
needs_wide = pytest.mark.skipif(not WIDE, reason="this CPU has no AVX-512 VNNI: only the AVX2 kernels run here")
ISAS = ["avx2", pytest.param("auto", marks=needs_wide)]

# (rows, out, in): one to five decode rows; out counts that leave 1 to 3 rows past the blocks of four;
# in counts taking each int16 block (128, 64, 32) and, for int4, 64s and a last 32
INT8_SHAPES = [(1, 64, 128), (3, 37, 96), (5, 130, 64), (2, 9, 1536), (1, 6, 8960), (4, 259, 1536)]
INT4_SHAPES = [(1, 64, 256), (4, 37, 256), (3, 9, 96), (2, 11, 288), (5, 70, 1536), (1, 7, 384)]
GROUPS = [32, 64, 96, 128, 192]


def _int4(n, k, group, seed):
    torch.manual_seed(seed)
    w_full = torch.randn(n, k)
    q, scales, zeros = quantize_int4(w_full, torch.bfloat16, group)
    plain = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()  # (groups, out, 2), the layer's layout
    return w_full, plain, sz, dequantize_int4(q, scales, zeros).float()


def _both(fn):
    """fn() on the AVX2 kernels, then on the widest this CPU has."""
    with cpu_kernels.forced_isa("avx2") as narrow:
        assert narrow == "avx2" and cpu_kernels.isa() == "avx2"
        a = fn()
    with cpu_kernels.forced_isa("auto") as wide:
        assert wide == "avx512_vnni"
        b = fn()
    return a, b


def test_isa_names_the_kernels_in_use_and_forcing_avx2_is_undone():
    assert cpu_kernels.isa() in cpu_kernels.ISAS
    before = cpu_kernels.isa()
    with cpu_kernels.forced_isa("avx2"):
        assert cpu_kernels.isa() == "avx2"
    assert cpu_kernels.isa() == before
    with cpu_kernels.forced_isa("auto") as now:
        assert now == ("avx512_vnni" if WIDE else "avx2")
    assert cpu_kernels.isa() == before
    with pytest.raises(RuntimeError, match="choose 'avx2' or 'auto'"):
        ops.set_isa("avx512")
    assert cpu_kernels.isa() == before


def test_the_environment_variable_forces_avx2_from_the_start():
    code = "from engine_lib.cpu import kernels; print(kernels.isa())"
    env = dict(os.environ, **{cpu_kernels.ISA_ENV: "avx2"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "avx2"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k", INT8_SHAPES)
def test_int8_on_each_isa_matches_the_dequantized_matmul(isa, m, n, k):
    """The tolerance of test_cpu_kernels: activations rounded to 16-bit integers per block."""
    torch.manual_seed(1)
    q, s = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k) * 3
    x[:, 5] = 40.0
    with cpu_kernels.forced_isa(isa):
        got = ops.int8_gemv(x, q, s)
    want = F.linear(x, q.float()) * s.float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("m,n,k", INT4_SHAPES)
def test_int4_on_each_isa_matches_the_dequantized_matmul(isa, m, n, k, group):
    """The bound of test_cpu_kernels: activations rounded to 8 bits per 32 inputs move the sums by a
    tenth of what rounding the weights to int4 moved them."""
    if k % group:
        pytest.skip(f"in_features {k} is not a multiple of the group size {group}")
    w_full, plain, sz, w = _int4(n, k, group, seed=2)
    x = torch.randn(m, k)
    with cpu_kernels.forced_isa(isa):
        got = ops.int4_gemv(x, plain, sz, group)
    want = F.linear(x, w)
    assert ((got - want).norm() / want.norm()).item() < 0.12 * ((want - F.linear(x, w_full)).norm() / want.norm())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [96, 128])
def test_int4_on_each_isa_gives_each_row_its_own_one_row_sums_bit_for_bit(isa, group):
    """AVX2 takes activation rows in pairs (where groups are whole 64s), AVX-512 VNNI four at a time: 7 rows
    take a last single (AVX2) or a last 3 (VNNI), and 37 weight rows a last one past the blocks of four.
    A row's sums keep their steps whatever shares its call."""
    _, plain, sz, _ = _int4(37, 384, group, seed=4)
    x = torch.randn(7, 384)
    with cpu_kernels.forced_isa(isa):
        together = ops.int4_gemv(x, plain, sz, group)
        alone = torch.cat([ops.int4_gemv(x[i:i + 1].contiguous(), plain, sz, group) for i in range(7)])
    assert torch.equal(together, alone)
    assert not torch.equal(together[0], together[1])  # the rows differ: a mix-up would show


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kernel", ["int8", "int4"])
def test_a_call_of_more_rows_than_one_pass_gives_each_row_its_own_sums(isa, kernel):
    """Both kernels take a call's rows 512 at a time (a long prefill's rounded activations stay in cache): rows on
    either side of the seam, and the last, equal their own one-row calls bit for bit."""
    torch.manual_seed(5)
    if kernel == "int8":
        q, s = quantize_int8(torch.randn(37, 256))
        run = lambda x: ops.int8_gemv(x, q, s)  # noqa: E731
    else:
        _, plain, sz, _ = _int4(37, 256, 128, seed=5)
        run = lambda x: ops.int4_gemv(x, plain, sz, 128)  # noqa: E731
    x = torch.randn(1100, 256)
    with cpu_kernels.forced_isa(isa):
        together = run(x)
        for i in (0, 511, 512, 1023, 1024, 1099):
            assert torch.equal(together[i], run(x[i:i + 1].contiguous())[0]), i


@needs_wide
@pytest.mark.parametrize("m,n,k", INT8_SHAPES)
def test_int8_avx512_gives_the_avx2_sums_bit_for_bit(m, n, k):
    torch.manual_seed(5)
    q, s = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k) * 3
    x[:, 7] = -55.0  # large int16 activations: the widest sums the int32 lanes hold
    a, b = _both(lambda: ops.int8_gemv(x, q, s))
    assert torch.equal(a, b)


@needs_wide
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("m,n,k", INT4_SHAPES)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int4_avx512_gives_the_avx2_sums_to_fp32_rounding(m, n, k, group, scale_dtype):
    """The same rounded activations (bit for bit) and the same integer sums, scaled and added in another
    order: within a few fp32 roundings of the largest output (one wrong scale or 32 would be off by far
    more). K = 288, 96 end 32 past a 64 and 384 64 past a 128 (groups of 64 and 192 then end in a 64
    the 256-bit form takes; 192 spans two 128s); groups of 32 and 96 keep the AVX2 kernel: equal."""
    if k % group:
        pytest.skip(f"in_features {k} is not a multiple of the group size {group}")
    _, plain, sz, _ = _int4(n, k, group, seed=6)
    sz = sz.to(scale_dtype)
    x = torch.randn(m, k)
    x[:, 3] = 30.0
    a, b = _both(lambda: ops.int4_gemv(x, plain, sz, group))
    if group % 64:
        assert torch.equal(a, b)
    else:
        assert (a - b).abs().max() <= 4e-6 * b.abs().max()  # measured up to 8e-7 (K = 8960)


@needs_wide
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_avx512_a_non_finite_activation_makes_its_row_non_finite(bad):
    torch.manual_seed(4)
    w = torch.randn(8, 256)
    q8, s8 = quantize_int8(w)
    _, plain, sz, _ = _int4(8, 256, 128, seed=4)
    x = torch.randn(2, 256)
    x[1, 200] = bad
    with cpu_kernels.forced_isa("auto"):
        for out in (ops.int8_gemv(x, q8, s8), ops.int4_gemv(x, plain, sz, 128)):
            assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1]).any()


@needs_wide
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int4_dequantize_avx512_gives_the_avx2_values_bit_for_bit(group, out_dtype, scale_dtype):
    """A prefill's int4 rows dequantized 32 at a time: the same fma and the same rounding to bf16 as AVX2."""
    n, k = 21, 384 if group != 96 else 288
    if k % group:
        pytest.skip(f"in_features {k} is not a multiple of the group size {group}")
    _, plain, sz, w = _int4(n, k, group, seed=9)
    sz = sz.to(scale_dtype)
    a, b = _both(lambda: cpu_kernels.int4_dequantize(plain, sz, group, 2, n - 3, torch.empty(n * k, dtype=out_dtype)))
    assert torch.equal(a, b)
    torch.testing.assert_close(b.float(), w[2:n - 3].to(out_dtype).float(), rtol=1e-6 if out_dtype == torch.float32
                               else 2 ** -8, atol=1e-6)
