"""cpu_matmul: many-row half-precision matmuls on a CPU without bf16 instructions run in fp32 blocks.

The mode is forced both ways (``ENGINE_LIB_CPU_HALF_MATMUL``) so the tests mean the same on any
host; the results are checked against an fp32 matmul of the same numbers."""

import os

import pytest
import torch
import torch.nn.functional as F

from engine_lib.cpu import kernels as cpu_kernels
from engine_lib.cpu import matmul as cpu_matmul
from engine_lib.cpu.kernels import INT8_GEMV
from engine_lib.cpu.matmul import FP32_MIN_ROWS, MODE_ENV, Linear, blockwise_fp32_linear, half_matmul_is_native
from engine_lib.cpu.routing import FP32_HOST_KERNEL_ROWS
from engine_lib.quant.linear import QuantLinear


@pytest.fixture
def mode(monkeypatch):
    """Set the mode for one test; the detection is cached, so clear it before and after."""
    def set_mode(value: str | None):
        if value is None:
            monkeypatch.delenv(MODE_ENV, raising=False)
        else:
            monkeypatch.setenv(MODE_ENV, value)
        half_matmul_is_native.cache_clear()
    yield set_mode
    half_matmul_is_native.cache_clear()


@pytest.fixture
def calls(monkeypatch):
    """Count the blockwise fp32 matmuls (the layers call the module's function)."""
    seen = []
    real = cpu_matmul.blockwise_fp32_linear

    def spy(x2, *args, **kwargs):
        seen.append(x2.shape[0])
        return real(x2, *args, **kwargs)
    monkeypatch.setattr(cpu_matmul, "blockwise_fp32_linear", spy)
    monkeypatch.setattr("engine_lib.cpu.routing.blockwise_fp32_linear", spy)
    return seen


def _linear(n_out=700, n_in=96, bias=True, dtype=torch.bfloat16) -> Linear:
    torch.manual_seed(0)
    lin = Linear(n_in, n_out, bias=bias)
    return lin.to(dtype)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # the fp32 blocks are for inference (the engine runs under inference mode)
        yield


def _fp32_reference(lin, x):
    return F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "mkl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_rows_run_in_fp32_blocks_and_match_an_fp32_matmul(mode, calls, dtype, onednn, monkeypatch):
    """Each block's fp32 matmul through oneDNN (where PyTorch has it) or MKL: the same sums to fp32 rounding."""
    if onednn and not cpu_matmul.ONEDNN_FP32:
        pytest.skip("this PyTorch has no oneDNN linear")
    mode("fp32")
    monkeypatch.setattr(cpu_matmul, "ONEDNN_FP32", onednn)
    gemms, real_gemm = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: gemms.append(a[1].shape) or real_gemm(*a))
    monkeypatch.setattr(cpu_matmul, "BLOCK_ELEMENTS", 96 * 64)  # several blocks, the last one short
    lin = _linear(dtype=dtype)
    x = torch.randn(2, 5, 96).to(dtype)  # 10 rows
    y = lin(x)
    assert calls == [10]
    assert gemms == ([(64, 96)] * 10 + [(60, 96)] if onednn else [])  # 700 rows in blocks of 64
    assert y.shape == (2, 5, 700) and y.dtype == dtype
    want = _fp32_reference(lin, x)
    # bias included, one rounding to the half dtype at the end: within half an ulp of the fp32 result
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # relative, just above a power of two
    torch.testing.assert_close(y.float(), want, rtol=half_ulp, atol=1e-6)


def test_few_rows_native_cpus_and_fp32_models_keep_the_plain_matmul(mode, calls):
    mode("fp32")
    lin = _linear()
    lin(torch.randn(FP32_MIN_ROWS - 1, 96).bfloat16())  # a decode step: bound by memory, stays in bf16
    _linear(dtype=torch.float32)(torch.randn(40, 96))  # fp32 weights: nothing to convert
    assert calls == []
    lin(torch.randn(FP32_MIN_ROWS, 96).bfloat16())
    assert calls == [FP32_MIN_ROWS]
    mode("native")  # a CPU with AVX-512 BF16 or AMX multiplies bf16 itself
    lin(torch.randn(40, 96).bfloat16())
    assert calls == [FP32_MIN_ROWS]


def test_the_detection_reads_the_cpu_and_refuses_an_unknown_mode(mode):
    mode(None)
    native = half_matmul_is_native()
    if torch.backends.cpu.get_cpu_capability() == "AVX2" and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert native is False  # an AVX2-only x86 host, not one held to AVX2 (scripts/cpu_as_avx2.sh)
    mode("fast")
    with pytest.raises(ValueError, match="choose 'native' or 'fp32'"):
        half_matmul_is_native()


def test_int8_and_int4_prefills_dequantize_blocks_in_fp32(mode, calls, monkeypatch):
    """int8 past its packed kernel's rows, and int4 on the plain layout, match the fp32 matmul of
    their own dequantized weights."""
    mode("fp32")
    monkeypatch.setattr(cpu_matmul, "BLOCK_ELEMENTS", 256 * 48)
    monkeypatch.setattr(cpu_kernels, "int8_tiles_fit", lambda *shape: False)  # a CPU without bf16 has no AMX
    torch.manual_seed(1)
    w = torch.randn(320, 256)
    x = torch.randn(40, 256).bfloat16()
    q8 = QuantLinear(256, 320, mode="int8")
    q8.quantize_(w, torch.bfloat16)
    rows8 = FP32_HOST_KERNEL_ROWS[INT8_GEMV] + 1 if q8.kernel == INT8_GEMV else 40  # past our row kernel's
    x8 = torch.randn(rows8, 256).bfloat16()
    want8 = F.linear(x8.float(), q8.int8_weight().float() * q8.scales.float()[:, None])
    # atol: 256 products of about 1 summed in fp32 in another order differ by up to about 2e-5 (seen 1.2e-5 on a
    # 2-core AMX host, 1 of 655,680 outputs, where the result was near 0); the rounding to bf16 is rtol's
    torch.testing.assert_close(q8(x8).float(), want8, rtol=2 ** -8, atol=5e-5)
    q4 = QuantLinear(256, 320, mode="int4", group_size=128)
    q4.quantize_(w, torch.bfloat16)
    if q4.kernel != "dequantize + linear":  # the packed kernel takes any row count: force the plain layout
        from engine_lib.quant.formats import quantize_int4
        q, s, z = quantize_int4(w, torch.bfloat16, 128)
        q4.qweight = torch.nn.Parameter(q[:, 0::2] | (q[:, 1::2] << 4), requires_grad=False)
        q4.kernel = "dequantize + linear"
    want4 = F.linear(x.float(), q4.dense_weight(0, 320, torch.float32))
    torch.testing.assert_close(q4(x).float(), want4, rtol=2 ** -8, atol=5e-5)
    assert calls == [rows8, 40]


def test_training_keeps_the_plain_matmul(mode, calls):
    """With gradients on (the small model's training), the layer stays differentiable."""
    mode("fp32")
    lin = _linear()
    with torch.enable_grad():
        lin(torch.randn(40, 96).bfloat16()).float().sum().backward()
    assert calls == [] and lin.weight.grad is not None


def test_the_block_buffer_is_reused_across_inference_mode_and_an_fp32_block_is_not_copied():
    rows = torch.randint(-127, 127, (8, 16), dtype=torch.int8)
    cpu_matmul._scratch.__dict__.clear()
    with torch.inference_mode():  # made here, written outside it next
        a = cpu_matmul.block_of(rows)
    b = cpu_matmul.block_of(rows[:4])
    assert a.data_ptr() == b.data_ptr() and torch.equal(b, rows[:4].float())
    f = torch.randn(3, 4)
    assert cpu_matmul.block_of(f) is f


def test_blockwise_scales_apply_to_the_sums():
    x = torch.randn(7, 32).bfloat16()
    q = torch.randint(-127, 127, (50, 32), dtype=torch.int8)
    s = torch.rand(50) + 0.5
    got = blockwise_fp32_linear(x, 50, lambda a, b: q[a:b], s)
    torch.testing.assert_close(got.float(), F.linear(x.float(), q.float()) * s, rtol=2 ** -8, atol=1e-4)
