"""Weight-only int8 matrix-vector products for 1 to ``MAX_ROWS`` rows (a decode step).

Defined in chapter 14 (writing our own kernels). At decode time a linear layer reads its
whole weight to produce a handful of rows, so its time is the weight's bytes: int8 halves
them against bf16. That only pays if the int8 weight is read as int8. Dequantizing first
reads the int8 weight, writes a bf16 copy and reads it back: five bytes per weight. Here each
program streams its int8 weight tile once, converts it in registers and multiplies it
against every row at once (``bytes_moved``: out * in bytes dominate).

Layout: one program per ``BLOCK_N`` output channels, looping over the inputs ``BLOCK_K`` at
a time. The rows are padded to 16 with a mask, the smallest tile ``tl.dot`` takes. The
accumulator is fp32; the per-channel scale and the bias are applied once at the end:
``y = (x @ q^T) * scale + bias``, rounded once to x's dtype. (No fp16 overflow on the
unscaled sums, which forces ``QuantLinear`` to scale the weight first in fp16.)

No split-K: a program owns its outputs over the whole of K, so nothing needs a second pass
or atomics. The cost is parallelism on narrow layers: with ``BLOCK_N = 32`` a 896-wide
projection gets 28 programs, fewer than a big GPU has SMs; splitting K is the next step.

Under Triton's CPU interpreter the tiles are multiplied in fp32 (exact too): its ``tl.dot``
multiplies bf16 tiles as their raw 16-bit patterns, integers, not numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import device_capability, interpreting, unavailable_reason
from .rounding import round_to_dtype

MAX_ROWS = 8  # a decode step's rows; a prefill is a matmul, for which the dense path is right
BLOCK_M = 16  # rows padded to tl.dot's minimum


@dataclass(frozen=True)
class Tiles:
    """Output channels per program, inputs per ``tl.dot``, warps."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4


def tiles(capability: tuple[int, int] | None, dtype: torch.dtype) -> Tiles:
    """The tiles on a GPU of ``capability`` (None: the interpreter), measured with the resource contract.

    16-bit dots from sm_80 run on tensor cores: (16 x 128) @ (128 x 32) tiles fit in 4 warps' registers.
    Below sm_80, and for fp32 (exact, no tf32), Triton multiplies with FMA, keeping more of each tile in
    registers: 128 inputs a step spill on a T4 (fp16) and an H200 (fp32), 64 fit with room to spare."""
    if capability is None or (capability >= (8, 0) and dtype != torch.float32):
        return Tiles()
    return Tiles(block_k=64)


@triton.jit(do_not_specialize=["rows"])  # 1 to 8 rows, one compile (1 would be a variant of its own)
def _int8_matvec_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, rows, out_features, in_features,
                        x_row_stride, x_col_stride, out_row_stride,
                        HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < out_features
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * in_features  # int64: out * in can pass 2^31 (an LM head)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < in_features
        x = tl.load(x_ptr + offs_m[:, None] * x_row_stride + ks[None, :] * x_col_stride,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_rows + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # (BLOCK_K, BLOCK_N) int8
        # int8 -> x's dtype is exact (|q| <= 127 needs 7 bits); 16-bit tiles are fp32-accumulated products
        if DOT_DTYPE == tl.float32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")  # not tf32's 10 bits
        else:
            acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)
    y = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = round_to_dtype(y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * out_row_stride + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError (or RuntimeError: no way to run) before anything is launched."""
    if qweight.dtype != torch.int8 or qweight.ndim != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous int8 (out, in) matrix, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}{'' if qweight.is_contiguous() else ', not contiguous'}")
    out_features, in_features = qweight.shape
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x of shape {tuple(x.shape)} for a weight of in_features {in_features}")
    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS:
        raise ValueError(f"{rows} rows: int8_matvec is for at most {MAX_ROWS} (a decode step); "
                         "use the dense matmul for more")
    if scales.shape != (out_features,) or scales.dtype != x.dtype:
        raise ValueError(f"scales must be ({out_features},) in x's dtype {x.dtype}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if bias is not None and (bias.shape != (out_features,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be floating point ({out_features},), got {bias.dtype} {tuple(bias.shape)}")
    tensors = [t for t in (x, qweight, scales, bias) if t is not None]
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"tensors on different devices: {sorted({str(t.device) for t in tensors})}")
    reason = unavailable_reason(x.device, x.dtype)
    if reason is not None:
        raise RuntimeError(reason)


def int8_matvec(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scales[:, None]).T + bias`` without a float copy of the weight.

    x: (..., in), at most ``MAX_ROWS`` rows once the leading dims are flattened; qweight:
    int8 (out, in), contiguous; scales: (out,) in x's dtype; bias: (out,) or None.
    Returns (..., out) in x's dtype.
    """
    _check(x, qweight, scales, bias)
    capability = None if interpreting() else device_capability(x.device)
    return _launch(x, qweight, scales, bias, tiles(capability, x.dtype))


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            tile: Tiles) -> torch.Tensor:
    """The launch, on checked inputs (the resource contract records it from here)."""
    out_features, in_features = qweight.shape
    x2 = x.reshape(-1, in_features)  # (rows, in), a view whenever possible
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    if out.numel() and in_features:
        # the interpreter multiplies bf16 tiles as their raw uint16 bits: give it fp32 (exact as well)
        dot_dtype = tl.float32 if interpreting() or x.dtype == torch.float32 else (
            tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
        _int8_matvec_kernel[(triton.cdiv(out_features, tile.block_n),)](
            x2, qweight, scales, scales if bias is None else bias, out, x2.shape[0], out_features, in_features,
            x2.stride(0), x2.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype, BLOCK_M=BLOCK_M, BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k, num_warps=tile.num_warps)
    elif out.numel():  # no inputs: the products are empty sums
        out.copy_(torch.zeros_like(out) if bias is None else bias.expand_as(out))
    return out.reshape(*x.shape[:-1], out_features)


def bytes_moved(rows: int, in_features: int, out_features: int, x_bytes: int) -> int:
    """out * in (int8 weight) + out * x_bytes (scales) + rows * (in + out) * x_bytes (x read, y written); no bias."""
    return out_features * in_features + out_features * x_bytes + rows * (in_features + out_features) * x_bytes
