"""Which kernel runs a quantized layer's matmul on a CPU, for each instruction set and number of rows.

Defined in chapter 10 (fewer bytes), beside our kernels (``kernels``, ``gemv.cpp``). The quantized layer
(``quant.linear.QuantLinear``) owns its integers and asks here, once when it is loaded, which packed
kernels may hold them (``int8_candidates``, ``int4_takes_gemv``), and on every call whether the rows go
to that kernel (``takes_packed``) or to a prefill's blocks (``prefill_matmul``). The limits below were
measured, on the hosts and with the numbers ``RECORD`` gives; a new CPU may move them.

- int8: in AMX tiles where the CPU has AMX and the shape fits (``kernels.int8_tiles_pack``), else our
  matvec (``kernels.int8_linear``), else PyTorch's ``_weight_int8pack_mm``; a prefill past the kernel's
  rows takes the int8 GEMM of 24-bit rows (AMX, ``kernels.int24_linear``) or bf16 blocks and the bf16
  GEMM, or fp32 blocks on a CPU without bf16 instructions (``matmul.blockwise_fp32_linear``).
- int4: our matvec (``kernels.int4_linear``); a prefill on AMX dequantizes 32 rows at a time into L2
  (``kernels.int4_amx_linear``), elsewhere bf16 blocks, or fp32 blocks without bf16 instructions; on a
  CPU with AVX-512 VNNI and no AMX, up to ``VNNI_INT4_KERNEL_ROWS`` rows stay in our kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .kernels import INT4_GEMV, INT8_GEMV, INT8_TILES
from .matmul import block_of, blockwise_fp32_linear, scratch, wants_fp32

RECORD = "book/results/cpu-kernel-routing.md"  # what was measured, on which host, for every limit below
PACKED_MAX_ROWS = 32  # _weight_int8pack_mm up to this many rows; beyond, blocks and a dense matmul
HALF_BLOCK_ELEMENTS = 1 << 22  # weight elements per bf16 block of a prefill (our kernels built, bf16 instructions)
INT24_MAX_ROWS = 64  # AMX: an int8 prefill of up to this many rows as the int8 GEMM of 24-bit rows
INT4_AMX_MAX_ROWS = 512  # AMX-BF16: an int4 prefill of up to this many rows dequantized into L2, 32 rows at a time
TILES_MAX_ROWS = 128  # AMX: int8 weights in tiles up to this many rows; beyond, bf16 blocks
# no bf16 instructions: our row kernels up to this many rows, not fp32 blocks that dequantize every weight first
FP32_HOST_KERNEL_ROWS = {INT4_GEMV: 2048, INT8_GEMV: 2048}
VNNI_INT4_KERNEL_ROWS = 64  # AVX-512 VNNI and bf16 but no AMX: a bf16 int4 prefill stays in our kernel to here


def int8_candidates(q: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """The packed kernels an int8 (out, in) weight may run on, best first (each is checked before it is kept)."""
    out = [INT8_TILES] if dtype == torch.bfloat16 and kernels.int8_tiles_fit(*q.shape) else []
    return out + ([INT8_GEMV] if kernels.available() else []) + ["_weight_int8pack_mm"]


def int4_takes_gemv(in_features: int, group_size: int) -> bool:
    """Whether an int4 layer of this shape may run our matvec (checked before it is kept)."""
    return in_features % 32 == 0 and group_size % 32 == 0 and kernels.available()


def kernel_rows(kernel: str, x2: torch.Tensor, group_size: int) -> int:
    """The most rows our CPU kernel takes outside a decode step: more where the alternative is fp32 blocks,
    or, for int4, bf16 blocks on a CPU whose int4 kernel is the AVX-512 VNNI one and that has no AMX."""
    if torch.compiler.is_compiling():  # a compiled step takes any row count (``takes``): probe nothing there
        return kernels.MAX_ROWS
    if wants_fp32(x2):
        return FP32_HOST_KERNEL_ROWS[kernel]
    if kernel == INT4_GEMV and x2.shape[0] > kernels.MAX_ROWS and x2.dtype == torch.bfloat16 \
            and kernels.int4_rows_beat_gemm(group_size):  # a decode's few rows need no probe
        return VNNI_INT4_KERNEL_ROWS
    return kernels.MAX_ROWS


def takes_packed(kernel: str, x2: torch.Tensor, group_size: int) -> bool:
    """Whether these rows (2-D) go to the layer's packed kernel; else to the blocks of a prefill."""
    if kernel == "_weight_int8pack_mm":
        return x2.shape[0] <= PACKED_MAX_ROWS
    if kernel == INT8_TILES:
        return x2.shape[0] <= TILES_MAX_ROWS
    if kernel in (INT8_GEMV, INT4_GEMV):
        return kernels.takes(x2, max_rows=kernel_rows(kernel, x2, group_size))
    return True


def prefill_matmul(layer, x2: torch.Tensor) -> torch.Tensor | None:
    """A quantized layer's rows on a CPU path of its own (fp32 blocks, AMX, bf16 blocks of our layouts), or None
    for the layer's plain dequantize-then-matmul. ``layer``: a ``QuantLinear`` (its integers, scales and rows)."""
    n, kernel = layer.out_features, layer.kernel
    if wants_fp32(x2):  # a CPU without bf16 instructions: fp32 blocks (matmul)
        if layer.mode == "int8":
            return blockwise_fp32_linear(x2, n, layer.int8_rows, layer.scales)
        return blockwise_fp32_linear(x2, n, int4_rows(layer, torch.float32) if kernel == INT4_GEMV
                                     else lambda a, b: layer.dense_weight(a, b, torch.float32))
    block = max(16, HALF_BLOCK_ELEMENTS // layer.in_features)
    if kernel == INT4_GEMV and x2.dtype == torch.bfloat16 and x2.shape[0] <= INT4_AMX_MAX_ROWS \
            and not x2.requires_grad and kernels.int4_amx_fit(n, layer.in_features, layer.group_size):
        return kernels.int4_amx_linear(x2, layer.qweight, layer.scales_and_zeros, layer.group_size)
    if kernel == INT4_GEMV:  # a CPU with bf16 instructions: the half GEMM on each block (AMX, AVX-512 BF16)
        rows_of = int4_rows(layer, x2.dtype if x2.dtype == torch.bfloat16 else torch.float32)
        return torch.cat([F.linear(x2, rows_of(a, min(a + block, n)).to(x2.dtype)) for a in range(0, n, block)], -1)
    if kernel == INT8_TILES and x2.dtype == torch.bfloat16:  # blocks of whole tiles, straight to bf16
        block = max(16, block // 16 * 16)
        return torch.cat([F.linear(x2, kernels.int8_tiles_bf16_rows(
            layer.qweight, a, min(a + block, n), scratch(block * layer.in_features, torch.bfloat16)))
            for a in range(0, n, block)], -1) * layer.scales
    if kernel == INT8_GEMV and x2.dtype == torch.bfloat16:
        if x2.shape[0] <= INT24_MAX_ROWS and not x2.requires_grad and kernels.int8_gemm_is_native():  # AMX
            return kernels.int24_linear(x2, layer.qweight, layer.scales)
        # the bf16 GEMM on each block, converted into a reused buffer
        return torch.cat([F.linear(x2, block_of(layer.int8_rows(a, min(a + block, n)), x2.dtype))
                          for a in range(0, n, block)], -1) * layer.scales
    return None


def int4_rows(layer, dtype: torch.dtype):
    """(a, b) -> output rows a..b-1 of an int4 weight in ``dtype`` (fp32 or bf16), dequantized by our C++
    kernel into this thread's reused buffer (the layer's kernel is ``INT4_GEMV``). The tensor arithmetic of
    ``dense_weight`` took a second per 35-token prefill of the 4-layer 1.5B-shape checkpoint on a 2-core host
    with AMX, where llama.cpp took 38 ms."""
    return lambda a, b: kernels.int4_dequantize(layer.qweight, layer.scales_and_zeros, layer.group_size, a, b,
                                                scratch((b - a) * layer.in_features, dtype))
