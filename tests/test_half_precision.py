"""fp16 stays finite where a plain fp16 residual stream would overflow (max 65504)."""

import pytest
import torch

from engine_lib import Engine
from engine_lib.errors import NonFiniteLogitsError

BIG = 30_000.0  # fits fp16; four layers of it do not


def add_outliers(model):
    """Every layer writes BIG into residual dimension 5: v_proj bias -> attention output -> o_proj."""
    head_dim = model.config.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.v_proj.weight.data[0].zero_()  # kv head 0, dim 0 is constant = its bias
        attn.v_proj.bias.data[0] = BIG
        attn.o_proj.weight.data[5].zero_()
        attn.o_proj.weight.data[5, 0] = 1.0  # query head 0 reads kv head 0
        assert head_dim > 0


@pytest.fixture(scope="module")
def outlier_engines(tiny_dir):
    out = {}
    for dtype in (torch.float32, torch.float16):
        engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="half")
        add_outliers(engine.model)
        out[dtype] = engine
    return out


def test_residual_really_exceeds_fp16_range(outlier_engines, prompts):
    model = outlier_engines[torch.float32].model
    seen = []
    hook = model.model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0].abs().max().item()))
    outlier_engines[torch.float32].logits(prompts[0])
    hook.remove()
    assert seen[0] > torch.finfo(torch.float16).max


def test_fp16_engine_stays_finite_and_agrees_with_fp32(outlier_engines, prompts):
    for ids in prompts[:3]:
        half = outlier_engines[torch.float16].logits(ids)[-1]
        full = outlier_engines[torch.float32].logits(ids)[-1]
        assert torch.isfinite(half).all()
        assert half.argmax() == full.argmax()
    out = outlier_engines[torch.float16].generate(prompts[0], max_new_tokens=8, do_sample=False)
    assert len(out.token_ids) > 0


def test_without_the_fp32_residual_fp16_overflows(outlier_engines, prompts):
    """The guard is what keeps it finite: switch it off and the engine reports the overflow."""
    engine = outlier_engines[torch.float16]
    engine.model.residual_dtype = None
    try:
        with pytest.raises(NonFiniteLogitsError, match="NaN or Inf"):
            engine.generate(prompts[0], max_new_tokens=4, do_sample=False)
    finally:
        engine.model.residual_dtype = torch.float32
