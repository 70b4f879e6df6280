"""The quantized linear layer: int8 or int4 weights (``formats``) in place of a half-precision matrix.

Defined in chapter 10 (fewer bytes). The loader quantizes each linear layer as it reads it from the
checkpoint (``QuantLinear.quantize_``), so the full-precision model never exists at once. Which matmul runs
is chosen then, by device, and every packed layout is checked on a few rows against the plain dequantized
matmul when it is made; one that disagrees or fails is dropped for the plain form:

- CPU: our kernels or PyTorch's packed ones, for the instruction set and the rows (``cpu.routing``);
- CUDA: inside the compiled decode step (up to ``REDUCTION_MAX_ROWS`` rows, any batch a decode
  step has), int8 is written as a multiply-and-sum in fp32, which inductor fuses with the
  conversion into one kernel that reads each int8 weight once: no float copy of a weight is
  ever made, in fp16 as in bf16. Elsewhere (a prefill, an eager step) int8 is
  ``F.linear(x, q.to(x.dtype)) * scale`` (gpt-fast's form) a block of output rows at a time, so a
  temporary is at most ``DEQUANT_BLOCK`` elements. int4 through ``_weight_int4pack_mm``
  (tinygemm: bf16 on sm80 and later);
- whatever a packed kernel does not take (shapes, dtypes, older GPUs): dequantize, then matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu import kernels as cpu_kernels
from ..cpu import routing
from ..cpu.kernels import INT4_AMX, INT4_GEMV, INT8_GEMV, INT8_TILES
from ..cpu.matmul import Linear
from ..errors import UnsupportedOptionError
from .formats import (
    GROUP_SIZE,
    QUANT_CHUNK,
    QUANT_MODES,
    dequantize_int4,
    dequantize_int8,
    group_size_for,
    quantize_int4,
    quantize_int8,
)

REDUCTION_MAX_ROWS = 64  # compiled int8 without a packed kernel: up to this many rows, the fused reduction
DEQUANT_BLOCK = 1 << 24  # weight elements dequantized at once on the plain path
PACKED_OPS = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm", INT8_GEMV, INT4_GEMV,
              INT8_TILES, INT4_AMX)
DENSE = "dequantize + linear"
INT24_GEMM = "int24 rows + _int_mm"  # an int8 prefill on a CPU with AMX (cpu.kernels.int24_linear), as reports name it


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
                for kernel in routing.int8_candidates(q, dtype):
                    if kernel == INT8_TILES:
                        tiles, colsum = cpu_kernels.int8_tiles_pack(q)  # in place of the plain layout: no second copy
                        if self._packed_agrees(INT8_TILES, (tiles, colsum), reference):
                            self.qweight, self.kernel = _param(tiles), INT8_TILES
                            self.register_buffer("colsum", colsum, persistent=False)
                            return
                    elif self._packed_agrees(kernel, q, reference):
                        self.kernel = kernel
                        break
            return
        self.set_int4_(*quantize_int4(weight, dtype, self.group_size))

    @torch.no_grad()
    def restore_(self, tensors: dict[str, torch.Tensor], kernel: str, note: str = "") -> None:
        """Fill this layer from tensors a saved model holds (``model.quantized_file``), already in ``kernel``'s
        layout: ``qweight``, ``scales`` (int8) or ``scales_and_zeros`` (int4), ``bias``, and ``colsum`` (int8 tiles)."""
        names = {"qweight", "scales" if self.mode == "int8" else "scales_and_zeros"} | ({"bias"} if self.bias is not None
                                                                                        else set())
        if not names <= set(tensors):
            raise ValueError(f"a saved {self.mode} layer needs {sorted(names)}, got {sorted(tensors)}")
        for name in names:
            setattr(self, name, _param(tensors[name]))
        if "colsum" in tensors:
            self.register_buffer("colsum", tensors["colsum"], persistent=False)
        self.kernel, self.kernel_note = kernel, note

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
        if q.device.type == "cpu" and routing.int4_takes_gemv(self.in_features, self.group_size) \
                and self._packed_agrees(INT4_GEMV, plain, reference):
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
        return self.int8_rows(0, self.out_features)

    def int8_rows(self, a: int, b: int) -> torch.Tensor:
        """Output rows a..b-1 of the int8 matrix (from AMX tiles: a copy of the tiles that hold them)."""
        if self.qweight.dim() != 5:
            return self.qweight[a:b]
        first = a // 16
        return cpu_kernels.int8_tiles_unpack(self.qweight[first:-(-b // 16)])[a - 16 * first:b - 16 * first]

    def dense_weight(self, a: int, b: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Output rows a..b-1 of the weight, dequantized to ``dtype`` (default: the compute dtype;
        plain layouts only). The arithmetic is fp32, rounded once at the end."""
        if self.mode == "int8":
            return (self.int8_rows(a, b).float() * self.scales[a:b, None].float()).to(dtype or self.dtype)
        return self._dequantized(slice(a, b), dtype)

    @property
    def gathers_rows(self) -> bool:
        """Whether any rows can be read straight from the stored integers (``rows``): the plain layouts,
        int8 (out, in) or int4 two to a byte, not a packed kernel's tiles."""
        if self.mode == "int8":
            return self.qweight.dim() == 2
        return self.kernel in (INT4_GEMV, DENSE) and tuple(self.qweight.shape) == (self.out_features,
                                                                                    self.in_features // 2)

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output rows ``index`` (a 1-D tensor of row numbers) dequantized: (len(index), in). A tied
        embedding reads its tokens' rows this way from the LM head (``embedding.QuantEmbedding``)."""
        if self.mode == "int8":
            return (self.qweight[index].float() * self.scales[index, None].float()).to(dtype or self.dtype)
        return self._dequantized(index, dtype)

    def _dequantized(self, index, dtype: torch.dtype | None) -> torch.Tensor:
        """int4, plain layout: rows ``index`` (a slice or row numbers) -> (rows, in) in ``dtype``."""
        nib = self.qweight[index]  # (rows, in / 2): the even input in the low nibble
        q = torch.stack([nib & 15, nib >> 4], dim=-1).view(nib.shape[0], self.in_features)
        sz = self.scales_and_zeros[:, index].float()  # (groups, rows, 2)
        g = q.view(q.shape[0], -1, self.group_size).float()
        w = (g - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
        return w.view(q.shape).to(dtype or self.dtype)

    def _reduction_matvec(self, x2: torch.Tensor) -> torch.Tensor:
        """One row, written as multiply-and-sum over the inputs: compiled, inductor turns this (with
        the int -> float conversion) into one kernel that reads each integer weight once, instead
        of writing a float copy of the weight for a separate matmul."""
        if self.mode == "int8":
            return ((x2.float()[:, None, :] * self.int8_weight().float()[None]).sum(-1) * self.scales.float()).to(x2.dtype)
        w = self.dense_weight(0, self.out_features, torch.float32)
        return (x2.float()[:, None, :] * w[None]).sum(-1).to(x2.dtype)

    def _dense_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """Dequantize a block of output rows at a time, then the ordinary matmul (on a CPU, the paths
        ``cpu.routing.prefill_matmul`` picks for the instruction set and the rows)."""
        if self.mode == "int8" and x2.shape[0] <= REDUCTION_MAX_ROWS and torch.compiler.is_compiling():
            return self._reduction_matvec(x2)  # a decode step inside the compiled step (CUDA, any batch)
        n = self.out_features
        if x2.device.type == "cpu":
            y = routing.prefill_matmul(self, x2)
            if y is not None:
                return y
        rows = max(1, DEQUANT_BLOCK // self.in_features)
        outs = []
        for a in range(0, n, rows):
            b = min(n, a + rows)
            if self.mode == "int8" and x2.dtype != torch.float16:
                # the scale after the matmul: (out,) multiplies, not (out, in); fp16 could overflow
                # on the unscaled sums, so there the weight is scaled first
                outs.append(F.linear(x2, self.int8_rows(a, b).to(x2.dtype)) * self.scales[a:b])
            else:
                outs.append(F.linear(x2, self.dense_weight(a, b)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), in the compute dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        if self.kernel == DENSE or not routing.takes_packed(self.kernel, x2, self.group_size):
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
