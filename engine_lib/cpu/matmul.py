"""Matmuls of many rows on a CPU without 16-bit float instructions: in fp32, a block of weights at a time.

Defined in chapter 06 (half precision). An x86 CPU without AVX-512 BF16 or AMX (AVX2 laptops and
servers, and many cloud hosts) has no instruction that multiplies bf16 or fp16 numbers. oneDNN's
bf16 GEMM then converts as it goes and, measured on a 2-core AVX2 host, runs at about 21 GFLOP/s
whatever the number of rows, while the fp32 GEMM reaches 140. One row (a decode step) reads each
weight once and is bound by memory either way (decode steps go to our kernels, ``cpu_kernels``).
From ``FP32_MIN_ROWS`` rows on outside a decode step (a prefill) a block of output rows of the weight is
converted to fp32, small enough to stay in cache, and multiplied in fp32 (``fp32_gemm``: oneDNN's fp32
matmul, 1.2 to 1.5x MKL's on these blocks); on that host a 35-token prefill of a (8960, 1536) layer took
11 ms this way (through MKL) against 45 ms in bf16. The result is
rounded to the half dtype once, as the bf16 GEMM's fp32 accumulator is.

bf16 layers on our kernels (``cpu_kernels``) skip the copy: from 2 rows on, our GEMM (``bf16_linear``)
widens each weight to fp32 in registers and never writes an fp32 copy. Measured on a 2-core Zen 4 held to
AVX2, interleaved: a 35-row (8960, 1536) layer 4.8 ms against 7.3 ms in fp32 blocks (medians of 21); the
half rung's first token on the book's ten prompts 114.9 against 141.8 ms (median of 20). fp16 weights, input
widths that are not a multiple of 16, and the quantized layers' long prefills keep the fp32 blocks.

Eager calls only: inside a compiled step inductor picks its own matmul, and a row-count switch
there would add a guard (and a recompile) on the batch size.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels as cpu_kernels
from . import packed as cpu_packed

FP32_MIN_ROWS = 6  # measured crossover on a 2-core AVX2 host: 4 rows tie, 8 rows are 1.7x faster in fp32
BLOCK_ELEMENTS = 1 << 20  # weight elements converted at a time: 4 MiB of fp32
MODE_ENV = "ENGINE_LIB_CPU_HALF_MATMUL"  # "native" or "fp32": overrides the detection (tests, comparisons)
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def half_matmul_is_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX). Only x86 is judged:
    elsewhere (Arm) the half GEMM is left as it is."""
    mode = os.environ.get(MODE_ENV, "")
    if mode not in ("", "native", "fp32"):
        raise ValueError(f"{MODE_ENV}={mode!r}: choose 'native' or 'fp32' (or leave it unset to detect)")
    if mode:
        return mode == "native"
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def packs_bf16_weights() -> bool:
    """Whether the bf16 layers here run on weights reordered once for oneDNN (``cpu_packed``): a CPU that
    multiplies bf16 in hardware, where oneDNN's bf16 matmul is the fast one at every row count."""
    return half_matmul_is_native() and cpu_packed.available()


@functools.cache
def lone_row_takes_matvec() -> bool:
    """Whether a lone bf16 row (a decode step of one sequence, a prefill's last position through the LM head)
    runs our matvec (``cpu_kernels``) where the layers hold blocked weights for oneDNN: on a CPU with AMX.
    Measured on a 2-core Xeon with AMX, the 4-layer checkpoint's half rung, interleaved in one process: decode
    29.8 tok/s through our matvec against 25.3 through the blocked weights (medians of 6, 1.18x), and 1.20x
    with the blocked copies collapsed onto 2 MiB pages too: it is oneDNN's one-row kernel, not the TLB. Two rows
    and more stay with the blocked weights (16 rows of (8960, 1536): 0.6 ms against 3.2 for our GEMM). A Zen 4
    (AVX-512 BF16, no AMX) measured the blocked weights faster for one row (``cpu_packed``) and keeps them."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_amx_tile_supported()


def wants_fp32(x2: torch.Tensor) -> bool:
    """x2 (rows, in): an eager half-precision matmul of enough rows, on a CPU without bf16 instructions."""
    return (x2.device.type == "cpu" and x2.dtype in HALF and x2.shape[0] >= FP32_MIN_ROWS
            and not torch.is_grad_enabled()  # inference only: the block buffer carries no gradient
            and not torch.compiler.is_compiling() and not half_matmul_is_native())


_scratch = threading.local()  # each thread's buffers, one per dtype, reused: fresh ones cost page faults


def block_of(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``rows`` (any dtype) converted into this thread's reusable buffer of ``dtype``; rows already of
    it as they are. Measured on a 2-core AVX2 host: a (682, 1536) int8 block converts in 109 us into
    the buffer, 277 us with ``.float()``, which allocates."""
    if rows.dtype == dtype:
        return rows
    return scratch(rows.numel(), dtype)[:rows.numel()].view(rows.shape).copy_(rows)


def blockwise_fp32_linear(x2: torch.Tensor, out_features: int, weight_rows: Callable[[int, int], torch.Tensor],
                          scales: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (rows, in) @ W^T in fp32, where ``weight_rows(a, b)`` gives output rows a..b-1 of W,
    (b - a, in), in any dtype; ``scales`` (out,), if given, multiply the output columns (int8's
    per-channel scale, applied to the sums: (out,) multiplies instead of (out, in)), then ``bias``
    (out,) is added, all in fp32. Returns (rows, out) in x2's dtype, rounded once."""
    xf = x2.float()
    block = max(16, BLOCK_ELEMENTS // x2.shape[1])
    outs = [fp32_gemm(xf, block_of(weight_rows(a, min(a + block, out_features))))
            for a in range(0, out_features, block)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # (rows, out) fp32
    if scales is not None:
        y = y * scales.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x2.dtype)


ONEDNN_FP32 = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def fp32_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (rows, in) @ w (n, in)^T, both fp32 and plain: oneDNN's matmul where PyTorch has it, else ``F.linear``
    (MKL's). Measured on a 2-core Zen 4 held to AVX2 (scripts/cpu_as_avx2.sh), medians of 20, 35 rows: (682,
    1536) blocks 0.50 against 0.63 ms, (117, 8960) 0.50 / 0.63, (17920, 1536) 13.1 / 19.5, (1536, 8960) 7.3 / 8.8."""
    if ONEDNN_FP32:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.contiguous(), None, "none", [], "")
    return F.linear(x, w)


def scratch(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's reusable buffer of ``dtype``, at least ``numel`` elements (flat)."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, so the checkpoint loads as it would). On a CPU, bf16
    rows go through our kernels (``cpu_kernels``: a matvec for one row, a GEMM for more) once
    ``use_cpu_kernels`` has switched them on, and other many-row half-precision calls on a CPU
    without bf16 instructions run ``blockwise_fp32_linear``."""

    gemv = False  # set by use_cpu_kernels
    native_gemm = False  # set by use_cpu_kernels: this CPU multiplies bf16 in hardware (many rows go there)
    packed = False  # set by use_cpu_kernels: the weight has a blocked copy for oneDNN (``cpu_packed``)
    one_call_row = False  # set by use_cpu_kernels: a lone bf16 row runs ``bf16_linear``'s one-call layer
    lone_row_matvec = False  # set by use_cpu_kernels: a packed layer's lone row runs our matvec (see lone_row_takes_matvec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_call_row and x.numel() == self.in_features and x.dtype == torch.bfloat16 \
                and not torch.compiler.is_compiling():
            # an eager decode step's row, first: the checks below cost an eager step more than this layer's op
            return torch.ops.engine_lib_cpu.bf16_linear(x.contiguous(), self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if self.packed and x2.dtype == torch.bfloat16 and not cpu_kernels.ROWS_ALONE and not x2.requires_grad \
                and not (self.weight.requires_grad and torch.is_grad_enabled()) \
                and not (self.lone_row_matvec and x2.shape[0] == 1):
            # every row count (one row too, but where our matvec is faster); rows summed alone (a batch-invariant
            # server) take our kernel. In a compiled step for 2 rows or more the row test costs no guard
            y = cpu_packed.linear(x2, self.weight, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.gemv and cpu_kernels.takes(x2, self.native_gemm):
            return cpu_kernels.bf16_linear(x2, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)
        if not wants_fp32(x2):
            return super().forward(x)
        if self.gemv and x2.dtype == torch.bfloat16 and cpu_kernels.gemm_takes(x2, self.weight):
            return cpu_kernels.bf16_linear(x2, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)
        y = blockwise_fp32_linear(x2, self.out_features, lambda a, b: self.weight[a:b], bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def use_cpu_kernels(model: nn.Module) -> None:
    """After loading on the CPU: the bf16 layers run on blocked weights where this CPU multiplies bf16 in
    hardware (``cpu_packed``), and decode through our matvec kernel where it builds (a batch-invariant
    server's rows, a lone row on a CPU with AMX, and every row on a CPU without bf16 instructions). The
    quantized layers choose theirs when they are quantized."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.weight.device.type == "cpu"
              and m.weight.dtype == torch.bfloat16]
    if layers and packs_bf16_weights():
        for m in layers:
            m.packed = True
            cpu_packed.pack(m)
    if layers and cpu_kernels.available():
        native, lone = half_matmul_is_native(), lone_row_takes_matvec()
        for m in layers:
            m.gemv, m.native_gemm = True, native
            m.lone_row_matvec = m.packed and lone
            m.one_call_row = (not m.packed or m.lone_row_matvec) and (m.bias is None or m.bias.dtype == torch.bfloat16)
