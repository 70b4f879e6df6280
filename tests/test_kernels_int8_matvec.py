"""engine_lib/kernels/int8_matvec.py under Triton's interpreter: the weight-only int8 matvec against
its reference, the engine's ``dequantize_int8`` + ``F.linear`` and ``QuantLinear`` (chapter 14)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

# CPU tensors under Triton's interpreter; on a GPU, tests/test_gpu.py runs these kernels compiled
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: on a GPU see tests/test_gpu.py")

from engine_lib.book.kernel_references import int8_matvec_reference  # noqa: E402
from engine_lib.kernels.int8_matvec import MAX_ROWS, bytes_moved, int8_matvec  # noqa: E402
from engine_lib.quant.formats import dequantize_int8, quantize_int8  # noqa: E402
from engine_lib.quant.linear import QuantLinear  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def layer(out_features, in_features, dtype, seed=0):
    """An int8 weight, its scales (in ``dtype``) and a bias, from a random full-precision weight."""
    g = torch.Generator().manual_seed(seed)
    qweight, scales = quantize_int8(torch.randn(out_features, in_features, generator=g) * 0.05, dtype)
    return qweight, scales, (torch.randn(out_features, generator=g) * 0.1).to(dtype)


def assert_close(got, want, dtype):
    """fp32 sums in another order, rounded once: an ulp of the result (eps relative), plus fp32's noise
    where the sum cancels to near zero."""
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=1e-5)


CASES = [  # (leading dims of x, in_features, out_features): ragged, not powers of two, several K tiles
    ((1,), 96, 100),
    ((3,), 200, 100),
    ((7,), 96, 33),
    ((2, 4), 300, 64),  # 8 rows = MAX_ROWS
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("lead,in_features,out_features", CASES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_matches_reference_and_engine(lead, in_features, out_features, dtype, with_bias):
    qweight, scales, bias = layer(out_features, in_features, dtype)
    bias = bias if with_bias else None
    x = torch.randn(*lead, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)

    got = int8_matvec(x, qweight, scales, bias)

    assert got.shape == (*lead, out_features) and got.dtype == dtype
    want = int8_matvec_reference(x, qweight, scales, bias)
    engine = F.linear(x.float(), dequantize_int8(qweight, scales), None if bias is None else bias.float()).to(dtype)
    assert_close(want, engine, dtype)  # F.linear adds the bias inside the matmul: not always the same bits
    assert_close(got, want, dtype)
    assert_close(got, engine, dtype)


def test_strided_x():
    """Rows of x may be strided (a column slice), and so may its columns."""
    qweight, scales, bias = layer(100, 96, BF16)
    wide = torch.randn(3, 200).to(BF16)
    for x in (wide[:, :96], wide[:, ::2][:, :96]):
        assert_close(int8_matvec(x, qweight, scales, bias), int8_matvec_reference(x, qweight, scales, bias), BF16)


def test_matches_quant_linear():
    """The engine's int8 layer gives the same outputs, up to its own roundings (bias added after one)."""
    lin = QuantLinear(96, 100, bias=True, mode="int8")
    g = torch.Generator().manual_seed(2)
    lin.quantize_(torch.randn(100, 96, generator=g) * 0.05, BF16)
    lin.bias = torch.nn.Parameter((torch.randn(100, generator=g) * 0.1).to(BF16), requires_grad=False)
    x = torch.randn(2, 96, generator=g).to(BF16)
    got = int8_matvec(x, lin.qweight, lin.scales, lin.bias)
    torch.testing.assert_close(got.float(), lin(x).float(), rtol=2e-2, atol=2e-2)


def test_bad_inputs_raise():
    qweight, scales, _ = layer(100, 96, BF16)
    x = torch.randn(2, 96).to(BF16)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        int8_matvec(torch.randn(MAX_ROWS + 1, 96).to(BF16), qweight, scales)
    with pytest.raises(ValueError, match="in_features 96"):
        int8_matvec(torch.randn(2, 95).to(BF16), qweight, scales)
    with pytest.raises(ValueError, match="contiguous int8"):
        int8_matvec(x, qweight.float(), scales)
    with pytest.raises(ValueError, match="contiguous int8"):
        int8_matvec(x, qweight.t().contiguous().t(), scales)
    with pytest.raises(ValueError, match="in x's dtype"):
        int8_matvec(x, qweight, scales.float())
    with pytest.raises(ValueError, match="bias must be"):
        int8_matvec(x, qweight, scales, torch.zeros(99, dtype=BF16))


def test_bytes_moved():
    # one decode row through Qwen2.5-0.5B's MLP up projection, bf16 activations
    n, k = 4864, 896
    total = bytes_moved(1, k, n, 2)
    assert total == n * k + n * 2 + (k + n) * 2
    assert n * k / total > 0.99  # the int8 weight is nearly everything
    assert bytes_moved(8, k, n, 2) < 1.1 * total  # more rows cost little: the weight is read once for all
    assert 2 * n * k / total > 1.9  # against reading the same weight in bf16
