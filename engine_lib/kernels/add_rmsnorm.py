"""Residual add + RMSNorm in one pass, the residual stream updated in place.

Defined in chapter 14 (writing our own kernels). Every decoder layer does this twice:
``residual = x + residual`` then ``norm(residual)``. Run op by op, the residual stream is
read for the add, written, read again for the mean of squares and once more for the scale.
One program per row does it all with the row in registers: it reads x, the residual and
the weight once and writes the new residual and the normed output once
(``bytes_moved``), about half of what the unfused ops move.

The numerics are those of ``layers.rmsnorm.RMSNorm.add_forward``: the sum is stored in the
residual's dtype and normalised as stored, in fp32; the normalised value is rounded to the
weight's dtype before the weight multiplies it, and the product is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import unavailable_reason
from .rounding import round_to_dtype


@triton.jit
def _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_row_stride, hidden, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows * hidden can pass 2^31 in a long prefill
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden  # hidden need not be a power of two
    h = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * hidden + cols
        h += tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        stored = round_to_dtype(h, residual_ptr.dtype.element_ty)
        tl.store(residual_ptrs, stored, mask=mask)
        h = stored.to(tl.float32)  # normalise the residual as stored, as the torch code does
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)  # masked lanes are 0: they add nothing
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = round_to_dtype(h * inv_rms, weight_ptr.dtype.element_ty).to(tl.float32)
    out = round_to_dtype(w.to(tl.float32) * normed, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, out, mask=mask)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """ValueError (or RuntimeError: no way to run) before anything is launched."""
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not fit x of shape {tuple(x.shape)}: "
                         "it must be (hidden,) with hidden = x.shape[-1]")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x's last dimension must be contiguous, its stride is {x.stride(-1)}")
    tensors = [x, weight]
    if residual is not None:
        tensors.append(residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual of shape {tuple(residual.shape)} for x of shape {tuple(x.shape)}")
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous: the kernel writes it in place")
        want = torch.promote_types(x.dtype, residual.dtype)
        if residual.dtype != want:
            raise ValueError(f"x + residual is {want}, which a {residual.dtype} residual cannot hold in place "
                             f"(x is {x.dtype})")
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"tensors on different devices: {sorted({str(t.device) for t in tensors})}")
    reason = unavailable_reason(x.device, x.dtype)
    if reason is not None:
        raise RuntimeError(reason)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # a view whenever the leading dims allow one
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    if x2.shape[0] == 0 or hidden == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _add_rmsnorm_kernel[(x2.shape[0],)](
        x2, x2 if residual is None else residual, weight, out, x2.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out


def add_rmsnorm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, and return ``rmsnorm(residual)`` (a new tensor, in weight's dtype).

    x: (..., hidden), last dimension contiguous; residual: x's shape, contiguous, in the
    promoted dtype of the two (an fp32 residual stream under fp16/bf16 activations is fine);
    weight: (hidden,).
    """
    _check(x, residual, weight)
    return _launch(x, residual, weight, eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same kernel without the add: ``RMSNorm.forward``. x: (..., hidden) -> x's shape, weight's dtype."""
    _check(x, None, weight)
    return _launch(x, None, weight, eps)


def bytes_moved(rows: int, hidden: int, x_bytes: int, residual_bytes: int, weight_bytes: int) -> int:
    """rows * hidden * (x + 2 residual + weight bytes) + hidden * weight bytes; residual_bytes=0 for ``rmsnorm``."""
    # x read, residual read and written, normed written (in the weight's dtype), weight read once
    return rows * hidden * (x_bytes + 2 * residual_bytes + weight_bytes) + hidden * weight_bytes
