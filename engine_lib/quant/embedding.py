"""A tied embedding read from the quantized LM head: one integer copy of the vocabulary matrix, not two.

Defined in chapter 10 (fewer bytes). Qwen2.5-1.5B ties its embedding to its LM head, and the matrix is a
sixth of the model: 151,936 x 1,536 values, 467 MB in bf16. A quantized head keeps its own integers; the
embedding then needs only the rows of the prompt's and the new tokens' ids, which the head's integers and
scales give exactly as the head itself sees them. On a CPU, where the process's memory is the budget,
the loader (``model.loader``) swaps the half-precision table for this lookup whenever the head's layout
lets rows be gathered (``QuantLinear.gathers_rows``), as llama.cpp reads its token embedding from the
same quantized matrix. A GPU keeps the half-precision table.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import QuantLinear


class QuantEmbedding(nn.Module):
    """``forward(ids) -> (..., hidden)``: each id's row of ``head``'s weight, dequantized to the compute dtype."""

    def __init__(self, head: QuantLinear):
        super().__init__()
        if not head.gathers_rows:
            raise ValueError(f"the LM head's layout ({head.kernel}) keeps no rows to gather")
        # not a submodule: the head is the model's ``lm_head``, and it must be listed (and loaded, saved) once
        self.__dict__["head"] = head

    @property
    def dtype(self) -> torch.dtype:
        return self.head.dtype

    @property
    def device(self) -> torch.device:
        return self.head.qweight.device

    def extra_repr(self) -> str:
        return f"rows of lm_head ({self.head.mode}, {self.head.out_features} x {self.head.in_features})"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.head.rows(ids.reshape(-1))  # (tokens, hidden)
        return rows.view(*ids.shape, self.head.in_features)
