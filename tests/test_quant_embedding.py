"""A tied embedding read from the quantized LM head (engine_lib/quant/embedding.py): each id's row is the head's
own dequantized row, and a packed layout that keeps no rows is refused."""

import pytest
import torch

from engine_lib.quant.embedding import QuantEmbedding
from engine_lib.quant.linear import QuantLinear

BF16 = torch.bfloat16


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_rows_are_the_heads_dequantized_rows(mode):
    head = QuantLinear(256, 96, mode=mode)
    head.quantize_(torch.randn(96, 256, generator=torch.Generator().manual_seed(0)).to(BF16), BF16)
    emb = QuantEmbedding(head)
    ids = torch.tensor([[3, 95, 0], [3, 17, 50]])  # (batch, seq)
    out = emb(ids)
    assert out.shape == (2, 3, 256) and out.dtype == BF16
    dense = head.dense_weight(0, 96)  # (vocab, hidden): every row, the head's own way
    torch.testing.assert_close(out, dense[ids], rtol=0, atol=0)
    assert "lm_head" in repr(emb) and not list(emb.parameters())  # the head's tensors are not listed twice


def test_a_layout_without_rows_is_refused(monkeypatch):
    head = QuantLinear(256, 96, mode="int4")
    head.quantize_(torch.randn(96, 256).to(BF16), BF16)
    monkeypatch.setattr(head, "kernel", "_weight_int4pack_mm_for_cpu")
    with pytest.raises(ValueError, match="keeps no rows"):
        QuantEmbedding(head)
