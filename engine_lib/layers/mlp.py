"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)).

Defined in chapter 04 (the whole model); the packed gate/up projection in chapter 07.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def pack(self) -> None:
        """Fuse gate and up into one (2 * intermediate, hidden) projection."""
        gate, up = self.gate_proj, self.up_proj
        fused = nn.Linear(gate.in_features, 2 * gate.out_features, bias=False,
                          device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([gate.weight, up.weight]))
        fused.requires_grad_(False)
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each (batch, seq, intermediate)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)
