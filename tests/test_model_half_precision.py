"""Half precision: close to fp32 with a top-1 that agrees wherever rounding cannot flip it, and
fp16 stays finite where a plain fp16 residual stream would overflow (max 65504)."""

import pytest
import torch

from engine_lib import Engine
from engine_lib.bench.reference import margin_check
from engine_lib.errors import NonFiniteLogitsError
from engine_lib.model.loader import load_model
from engine_lib.model.qwen2 import ModelOptions

BIG = 30_000.0  # fits fp16; four layers of it do not


@pytest.mark.parametrize("stage", ["half", "fused"])
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_logits_close_and_top1_by_margin(engines, hf_tiny, prompts, stage, dtype, atol):
    engine = engines(stage, dtype)
    ours = [engine.logits(ids)[-1] for ids in prompts]
    refs = [hf_tiny(torch.tensor([ids])).logits[0, -1] for ids in prompts]
    check = margin_check(ours, refs)
    assert check.error < atol, check
    assert check.ok, check
    assert len(check.decided) >= 5, check  # the rule must decide most prompts, or it tests nothing


def test_margin_rule_catches_a_wrong_top1():
    ref = torch.tensor([5.0, 1.0, 0.0])
    assert margin_check([ref + 0.01], [ref]).ok
    close = torch.tensor([5.0, 4.0, 0.0])  # gap 1.0; a 0.6 error can flip it, and the rule catches that
    bad = margin_check([torch.tensor([4.4, 4.6, 0.0]), ref], [close, ref])
    assert bad.error == pytest.approx(0.6) and bad.decided == [0, 1] and bad.disagree == [0]


def add_outliers(model):
    """Every layer writes BIG into residual dimension 5: v_proj bias -> attention output -> o_proj."""
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.v_proj.weight.data[0].zero_()  # kv head 0, dim 0 is constant = its bias
        attn.v_proj.bias.data[0] = BIG
        attn.o_proj.weight.data[5].zero_()
        attn.o_proj.weight.data[5, 0] = 1.0  # query head 0 reads kv head 0


@pytest.fixture(scope="module")
def outlier_engines(tiny_dir):
    out = {}
    for dtype in (torch.float32, torch.float16):
        engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="half")
        add_outliers(engine.model)
        out[dtype] = engine
    return out


def test_fp16_engine_keeps_the_residual_stream_in_fp32(outlier_engines):
    assert outlier_engines[torch.float16].model.residual_dtype == torch.float32
    assert outlier_engines[torch.float32].model.residual_dtype is None


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


def test_without_the_fp32_residual_fp16_overflows(tiny_dir, prompts):
    """The guard is what keeps it finite: build the model without it and the engine reports the overflow."""
    model = load_model(tiny_dir, torch.float16, torch.device("cpu"), ModelOptions(sdpa=True, residual_dtype=None))
    add_outliers(model)
    engine = Engine(model, None, tiny_dir, "half", torch.device("cpu"))
    with pytest.raises(NonFiniteLogitsError, match="NaN or Inf"):
        engine.generate(prompts[0], max_new_tokens=4, do_sample=False)


def test_a_margin_check_that_decided_nothing_is_not_a_pass():
    ref = torch.tensor([5.0, 4.99, 0.0])  # a margin of 0.01, under a 0.5 error: nothing decidable
    check = margin_check([ref + torch.tensor([0.5, 0.0, 0.0])], [ref])
    assert check.decided == [] and check.ok and not check.passed
    assert "UNDECIDED" in str(check) and "all agree" not in str(check)
    assert margin_check([ref], [ref]).passed  # error 0: the margin decides
