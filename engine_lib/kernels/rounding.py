"""fp32 -> half precision inside a kernel, rounded to nearest even on a GPU and in the interpreter alike.

Defined in chapter 14 (writing our own kernels). Triton's CPU interpreter truncates fp32 ->
bf16 where a GPU rounds to nearest even, so the kernels round bf16 themselves: then the
interpreter's bits (the tests) and the GPU's are the same.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_dtype(x, dtype: tl.constexpr):
    """fp32 ``x`` cast to ``dtype``, rounded to nearest even also for bf16.

    The GPU's fp32 -> bf16 conversion already rounds to nearest even, but the interpreter
    truncates, so bf16 is rounded here with integer ops: add half an ulp of bf16 (ties to
    the even neighbour), then clear the 16 bits bf16 drops. A few integer ops per element:
    free in a bandwidth-bound kernel, and the same bits on both.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)
