"""Weight-only quantization's formats: how a weight is stored as int8 or int4, and back.

Defined in chapter 10 (fewer bytes). At batch 1 a decode step reads every weight once, so its
time is set by the bytes of the weights. A quantized layer (``linear.QuantLinear``) keeps them as
small integers and a few floats that say how to turn them back into weights:

- ``int8``: one scale per output channel (symmetric absmax): ``w ~ q * scale``, q in [-127, 127];
- ``int4``: a scale and a zero point per group of ``GROUP_SIZE`` inputs (``group_size_for``) of each output channel:
  ``w ~ (q - 8) * scale + zero``, q in [0, 15] (the layout PyTorch's int4 kernels read).

Round-to-nearest (``quantize_int8``, ``quantize_int4``) picks each integer on its own; GPTQ (``gptq``)
picks them with calibration data, in the same format. Activations stay in half precision: where the
integers become floats again depends on the device and the rows (``linear``, ``cpu.routing``).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedOptionError

QUANT_MODES = ("int8", "int4")
GROUP_SIZE = 128  # int4: inputs per (scale, zero) pair
QUANT_CHUNK = 1 << 22  # weight elements quantized at once: bounds the fp32 temporaries while loading


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


def real_shape_bytes(cfg, mode: str, dtype: torch.dtype, table: bool = True) -> int:
    """Bytes of a model of config ``cfg`` quantized with ``mode``: integer weights and their scales
    (and zeros) for every linear layer and the LM head, everything else (the embedding table,
    biases, norms) in ``dtype``. ``table=False``: a tied embedding read from the head's integers
    (``embedding.QuantEmbedding``, on a CPU) holds no table of its own."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    other = cfg.vocab_size * h * table + cfg.num_hidden_layers * (h + 2 * kv + 2 * h) + h  # embedding, biases, norms
    return sum(layer_bytes(n, k, mode, dtype) for n, k in linear_shapes(cfg)) + other * dtype.itemsize
