"""round_to_dtype: the kernels' fp32 -> bf16/fp16 cast rounds to nearest even, in the interpreter too."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

# CPU tensors under Triton's interpreter; on a GPU, tests/test_gpu.py runs these kernels compiled
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: on a GPU see tests/test_gpu.py")

from engine_lib.kernels.rounding import round_to_dtype  # noqa: E402


@triton.jit
def _cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, round_to_dtype(tl.load(src + offs, mask=offs < n), dst.dtype.element_ty), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, on fp16's inf
def test_round_to_dtype_rounds_bf16_to_nearest_even():
    """The interpreter truncates fp32 -> bf16; our cast must round as the GPU (and torch) do."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6)) * 100
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895e38])  # ties to even, down and up; overflow
    for dtype in (torch.bfloat16, torch.float16):
        got = torch.empty(1000, dtype=dtype)
        _cast_kernel[(1,)](x, got, 1000, BLOCK=1024)
        assert torch.equal(got, x.to(dtype))
