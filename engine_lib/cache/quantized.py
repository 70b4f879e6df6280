"""The int8 KV cache's arithmetic: one scale per token and KV head, symmetric, no zero point.

Defined in chapter 05 (the KV cache), and priced for a server in chapter 12. A token's keys and values are
28 KiB at the 1.5B shape in fp16 (28 layers x 2 KV heads x 128 dims x K and V x 2 bytes): on a 16 GB T4, after
3.1 GB of weights, that sets how many tokens, and so how many users, the server holds. Stored as int8 they
take half: each (token, KV head) row of ``head_dim`` values keeps its largest magnitude as an fp32 scale,
``scale = amax / 127``, and the integers ``round(x / scale)`` in [-127, 127]. One token costs
2 x layers x kv_heads x (head_dim + 4) bytes, 0.52 of fp16's at head_dim 128.

Why per (token, head): a token's scale is fixed when it is written and never changes, so the cache never
re-quantizes; a head's 128 values share one range (keys of different heads differ by orders of magnitude, and
Qwen's keys have a few large channels, which a per-tensor scale would let swamp the rest). llama.cpp's q8_0 cache
keeps a scale per 32 values; the finer group costs 4 more bytes a 32 values and, measured on the book's trained
checkpoint, was not needed here (chapter 05's table). Rounding is half away from zero (``floor(|x|/s + 0.5)``),
the same in torch and in the Triton kernel that writes the cache (``kernels/rope_kv_write.py``).
"""

from __future__ import annotations

import torch

INT8 = "int8"
KV_CACHE_DTYPES = ("auto", INT8)  # "auto": the model's own dtype
QMAX = 127.0
SCALE_BYTES = 4  # fp32: a bf16 scale would add its own rounding (8 bits) to every value of the row


def check_kv_cache_dtype(kv_cache_dtype: str | None) -> str | None:
    """None (the model's dtype) or ``"int8"``; anything else is a clear error."""
    from ..errors import UnsupportedOptionError

    if kv_cache_dtype in (None, "auto"):
        return None
    if kv_cache_dtype != "int8":
        raise UnsupportedOptionError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPES)}")
    return "int8"


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) in any float dtype -> (int8 (..., head_dim), fp32 scale (...)): ``x ~ q * scale``.
    An all-zero row gets scale 0 and zeros."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # (...)
    scale = amax / QMAX
    # a true division (``QMAX / amax`` would be amax.reciprocal() * QMAX in torch, rounded twice), as the kernels
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    mag = torch.floor(xf.abs() * inv[..., None] + 0.5).clamp_(max=QMAX)  # half away from zero, as the kernel
    return (torch.sign(xf) * mag).to(torch.int8), scale


def kernels_take(device: torch.device | str) -> bool:
    """Whether our CPU kernels serve a cache on ``device`` (an int8 cache: they write it and attend over it; a bf16
    one: they attend over it, ``cpu/kv_attention.py``): asked once, when the cache is made (the answer builds the
    kernels the first time; a compiled step must not ask)."""
    if torch.device(device).type != "cpu":
        return False
    from ..cpu import kernels

    return kernels.available()


def write_quantize(x: torch.Tensor, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` as an int8 cache's write runs it: with ``kernel`` (``kernels_take``), one call of our CPU kernel
    (fp32 or bf16, the same integers and scales bit for bit), where torch takes a dozen small ops; else in torch."""
    if kernel and x.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.engine_lib_cpu.quantize_kv(x)
    return quantize(x)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (..., head_dim) and fp32 scale (...) -> ``dtype`` (..., head_dim): the values attention reads."""
    return (q.float() * scale[..., None]).to(dtype)


def bytes_per_token(cfg, dtype: torch.dtype, kv_cache_dtype: str | None) -> int:
    """One token's cache over every layer, K and V, scales included."""
    layers, heads, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    if kv_cache_dtype == "int8":
        return 2 * layers * heads * (d + SCALE_BYTES)
    return 2 * layers * heads * d * torch.tensor([], dtype=dtype).element_size()
