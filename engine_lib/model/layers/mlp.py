"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)).

Defined in chapter 04 (the whole model); the packed gate/up projection in chapter 07.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ...quant.linear import make_linear


class MLP(nn.Module):
    """``packed=True`` holds gate and up as one (2 * intermediate, hidden) projection,
    ``gate_up_proj``, which the loader fills from the checkpoint's two tensors. ``quant``
    (``"int8"``/``"int4"``, chapter 10) makes every projection a ``QuantLinear``.
    ``fp32_out=True`` (fp16 models, whose residual stream is fp32) runs the product and the
    down projection's scale in fp32 and returns fp32 (``fp16_safe_down``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, packed: bool = False, quant: str | None = None,
                 fp32_out: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.fp32_out = fp32_out
        self.packed = packed
        if packed:
            self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, quant=quant)
        else:
            self.gate_proj = make_linear(hidden_size, intermediate_size, quant=quant)
            self.up_proj = make_linear(hidden_size, intermediate_size, quant=quant)
        self.down_proj = make_linear(intermediate_size, hidden_size, quant=quant)

    def packed_sources(self) -> dict[str, list[tuple[str, int]]]:
        """Packed parameter -> the checkpoint tensors it concatenates (suffix, rows)."""
        n = self.intermediate_size
        return {"gate_up_proj.weight": [("gate_proj.weight", n), ("up_proj.weight", n)]} if self.packed else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each (batch, seq, intermediate)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fp32_out:
            return fp16_safe_down(self.down_proj, gate, up)
        return self.down_proj(F.silu(gate) * up)


def fp16_safe_down(down_proj: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) for half-precision activations, returned in fp32.

    The product of two large activations passes fp16's 65504 on real Qwen2.5 inputs, and so
    can the down projection's sums. The product is taken in fp32 and divided, per token, by
    a power of two that brings its largest entry to at most 1 (exact: only the exponent
    changes); the fp16 matmul (fp32 accumulation) then sums values of at most 1 times the
    weights, and the scale is put back in fp32, where the residual stream lives.
    """
    prod = F.silu(gate.float()) * up.float()  # (batch, seq, intermediate), fp32
    scale = torch.exp2(torch.ceil(torch.log2(prod.abs().amax(-1, keepdim=True).clamp(min=1.0))))
    return down_proj((prod / scale).to(gate.dtype)).float() * scale  # (batch, seq, hidden), fp32
