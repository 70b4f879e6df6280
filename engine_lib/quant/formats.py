"""Weight-only quantization: linear layers whose weights are stored as int8 or int4.

Defined in chapter 10 (fewer bytes). At batch 1 a decode step reads every weight once, so its
time is set by the bytes of the weights. ``QuantLinear`` keeps them as small integers and a few
floats that say how to turn them back into weights:

- ``int8``: one scale per output channel (symmetric absmax): ``w ~ q * scale``, q in [-127, 127];
- ``int4``: a scale and a zero point per group of ``GROUP_SIZE`` inputs (``group_size_for``) of each output channel:
  ``w ~ (q - 8) * scale + zero``, q in [0, 15] (the layout PyTorch's int4 kernels read).

Activations stay in half precision; the integers become floats only inside the matmul. The
loader quantizes each linear layer as it reads it from the checkpoint (``QuantLinear.quantize_``),
so the full-precision model never exists at once. Which matmul runs is chosen then, by device:

- CPU: PyTorch's packed kernels, ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu``.
  They are built for a few rows (a decode step): from ``PACKED_MAX_ROWS`` rows on (a prefill), the
  int8 layer dequantizes its weight in blocks and uses the dense matmul, which is faster there
  (in fp32 on a CPU without bf16 instructions: ``cpu_matmul``). On a CPU with AMX, an int8 weight is
  stored in the matrix unit's tiles instead (``cpu_kernels.int8_tiles_pack``: the same bytes, reordered
  once at load), and up to ``TILES_MAX_ROWS`` rows run on the rows written as 24-bit integers, exact
  integer sums: one row through AVX-512 VNNI over the tiles, more through AMX
  (``cpu_kernels.int8_tiles_linear``); a longer prefill takes the bf16 blocks.
  A layer whose shape does not fit the tiles keeps the plain layout; its prefill of up to
  ``INT24_MAX_ROWS`` rows runs PyTorch's int8 GEMM on the same 24-bit rows (``cpu_kernels.int24_linear``),
  which rearranges the weight into tiles on every call. An int4 prefill of up to ``INT4_AMX_MAX_ROWS``
  rows on a CPU with AMX-BF16 writes no bf16 block at all: 32 weight rows at a time are dequantized into
  a buffer that stays in L2 and multiplied there on AMX (``cpu_kernels.int4_amx_linear``). On a CPU with
  AVX-512 VNNI but no AMX, one of up to ``VNNI_INT4_KERNEL_ROWS`` rows runs our int4 kernel, four rows
  at a time, which beats the bf16 blocks there.
- CUDA: inside the compiled decode step (up to ``REDUCTION_MAX_ROWS`` rows, any batch a decode
  step has), int8 is written as a multiply-and-sum in fp32, which inductor fuses with the
  conversion into one kernel that reads each int8 weight once: no float copy of a weight is
  ever made, in fp16 as in bf16. Elsewhere (a prefill, an eager step) int8 is
  ``F.linear(x, q.to(x.dtype)) * scale`` (gpt-fast's form) a block of output rows at a time, so a
  temporary is at most ``DEQUANT_BLOCK`` elements. int4 through ``_weight_int4pack_mm``
  (tinygemm: bf16 on sm80 and later).
- whatever a packed kernel does not take (shapes, dtypes, older GPUs): dequantize, then matmul.

Every packed layout is checked on a few rows against the plain dequantized matmul when it is
made; one that disagrees or fails is dropped for the plain form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu import kernels as cpu_kernels
from ..cpu.kernels import INT4_AMX, INT4_GEMV, INT8_GEMV, INT8_TILES
from ..cpu.matmul import Linear, block_of, blockwise_fp32_linear, scratch, wants_fp32
from ..errors import UnsupportedOptionError

QUANT_MODES = ("int8", "int4")
GROUP_SIZE = 128  # int4: inputs per (scale, zero) pair
PACKED_MAX_ROWS = 32  # CPU int8: up to this many rows the packed kernel, beyond it blocks + dense matmul
REDUCTION_MAX_ROWS = 64  # compiled int8 without a packed kernel: up to this many rows, the fused reduction
DEQUANT_BLOCK = 1 << 24  # weight elements dequantized at once on the dense path (CPU)
# weight elements per half GEMM of a prefill, on a CPU with bf16 instructions, our kernels built:
# measured on a 2-core AMX host, a (17920, 1536) int8 layer at 35 rows took 10.4 ms in blocks of
# 2^20 (oneDNN's GEMM underused on 682 rows), 6.4 ms in blocks of 2^22, 7.0 in blocks of 2^24
HALF_BLOCK_ELEMENTS = 1 << 22
# CPU int8 prefills up to this many rows, on a CPU with AMX: the int8 GEMM of the rows as 24-bit integers
# (cpu_kernels.int24_linear: exact integer sums, fp32 rounding) instead of bf16 blocks and the bf16 GEMM.
# Measured on a 2-core AMX host at 35 rows, int24 against bf16 blocks: (2048, 1536) 0.40 against 0.73 ms,
# (1536, 1536) 0.28 / 0.55, (17920, 1536) 3.46 / 8.70, (1536, 8960) 1.55 / 4.46; at 64 rows (17920, 1536)
# 7.0 / 10.3 ms, at 96 rows 16.8 / 10.5 (oneDNN's int8 GEMM of 3 x 96 rows runs slower than its bf16 one)
INT24_MAX_ROWS = 64
# An int4 prefill of up to this many rows on a CPU with AMX-BF16 dequantizes 32 weight rows at a time into
# L2 and multiplies them there (cpu_kernels.int4_amx_linear); more rows take bf16 blocks and the bf16 GEMM.
# Measured on a 2-core AMX host, one layer's int4 matmuls (q, k, v, o, gate_up, down of the 1.5B shape),
# L2 strips / bf16 blocks: 46 rows about 2.5x faster, 256 rows 15.8 / 18.2 ms, 512 rows 30.4 / 35.7,
# 1024 rows 80.4 / 72.2 (each strip reads every row again, from L3)
INT4_AMX_MAX_ROWS = 512
# CPU int8 in AMX tiles (cpu_kernels.int8_tiles_linear) up to this many rows; beyond, bf16 blocks and the bf16
# GEMM. Measured on a 2-core AMX host (two runs of one session), the tiles kernel against bf16 blocks,
# (17920, 1536): 64 rows 3.1 / 6.9 ms, 128 rows 7.2 / 7.8, 192 rows 10.6 / 9.7, 512 rows 38.7 / 21.9;
# (1536, 8960): 128 rows 4.2 / 4.9, 192 rows 6.4 / 5.9, 512 rows 17.7 / 16.9
TILES_MAX_ROWS = 128
# On a CPU without bf16 instructions, an int4 or int8 prefill of up to this many rows runs our row kernel
# (cpu_kernels.int4_linear, int8_linear: a decode's kernel, row after row) instead of fp32 blocks, which
# first dequantize every weight to fp32. Measured on a 2-core Zen 4 held to AVX2 (scripts/cpu_as_avx2.sh),
# the time of one layer's linears (qkv, o, gate_up, down of the 1.5B shape) in the kernel over fp32 blocks
# (oneDNN's fp32 GEMM), 6 / 16 / 35 / 64 / 128 / 512 rows: int8 0.24 / 0.39 / 0.54 / 0.58 / 0.66 / 0.76,
# int4 0.31 / 0.48 / 0.72 / 0.82 / 0.92 / 0.99. Since int4's AVX2 kernel takes rows in pairs and sums four
# rows' zero points in one vector, int4 at 6 / 16 / 35 / 64 / 128 / 256 / 512 / 1024 rows: 0.22 / 0.36 /
# 0.49 / 0.55 / 0.61 / 0.67 / 0.71 / 0.72 (medians of 7 interleaved); since both kernels take a call's rows
# 512 at a time (gemv.cpp, KERNEL_CHUNK_ROWS), at 1024 / 2048 rows int4 0.73 / 0.75, int8 0.74 / 0.78 (int8 in
# one pass over 2048 rows: 1.17). Longer prompts were not measured: they take the fp32 blocks.
# (On a real 2-core AVX2 EPYC, before the activations were rounded on every core and while the blocks used
# MKL's GEMM, int8 at 32 rows took 0.50 to 1.38 and int4 at 128 rows 0.80 to 1.30: the limits were 16 and 48
# rows then.)
FP32_HOST_KERNEL_ROWS = {INT4_GEMV: 2048, INT8_GEMV: 2048}
# On a CPU with AVX-512 VNNI and bf16 instructions but no AMX (AMD Zen 4), a bf16 int4 prefill of up to this many
# rows runs our row kernel (cpu_kernels.int4_rows_beat_gemm; four rows at a time) instead of bf16 blocks and
# the bf16 GEMM. Measured on a 2-core Zen 4 host, one layer's four linears (qkv, o, gate_up, down; random
# int4 weights in groups of 128), kernel time over blocks', medians of 7 interleaved: 6 rows 0.29, 12 0.43,
# 24 0.72, 35 0.79, 48 0.70, 64 0.88, 96 0.96
VNNI_INT4_KERNEL_ROWS = 64
QUANT_CHUNK = 1 << 22  # weight elements quantized at once: bounds the fp32 temporaries while loading
PACKED_OPS = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm", INT8_GEMV, INT4_GEMV,
              INT8_TILES, INT4_AMX)
DENSE = "dequantize + linear"
INT24_GEMM = "int24 rows + _int_mm"  # an int8 prefill on a CPU with AMX (cpu_kernels.int24_linear), as reports name it


def group_size_for(in_features: int) -> int:
    """The int4 group size of a layer: the largest of 128, 64, 32 that divides ``in_features``.
    Every layer of the real model takes 128; the small trained preset (width 64) needs 64, which
    PyTorch's int4 kernels also take. A layer no size divides gets 128 and is refused."""
    return next((g for g in (GROUP_SIZE, 64, 32) if in_features % g == 0), GROUP_SIZE)


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in QUANT_MODES:
        raise UnsupportedOptionError(f"unknown quantization {mode!r}; choose one of {list(QUANT_MODES)} or None")


def _stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale in the storage dtype, rounded up (never below what the range needs)."""
    scale = scale.clamp(min=torch.finfo(dtype).smallest_normal)
    stored = scale.to(dtype)
    low = stored.float() < scale
    return torch.where(low, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)


@torch.no_grad()
def quantize_int8(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (out, in) -> q int8 (out, in), scales (out,) in ``dtype``.

    scale = max |w| of the row / 127, and q = round(w / scale): every weight is within half a
    step (scale / 2) of q * scale. Rows are done a block at a time, in fp32.
    """
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scales = torch.empty(n, dtype=dtype, device=w.device)
    rows = max(1, QUANT_CHUNK // k)
    for a in range(0, n, rows):
        blk = w[a:a + rows].to(torch.float32, copy=True)  # worked on in place below
        lo, hi = torch.aminmax(blk, dim=1)
        s = _stored_scale(torch.maximum(-lo, hi) / 127, dtype)
        q[a:a + rows] = blk.div_(s.float()[:, None]).round_().clamp_(-127, 127)
        scales[a:a + rows] = s
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q (out, in) int8, scales (out,) -> the fp32 weight they stand for."""
    return q.float() * scales.float()[:, None]


def int4_grid(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's stored (scale, zero) from its [lo, hi] range: 16 levels span it, w ~ (q - 8) * s + z.
    Shared by round-to-nearest and GPTQ (``gptq.py``), so both write the same format."""
    s = _stored_scale((hi - lo) / 15, dtype)
    return s, (lo + 8 * s.float()).to(dtype)


@torch.no_grad()
def quantize_int4(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped asymmetric int4: (out, in) -> q uint8 in [0, 15] (out, in), scales and zeros
    (out, in // group_size) in ``dtype``.

    Each group of ``group_size`` inputs of a row spans [min, max] with 16 levels: scale =
    (max - min) / 15, and zero = min + 8 * scale, so that w ~ (q - 8) * scale + zero (the form
    PyTorch's int4 kernels compute). q is rounded against the stored (rounded) scale and zero.
    """
    n, k = w.shape
    if k % group_size:
        raise UnsupportedOptionError(f"int4: in_features {k} is not a multiple of the group size {group_size}")
    groups = k // group_size
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, groups, dtype=dtype, device=w.device)
    zeros = torch.empty(n, groups, dtype=dtype, device=w.device)
    rows = max(1, QUANT_CHUNK // k)
    for a in range(0, n, rows):
        blk = w[a:a + rows].to(torch.float32, copy=True).reshape(-1, groups, group_size)  # worked on in place
        lo, hi = torch.aminmax(blk, dim=-1)
        s, z = int4_grid(lo, hi, dtype)
        base = z.float() - 8 * s.float()  # the value of level 0, as stored
        levels = blk.sub_(base[..., None]).div_(s.float()[..., None]).round_().clamp_(0, 15)
        q[a:a + rows] = levels.reshape(-1, k)
        scales[a:a + rows], zeros[a:a + rows] = s, z
    return q, scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """q (out, in) in [0, 15], scales and zeros (out, in // group) -> the fp32 weight."""
    n, k = q.shape
    groups = scales.shape[1]
    w = (q.float().view(n, groups, k // groups) - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.view(n, k)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W stored as int8 (per output channel) or int4 (per group of inputs).

    Built with placeholder tensors (the model is built on the meta device); ``quantize_`` fills
    it from one full-precision weight and picks the matmul (``kernel``) for its device.
    Parameters: ``qweight`` (int8 (out, in); int4: two values per byte, in the kernel's layout),
    ``scales`` (int8, (out,)) or ``scales_and_zeros`` (int4, (in // group, out, 2)), ``bias``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, mode: str = "int8",
                 group_size: int = GROUP_SIZE):
        super().__init__()
        if mode not in QUANT_MODES:
            raise UnsupportedOptionError(f"unknown quantization {mode!r}; choose one of {list(QUANT_MODES)}")
        if mode == "int4" and in_features % group_size:
            raise UnsupportedOptionError(f"int4: in_features {in_features} is not a multiple of the group size "
                                         f"{group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.group_size = mode, group_size
        self.kernel = "not quantized yet"
        self.kernel_note = ""  # why a packed kernel was not used, if it was not
        if mode == "int8":
            self.qweight = _param(torch.empty(out_features, in_features, dtype=torch.int8))
            self.scales = _param(torch.empty(out_features))
        else:
            self.qweight = _param(torch.empty(out_features, in_features // 2, dtype=torch.uint8))
            self.scales_and_zeros = _param(torch.empty(in_features // group_size, out_features, 2))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode}{group}, kernel={self.kernel}")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, scales and output."""
        return (self.scales if self.mode == "int8" else self.scales_and_zeros).dtype

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        """Quantize a full-precision (out, in) weight into this layer, on the weight's device."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a {self.out_features} x "
                             f"{self.in_features} layer")
        self.kernel_note = ""
        if self.mode == "int8":
            q, s = quantize_int8(weight, dtype)
            self.qweight, self.scales = _param(q), _param(s)
            self.kernel = DENSE
            if weight.device.type == "cpu":  # the same int8 tensor, read by our kernel or PyTorch's packed one
                reference = dequantize_int8(q[:64], s[:64])
                if dtype == torch.bfloat16 and cpu_kernels.int8_tiles_fit(*q.shape):
                    tiles, colsum = cpu_kernels.int8_tiles_pack(q)  # in place of the plain layout: no second copy
                    if self._packed_agrees(INT8_TILES, (tiles, colsum), reference):
                        self.qweight, self.kernel = _param(tiles), INT8_TILES
                        self.register_buffer("colsum", colsum, persistent=False)
                        return
                for kernel in ([INT8_GEMV] if cpu_kernels.available() else []) + ["_weight_int8pack_mm"]:
                    if self._packed_agrees(kernel, q, reference):
                        self.kernel = kernel
                        break
            return
        self.set_int4_(*quantize_int4(weight, dtype, self.group_size))

    @torch.no_grad()
    def set_int4_(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Fill an int4 layer from levels q (out, in) in [0, 15] and scales, zeros (out, in // group)
        in the compute dtype, however they were chosen (round-to-nearest, or GPTQ), and pick its kernel."""
        if self.mode != "int4" or tuple(q.shape) != (self.out_features, self.in_features) \
                or tuple(scales.shape) != (self.out_features, self.in_features // self.group_size):
            raise ValueError(f"int4 levels {tuple(q.shape)} / scales {tuple(scales.shape)} do not fit {self}")
        self.kernel_note = ""
        self.scales_and_zeros = _param(torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous())
        self.kernel = DENSE
        plain = q[:, 0::2] | (q[:, 1::2] << 4)  # two values per byte, the even input in the low nibble
        reference = dequantize_int4(q[:64], scales[:64], zeros[:64])  # what every kernel is checked against
        if q.device.type == "cpu" and self.in_features % 32 == 0 and self.group_size % 32 == 0 \
                and cpu_kernels.available() and self._packed_agrees(INT4_GEMV, plain, reference):
            self.qweight, self.kernel = _param(plain.contiguous()), INT4_GEMV
            return
        try:
            packed, kernel = self._pack_int4(q)
        except (RuntimeError, NotImplementedError) as exc:  # a kernel this build or device lacks
            packed, self.kernel_note = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        if packed is not None and self._packed_agrees(kernel, packed, reference):
            self.qweight, self.kernel = _param(packed), kernel
        else:
            self.qweight = _param(plain)

    def _pack_int4(self, q: torch.Tensor) -> tuple[torch.Tensor | None, str]:
        """q (out, in) uint8 levels -> (the packed kernel's layout, its name), or (None, why not)."""
        n, k = q.shape
        dev = q.device
        if dev.type == "cpu":
            if n % 16:
                self.kernel_note = f"_weight_int4pack_mm_for_cpu needs out_features % 16 == 0 (got {n})"
                return None, DENSE
            # the packing works on blocks of 64 rows: converted in chunks of whole blocks, it is the same
            rows = max(64, (QUANT_CHUNK // k) // 64 * 64) if n % 64 == 0 else n
            packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[a:a + rows].to(torch.int32), 1)
                                for a in range(0, n, rows)])
            return packed, "_weight_int4pack_mm_for_cpu"
        major, _ = torch.cuda.get_device_capability(dev)
        if self.dtype != torch.bfloat16 or major < 8 or n % 8 or k % 32:
            self.kernel_note = ("_weight_int4pack_mm (tinygemm) needs bf16 on sm80+, out % 8 == 0 and in % 32 == 0 "
                                f"(got {str(self.dtype).removeprefix('torch.')}, sm{major}x, {n} x {k})")
            return None, DENSE
        inner_k_tiles = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
        hi_lo = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8)  # tinygemm: even inputs in the high nibble
        return torch.ops.aten._convert_weight_to_int4pack(hi_lo.contiguous(), inner_k_tiles), "_weight_int4pack_mm"

    def _packed_agrees(self, kernel: str, packed, reference: torch.Tensor) -> bool:
        """Run the packed kernel on a few rows against the dequantized matmul of the first output
        channels (``reference``: their fp32 weights); False, with a note, on a mismatch or an error."""
        device = (packed[0] if isinstance(packed, tuple) else packed).device
        x = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(device, self.dtype)
        want = F.linear(x.float(), reference.float())
        try:
            got = self._packed_matmul(x, kernel, packed)[:, :reference.shape[0]].float()
        except (RuntimeError, NotImplementedError) as exc:
            self.kernel_note = f"{kernel} failed: {type(exc).__name__}: {str(exc)[:200]}"
            return False
        err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
        if err >= 3e-2:
            self.kernel_note = f"{kernel} disagreed with the dequantized matmul (relative error {err:.2g})"
        return err < 3e-2

    # ------------------------------------------------------------------ compute
    def _packed_matmul(self, x2: torch.Tensor, kernel: str | None = None, packed: torch.Tensor | None = None
                       ) -> torch.Tensor:
        kernel = kernel or self.kernel
        packed = self.qweight if packed is None else packed
        if kernel == INT8_TILES:
            tiles, colsum = packed if isinstance(packed, tuple) else (packed, self.colsum)
            return cpu_kernels.int8_tiles_linear(x2, tiles, colsum, self.scales)
        if kernel == INT8_GEMV:
            return cpu_kernels.int8_linear(x2, packed, self.scales)
        if kernel == INT4_GEMV:
            return cpu_kernels.int4_linear(x2, packed, self.scales_and_zeros, self.group_size)
        if kernel == "_weight_int8pack_mm":
            return torch.ops.aten._weight_int8pack_mm(x2, packed, self.scales)
        if kernel == "_weight_int4pack_mm_for_cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(x2, packed, self.group_size, self.scales_and_zeros)

    def int8_weight(self) -> torch.Tensor:
        """The int8 matrix (out, in), whatever layout the kernel keeps it in (AMX tiles: a copy)."""
        return self._int8_rows(0, self.out_features)

    def _int8_rows(self, a: int, b: int) -> torch.Tensor:
        """Output rows a..b-1 of the int8 matrix (from AMX tiles: a copy of the tiles that hold them)."""
        if self.qweight.dim() != 5:
            return self.qweight[a:b]
        first = a // 16
        return cpu_kernels.int8_tiles_unpack(self.qweight[first:-(-b // 16)])[a - 16 * first:b - 16 * first]

    def _dense_weight(self, a: int, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Output rows a..b-1 of the weight, dequantized to ``dtype`` (default: the compute dtype;
        plain layouts only). The arithmetic is fp32, rounded once at the end."""
        dtype = dtype or self.dtype
        if self.mode == "int8":
            return (self._int8_rows(a, b).float() * self.scales[a:b, None].float()).to(dtype)
        nib = self.qweight[a:b]
        q = torch.stack([nib & 15, nib >> 4], dim=-1).view(nib.shape[0], self.in_features)
        sz = self.scales_and_zeros[:, a:b].float()  # (groups, rows, 2)
        g = q.view(q.shape[0], -1, self.group_size).float()
        return ((g - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).view(q.shape).to(dtype)

    def _int4_rows(self, dtype: torch.dtype):
        """Output rows a..b-1 of an int4 weight in ``dtype`` (fp32 or bf16), dequantized by our C++
        kernel into this thread's reused buffer (the kernel is built: ``kernel`` is ``INT4_GEMV``).
        The tensor arithmetic of ``_dense_weight`` took a second per 35-token prefill of the 4-layer
        1.5B-shape checkpoint on a 2-core host with AMX, where llama.cpp took 38 ms."""
        return lambda a, b: cpu_kernels.int4_dequantize(self.qweight, self.scales_and_zeros, self.group_size, a, b,
                                                        scratch((b - a) * self.in_features, dtype))

    def _reduction_matvec(self, x2: torch.Tensor) -> torch.Tensor:
        """One row, written as multiply-and-sum over the inputs: compiled, inductor turns this (with
        the int -> float conversion) into one kernel that reads each integer weight once, instead
        of writing a float copy of the weight for a separate matmul."""
        if self.mode == "int8":
            return ((x2.float()[:, None, :] * self.int8_weight().float()[None]).sum(-1) * self.scales.float()).to(x2.dtype)
        w = self._dense_weight(0, self.out_features, torch.float32)
        return (x2.float()[:, None, :] * w[None]).sum(-1).to(x2.dtype)

    def _dense_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """Dequantize a block of output rows at a time, then the ordinary matmul."""
        if self.mode == "int8" and x2.shape[0] <= REDUCTION_MAX_ROWS and torch.compiler.is_compiling():
            return self._reduction_matvec(x2)  # a decode step inside the compiled step (CUDA, any batch)
        n = self.out_features
        q8 = self._int8_rows  # (a, b) -> rows of the plain (out, in) matrix
        if wants_fp32(x2):  # a CPU without bf16 instructions: fp32 blocks (cpu_matmul)
            if self.mode == "int8":
                return blockwise_fp32_linear(x2, n, q8, self.scales)
            return blockwise_fp32_linear(x2, n, self._int4_rows(torch.float32) if self.kernel == INT4_GEMV
                                         else lambda a, b: self._dense_weight(a, b, torch.float32))
        block = max(16, HALF_BLOCK_ELEMENTS // self.in_features)
        if self.kernel == INT4_GEMV and x2.dtype == torch.bfloat16 and x2.shape[0] <= INT4_AMX_MAX_ROWS \
                and not x2.requires_grad and cpu_kernels.int4_amx_fit(n, self.in_features, self.group_size):
            return cpu_kernels.int4_amx_linear(x2, self.qweight, self.scales_and_zeros, self.group_size)
        if self.kernel == INT4_GEMV:  # a CPU with bf16 instructions: the half GEMM on each block (AMX, AVX-512 BF16)
            rows_of = self._int4_rows(x2.dtype if x2.dtype == torch.bfloat16 else torch.float32)
            return torch.cat([F.linear(x2, rows_of(a, min(a + block, n)).to(x2.dtype)) for a in range(0, n, block)], -1)
        if self.kernel == INT8_TILES and x2.dtype == torch.bfloat16:  # blocks of whole tiles, straight to bf16
            block = max(16, block // 16 * 16)
            return torch.cat([F.linear(x2, cpu_kernels.int8_tiles_bf16_rows(
                self.qweight, a, min(a + block, n), scratch(block * self.in_features, torch.bfloat16)))
                for a in range(0, n, block)], -1) * self.scales
        if self.kernel == INT8_GEMV and x2.dtype == torch.bfloat16:
            if x2.shape[0] <= INT24_MAX_ROWS and not x2.requires_grad and cpu_kernels.int8_gemm_is_native():  # AMX
                return cpu_kernels.int24_linear(x2, self.qweight, self.scales)
            # the bf16 GEMM on each block, converted into a reused buffer
            return torch.cat([F.linear(x2, block_of(q8(a, min(a + block, n)), x2.dtype))
                              for a in range(0, n, block)], -1) * self.scales
        rows = max(1, DEQUANT_BLOCK // self.in_features)
        outs = []
        for a in range(0, n, rows):
            b = min(n, a + rows)
            if self.mode == "int8" and x2.dtype != torch.float16:
                # the scale after the matmul: (out,) multiplies, not (out, in); fp16 could overflow
                # on the unscaled sums, so there the weight is scaled first
                outs.append(F.linear(x2, q8(a, b).to(x2.dtype)) * self.scales[a:b])
            else:
                outs.append(F.linear(x2, self._dense_weight(a, b)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _kernel_rows(self, x2: torch.Tensor) -> int:
        """The most rows our CPU kernel takes outside a decode step: more where the alternative is fp32 blocks,
        or, for int4, bf16 blocks on a CPU whose int4 kernel is the AVX-512 VNNI one and that has no AMX."""
        if torch.compiler.is_compiling():  # a compiled step takes any row count (``takes``): probe nothing there
            return cpu_kernels.MAX_ROWS
        if wants_fp32(x2):
            return FP32_HOST_KERNEL_ROWS[self.kernel]
        if self.kernel == INT4_GEMV and x2.shape[0] > cpu_kernels.MAX_ROWS and x2.dtype == torch.bfloat16 \
                and cpu_kernels.int4_rows_beat_gemm(self.group_size):  # a decode's few rows need no probe
            return VNNI_INT4_KERNEL_ROWS
        return cpu_kernels.MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), in the compute dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        if self.kernel == DENSE or (self.kernel == "_weight_int8pack_mm" and x2.shape[0] > PACKED_MAX_ROWS) \
                or (self.kernel == INT8_TILES and x2.shape[0] > TILES_MAX_ROWS) \
                or (self.kernel in (INT8_GEMV, INT4_GEMV) and not cpu_kernels.takes(x2, max_rows=self._kernel_rows(x2))):
            y = self._dense_matmul(x2)
        else:
            y = self._packed_matmul(x2.contiguous())
        y = y.reshape(*lead, self.out_features)  # the kernel picks its output layout: no view
        return y + self.bias if self.bias is not None else y


def make_linear(in_features: int, out_features: int, bias: bool = False, quant: str | None = None) -> nn.Module:
    """``nn.Linear`` (``cpu_matmul.Linear``), or its quantized stand-in when ``quant`` is ``"int8"`` or ``"int4"``."""
    if quant is None:
        return Linear(in_features, out_features, bias=bias)
    return QuantLinear(in_features, out_features, bias=bias, mode=quant, group_size=group_size_for(in_features))


def quantized_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every layer the int8 and int4 rungs quantize: each block's q, k, v, o, gate, up
    and down projections, then the LM head."""
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    return [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)] * cfg.num_hidden_layers + [
        (cfg.vocab_size, h)]


def layer_bytes(n: int, k: int, mode: str | None, dtype: torch.dtype) -> int:
    """Bytes one (out ``n``, in ``k``) layer stores: its weight in ``dtype`` (``mode`` None), or the
    integers with their scales (int8) or scales and zeros (int4) in ``dtype``."""
    if mode is None:
        return n * k * dtype.itemsize
    if mode == "int8":
        return n * k + n * dtype.itemsize
    return n * k // 2 + 2 * n * (k // group_size_for(k)) * dtype.itemsize


def real_shape_bytes(cfg, mode: str, dtype: torch.dtype) -> int:
    """Bytes of a model of config ``cfg`` quantized with ``mode``: integer weights and their scales
    (and zeros) for every linear layer and the LM head, everything else (the embedding table,
    biases, norms) in ``dtype``."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    other = cfg.vocab_size * h + cfg.num_hidden_layers * (h + 2 * kv + 2 * h) + h  # embedding, biases, norms
    return sum(layer_bytes(n, k, mode, dtype) for n, k in linear_shapes(cfg)) + other * dtype.itemsize
