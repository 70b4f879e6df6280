"""The T4 budget ledger: real-shape prices for what a chapter holds, released when Python frees it."""

import gc

import pytest
import torch

from engine_lib import Engine
from engine_lib.bench.reference import load_hf_model
from engine_lib.book import memory_budget

FP32_REAL_GIB = 1_543_714_304 * 4 / 2**30  # 5.75 GiB


def test_two_fp32_models_at_once_do_not_fit_a_t4(budget, tiny_dir):
    hf = load_hf_model(tiny_dir, torch.float32)
    engine = Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache")
    assert budget.current / 2**30 == pytest.approx(2 * FP32_REAL_GIB + 0.5, abs=0.01)
    with pytest.raises(AssertionError, match="would not fit a T4"):
        budget.check()
    report = " ".join(budget.report().split())  # as read, whatever the line wrapping
    assert "DOES NOT FIT" in report and "transformers weights (float32)" in report
    del hf, engine


def test_freeing_the_reference_first_fits(budget, tiny_dir, prompts):
    hf = load_hf_model(tiny_dir, torch.float32)
    del hf
    gc.collect()
    engine = Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache")
    engine.generate(prompts[0], max_new_tokens=4, do_sample=False)  # allocates a KV cache
    assert any("kv_cache" in label for label in budget.at_peak)
    budget.check()  # one fp32 model + a 256-slot cache + activations
    assert budget.peak / 2**30 < FP32_REAL_GIB + 0.6
    half = Engine.from_pretrained(tiny_dir, device="cpu", stage="half")  # + bf16 weights: 8.6 GiB, still fits
    budget.check()
    del half, engine


def test_no_budget_no_bookkeeping(tiny_dir):
    memory_budget.ACTIVE = None
    Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache")  # nothing to record, nothing fails
