"""The from-scratch model gives transformers' logits on identical weights (fp32, tiny preset)."""

import torch

from engine_lib.model.tokenizer import load_tokenizer

MAX_ABS = 1e-4


def test_logits_match_for_seed_prompts(engines, hf_tiny, prompts):
    engine = engines("naive")
    for ids in prompts[:4]:
        ours = engine.logits(ids)
        ref = hf_tiny(torch.tensor([ids])).logits[0]
        assert ours.shape == (len(ids), 151936)
        assert (ours - ref).abs().max().item() < MAX_ABS


def test_logits_match_for_a_prompt_longer_than_512_tokens(engines, hf_tiny):
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    ids = load_tokenizer()(text)["input_ids"]
    assert len(ids) > 512
    ours = engines("naive").logits(ids)
    ref = hf_tiny(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < MAX_ABS


def test_fused_model_gives_the_same_logits(engines, hf_tiny, prompts):
    ids = prompts[2]
    ref = hf_tiny(torch.tensor([ids])).logits[0]
    assert (engines("fused").logits(ids) - ref).abs().max().item() < MAX_ABS


def test_weights_are_tied_and_names_match_the_checkpoint(engines, hf_tiny):
    model = engines("naive").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours = set(dict(model.named_parameters()))
    theirs = set(dict(hf_tiny.named_parameters()))
    assert ours == theirs
