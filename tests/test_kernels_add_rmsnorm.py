"""engine_lib/kernels/add_rmsnorm.py under Triton's interpreter: the residual add + RMSNorm kernel
against its reference and the engine's ``RMSNorm.add_forward`` (chapter 14)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

# CPU tensors under Triton's interpreter; on a GPU, tests/test_gpu.py runs these kernels compiled
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: on a GPU see tests/test_gpu.py")

from engine_lib.book.kernel_references import add_rmsnorm_reference  # noqa: E402
from engine_lib.kernels.add_rmsnorm import (  # noqa: E402
    add_rmsnorm_,
    bytes_moved,
    rmsnorm,
)
from engine_lib.model.layers.rmsnorm import RMSNorm  # noqa: E402

EPS = 1e-6
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place (same 16- or 32-bit float dtype)."""
    assert a.dtype == b.dtype
    int_type, sign = (torch.int16, 0x7FFF) if a.element_size() == 2 else (torch.int32, 0x7FFFFFFF)

    def ordered(t):  # floats -> integers in the same order, one step per representable value
        i = t.contiguous().view(int_type).long()
        return torch.where(i < 0, -(i & sign), i)

    return (ordered(a) - ordered(b)).abs().max().item()


def make_norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, EPS)
    g = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return norm


def randn(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


CASES = [  # (x dtype, residual dtype, weight dtype, shape): ragged rows, hidden not a power of two
    (F32, F32, F32, (2, 3, 100)),
    (F32, F32, F32, (1, 96)),
    (BF16, BF16, BF16, (7, 96)),
    (BF16, BF16, BF16, (2, 4, 100)),
    (BF16, F32, BF16, (3, 100)),  # an fp32 residual stream under bf16 activations
    (F16, F32, F16, (8, 96)),
    (F16, F16, F16, (1, 1, 100)),
]


@pytest.mark.parametrize("x_dtype,res_dtype,w_dtype,shape", CASES)
def test_add_rmsnorm_matches_engine(x_dtype, res_dtype, w_dtype, shape):
    hidden = shape[-1]
    norm = make_norm(hidden, w_dtype)
    x, residual = randn(*shape, dtype=x_dtype, seed=1), randn(*shape, dtype=res_dtype, seed=2)
    want_normed, want_residual = norm.add_forward(x, residual)
    ref_normed, ref_residual = add_rmsnorm_reference(x, residual, norm.weight.data, EPS)
    before = residual.clone()

    buffer = residual.data_ptr()
    got = add_rmsnorm_(x, residual, norm.weight.data, EPS)

    assert residual.data_ptr() == buffer and not torch.equal(residual, before)  # updated in place
    assert got.shape == x.shape and got.dtype == w_dtype
    assert torch.equal(residual, want_residual) and torch.equal(ref_residual, want_residual)  # one rounding: exact
    assert torch.equal(ref_normed, want_normed)
    if w_dtype == F32:  # only the reduction's order and rsqrt differ
        torch.testing.assert_close(got, want_normed, rtol=1e-5, atol=1e-6)
    else:
        assert ulps(got, want_normed) <= 1


@pytest.mark.parametrize("dtype,hidden", [(F32, 100), (BF16, 96)])
def test_rmsnorm_matches_forward(dtype, hidden):
    norm = make_norm(hidden, dtype)
    x = randn(3, hidden, dtype=dtype, seed=3)
    got, want = rmsnorm(x, norm.weight.data, EPS), norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert ulps(got, want) <= 1


def test_strided_rows_of_x():
    """x may be a column slice of a wider tensor: only the last dimension needs to be contiguous."""
    norm = make_norm(100, BF16)
    wide = randn(5, 160, dtype=BF16, seed=4)
    x, residual = wide[:, :100], randn(5, 100, dtype=F32, seed=5)
    want_normed, want_residual = norm.add_forward(x, residual)
    got = add_rmsnorm_(x, residual, norm.weight.data, EPS)
    assert torch.equal(residual, want_residual) and ulps(got, want_normed) <= 1


def test_bad_inputs_raise():
    w = torch.ones(96)
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="cannot hold in place"):  # fp32 + bf16 is fp32, not bf16
        add_rmsnorm_(x, torch.randn(2, 96).bfloat16(), w, EPS)
    with pytest.raises(ValueError, match="weight of shape"):
        add_rmsnorm_(x, torch.randn(2, 96), torch.ones(100), EPS)
    with pytest.raises(ValueError, match="residual of shape"):
        add_rmsnorm_(x, torch.randn(3, 96), w, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        add_rmsnorm_(x, torch.randn(96, 2).t(), w, EPS)
    with pytest.raises(ValueError, match="last dimension"):
        rmsnorm(torch.randn(96, 2).t(), w, EPS)


def test_bytes_moved():
    # one decode row of Qwen2.5-0.5B, bf16 activations, fp32 residual, bf16 weight
    assert bytes_moved(1, 896, 2, 4, 2) == 896 * (2 + 8 + 2) + 896 * 2
    assert bytes_moved(4, 896, 2, 0, 2) == 4 * 896 * 4 + 896 * 2  # rmsnorm alone
    # op by op: add (read 2, write 1), norm (read the residual twice, write once)
    rows, hidden = 32, 896
    unfused = rows * hidden * 2 * (3 + 3)
    assert bytes_moved(rows, hidden, 2, 2, 2) < 0.7 * unfused
