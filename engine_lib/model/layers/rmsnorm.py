"""RMSNorm, and the fused residual-add + RMSNorm used from the ``fused`` stage on.

Defined in chapter 02 (from tokens to vectors); the fused form in chapter 07.
"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back.

    fp32 matters in half precision: the mean of squares of a few large activations
    overflows fp16 (max 65504) long before the normalised output would.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = kernel  # add_forward through our Triton kernel (chapter 14)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # output in the weights' dtype: an fp32 residual stream feeds fp16 matmuls
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(self.weight.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual) in one pass.

        Under torch.compile the add, the reduction and the scale become one kernel,
        so the residual stream is read once instead of three times. With ``kernel`` our own
        Triton kernel does the same, adding into ``residual`` in place.
        """
        if self.kernel:
            from ...kernels.add_rmsnorm import add_rmsnorm_

            return add_rmsnorm_(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self.forward(residual), residual
