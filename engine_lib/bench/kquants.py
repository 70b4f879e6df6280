"""ggml's K-quant blocks Q4_K and Q6_K, encoded in numpy: what a Q4_K_M GGUF file is made of.

Exists because the ``gguf`` package (0.19) can decode these blocks (``gguf.quants.dequantize``) but
not encode them, and ``gguf_export`` writes llama.cpp's usual 4-bit file, Q4_K_M, from them. Written
from the block layouts of ggml (``block_q4_K``, ``block_q6_K``), checked against the package's decoder.

Both group 256 weights into a super-block with one fp16 scale ``d`` for its sub-blocks' own scales:

- Q4_K (144 bytes, 4.5 bits a weight): 8 sub-blocks of 32, each ``w = d * sc * q - dmin * m`` with
  q in 0..15 and 6-bit sc, m. Bytes: fp16 d, fp16 dmin, 12 bytes of sc and m (the first four of each
  in the low 6 bits of bytes 0-3 and 4-7; the last four split into a low nibble in bytes 8-11 and two
  high bits in the top of bytes 0-7), then 128 bytes of q, two sub-blocks per 32 bytes (low nibbles
  the even sub-block, high nibbles the odd one).
- Q6_K (210 bytes, 6.5625 bits): 16 sub-blocks of 16, each ``w = d * sc * (q - 32)`` with q in 0..63
  and int8 sc. Bytes: 128 of ql (each q's low 4 bits), 64 of qh (its high 2 bits), 16 of sc, fp16 d.
  In each half of the super-block (128 weights), ql byte l holds weights l and l + 64 (low, high
  nibble) and qh byte l holds weights l, l + 32, l + 64 and l + 96 (bits 0-1, 2-3, 4-5, 6-7).

The scales are the plain ones: a sub-block's min and max (Q4_K) or its largest magnitude (Q6_K), its
offset and scale rounded outward to multiples of ``dmin`` and ``d`` so that its range always fits: each
weight within half a step of its sub-block (a whole one in Q6_K for a weight as large as the extreme and
of the other sign, which would need the code +32). llama.cpp's search for better scales
(``make_qkx2_quants``, ``make_qx_quants``) is left out: the blocks are laid out as llama.cpp's, but their
error is likely somewhat larger than its quantize tool's on the same weights (not measured here).
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights in a super-block
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def _super_blocks(a: np.ndarray, sub: int) -> np.ndarray:
    """(rows, cols) -> float32 (super-blocks, sub-blocks, ``sub`` weights)."""
    if a.ndim != 2 or a.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} weights, not shape {a.shape}")
    return np.asarray(a, dtype=np.float32).reshape(-1, QK_K // sub, sub)


def _fp16_scale(top: np.ndarray, levels: int) -> np.ndarray:
    """The fp16 super-block scale d for sub-block scales up to ``top`` (>= 0): rounded up where fp16
    would round it down, so that ``levels * d >= top`` and no sub-block scale needs more than ``levels``."""
    d = (top / levels).astype(np.float16)
    short = d.astype(np.float32) * levels < top
    d[short] = np.nextafter(d[short], np.float16(np.inf))
    return d


def _inverse(step: np.ndarray) -> np.ndarray:
    """1 / step, 0 where step is 0 (a sub-block of zeros, or a constant one that its offset holds)."""
    safe = np.where(step == 0, 1, step)
    return np.where(step == 0, 0, 1 / safe).astype(np.float32)


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols // 256 * 144) uint8 Q4_K blocks, cols a multiple of 256."""
    x = _super_blocks(a, 32)  # (n, 8, 32)
    n = x.shape[0]
    lo = np.minimum(x.min(-1), 0)  # (n, 8): the offset -dmin * m is <= 0, so the range starts at 0 or below
    dmin = _fp16_scale(-lo.min(-1, keepdims=True), 63)
    m = np.minimum(np.ceil(-lo * _inverse(dmin.astype(np.float32))), 63)  # rounded up: the range starts <= lo
    offset = dmin.astype(np.float32) * m  # (n, 8): what the decoder subtracts
    step = (x.max(-1) + offset) / 15  # 16 levels from -offset span the sub-block
    d = _fp16_scale(step.max(-1, keepdims=True), 63)
    sc = np.minimum(np.ceil(step * _inverse(d.astype(np.float32))), 63)  # rounded up: the range still fits
    q = x + offset[..., None]
    q *= _inverse(d.astype(np.float32) * sc)[..., None]
    np.rint(q, out=q)
    q = np.clip(q, 0, 15, out=q).astype(np.uint8)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)

    out = np.empty((n, BLOCK_BYTES["Q4_K"]), np.uint8)
    out[:, 0:2] = d.view(np.uint8)
    out[:, 2:4] = dmin.view(np.uint8)
    out[:, 4:8] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    out[:, 8:12] = m[:, :4] | (m[:, 4:] >> 4) << 6
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4
    out[:, 16:] = (q[:, 0::2] | q[:, 1::2] << 4).reshape(n, 128)  # sub-blocks 2j, 2j+1 share 32 bytes
    return out.reshape(a.shape[0], -1)


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols // 256 * 210) uint8 Q6_K blocks, cols a multiple of 256."""
    x = _super_blocks(a, 16)  # (n, 16, 16)
    n = x.shape[0]
    hi, lo = x.max(-1), x.min(-1)
    extreme = np.where(hi >= -lo, hi, lo)  # the signed weight of largest magnitude: it becomes -32
    step = extreme / -32  # (n, 16), signed
    d = _fp16_scale(np.abs(step).max(-1, keepdims=True), 127)
    sc = np.sign(step) * np.minimum(np.ceil(np.abs(step) * _inverse(d.astype(np.float32))), 127)
    q = x * _inverse(d.astype(np.float32) * sc)[..., None]
    np.rint(q, out=q)
    np.clip(q, -32, 31, out=q)  # only a weight of the extreme's size and the other sign reaches +32
    q += 32
    q = q.astype(np.uint8).reshape(n, 2, QK_K // 2)  # two halves of 128 weights

    out = np.empty((n, BLOCK_BYTES["Q6_K"]), np.uint8)
    low, high = q & 0x0F, q >> 4
    out[:, :128] = (low[:, :, :64] | low[:, :, 64:] << 4).reshape(n, 128)
    h = high.reshape(n, 2, 4, 32)
    out[:, 128:192] = (h[:, :, 0] | h[:, :, 1] << 2 | h[:, :, 2] << 4 | h[:, :, 3] << 6).reshape(n, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.view(np.uint8)
    return out.reshape(a.shape[0], -1)


ENCODERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}  # GGML type name -> encoder
