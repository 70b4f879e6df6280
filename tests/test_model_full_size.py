"""At the exact 1.5B shape (random weights), one prompt's fp32 logits match transformers on CPU.

Slow (a 3 GB checkpoint, two 6 GB fp32 models one after the other) but it runs in CI.
"""

import gc

import pytest
import torch

from engine_lib import Engine
from engine_lib.bench.reference import load_hf_model
from engine_lib.model.checkpoints import ensure_checkpoint


@pytest.mark.slow
def test_full_shape_logits_match_transformers(prompts):
    path = ensure_checkpoint("qwen2.5-1.5b-random")
    ids = prompts[0]
    hf = load_hf_model(path, torch.float32)
    assert sum(p.numel() for p in hf.parameters()) == 1_543_714_304
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -8:].clone()
    del hf
    gc.collect()
    engine = Engine.from_pretrained(path, device="cpu", stage="naive")
    ours = engine.logits(ids)[-8:]
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
