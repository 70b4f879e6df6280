"""fp16 is safe by construction (issue 14): activations past 65504 stay finite.

Real Qwen2.5 activations have outliers; in fp16 the MLP product ``silu(gate) * up`` and the
down projection's sums can pass fp16's largest value. A decoder layer here gets 1e5-sized
activations and must give finite fp16 output close to the same layer in fp32.
"""

from unittest import mock

import pytest
import torch

from engine_lib import Engine
from engine_lib.errors import overflow_advice
from engine_lib.model.layers.mlp import MLP
from engine_lib.model.qwen2 import DecoderLayer, ModelOptions, StepContext


def big_layer(cfg, dtype, fused):
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, ModelOptions(sdpa=True, fused=fused, residual_dtype=torch.float32))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():  # large norm weights: the MLP sees activations in the hundreds, their product 1e5
        layer.post_attention_layernorm.weight.fill_(300.0)
    return layer.to(dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_layer_fed_1e5_activations_stays_finite_and_close_to_fp32_in_fp16(engines, fused):
    cfg = engines("kv_cache").config
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    x[:, :, 3] = 1e5  # an outlier channel in the fp32 residual stream
    d = cfg.head_dim
    ctx = StepContext(torch.ones(1, 1, 5, d), torch.zeros(1, 1, 5, d), None, True, None, None)
    outs = {}
    for dtype in (torch.float32, torch.float16):
        layer = big_layer(cfg, dtype, fused)
        c = StepContext(ctx.cos.to(dtype), ctx.sin.to(dtype), None, True, None, None)
        with torch.no_grad():
            if fused:
                y, residual = layer.fused_forward(x, None, c)
                y = y + residual
            else:
                y = layer(x, c)
            mlp_in = layer.post_attention_layernorm(x)
            gate = layer.mlp.gate_up_proj(mlp_in).chunk(2, -1) if fused else (layer.mlp.gate_proj(mlp_in),
                                                                              layer.mlp.up_proj(mlp_in))
        outs[dtype] = y.float()
        if dtype == torch.float32:
            product = torch.nn.functional.silu(gate[0]) * gate[1]
            assert product.abs().max() > 65504, "the test must push the MLP product past fp16's range"
    half, full = outs[torch.float16], outs[torch.float32]
    assert torch.isfinite(half).all()
    err = ((half - full).abs().max() / full.abs().max()).item()
    assert err < 1e-2, err


def test_the_mlp_of_an_fp32_residual_stream_returns_fp32():
    mlp = MLP(16, 32, fp32_out=True).half()
    assert mlp(torch.randn(2, 3, 16).half()).dtype == torch.float32


def test_overflow_advice_names_fp32_without_native_bf16():
    assert "bfloat16" in overflow_advice(torch.device("cpu"))
    with mock.patch("torch.cuda.get_device_capability", return_value=(7, 5)):  # a T4
        assert "bfloat16" not in overflow_advice(torch.device("cuda")).split("(")[0]
        assert overflow_advice(torch.device("cuda")).startswith("try dtype=torch.float32")
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):  # an H200
        assert "bfloat16" in overflow_advice(torch.device("cuda"))


def test_fp16_engines_turn_reduced_precision_reductions_off(tiny_dir):
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_fp16_reduced_precision_reduction
    try:
        matmul.allow_fp16_reduced_precision_reduction = True
        Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float16, stage="half")
        assert matmul.allow_fp16_reduced_precision_reduction is False
    finally:
        matmul.allow_fp16_reduced_precision_reduction = before
