"""Each layer against its transformers counterpart on the same random inputs."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2 import modeling_qwen2 as hf

from engine_lib.model.layers import RMSNorm, RotaryEmbedding
from engine_lib.model.layers.attention import explicit_attention, folded_sdpa, sdpa_attention
from engine_lib.model.layers.rope import apply_rope, apply_rope_


def test_rmsnorm_matches_transformers():
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, 1e-6), hf.Qwen2RMSNorm(64, eps=1e-6)
    w = torch.randn(64)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    x = torch.randn(2, 5, 64) * 30
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-5)
    y, res = ours.add_forward(x, x)
    torch.testing.assert_close(res, 2 * x)
    torch.testing.assert_close(y, ref(2 * x), rtol=0, atol=1e-5)


def test_rope_matches_transformers_rotate_half():
    torch.manual_seed(0)
    head_dim, theta = 32, 1e6
    rope = RotaryEmbedding(head_dim, 4096, theta)
    positions = torch.tensor([[0, 1, 2, 3000]])
    cos, sin = rope(positions, torch.float32)
    q, k = torch.randn(1, 4, 4, head_dim), torch.randn(1, 2, 4, head_dim)
    cfg = hf.Qwen2Config(hidden_size=128, num_attention_heads=4, rope_theta=theta, max_position_embeddings=4096)
    hf_cos, hf_sin = hf.Qwen2RotaryEmbedding(cfg)(q, positions)
    ref_q, ref_k = hf.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k, rtol=0, atol=1e-5)
    inplace = q.clone()
    apply_rope_(inplace, cos, sin)
    torch.testing.assert_close(inplace, ref_q, rtol=0, atol=1e-5)


def test_explicit_attention_equals_sdpa_with_gqa_and_masks():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.rand(2, 1, 5, 9) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(explicit_attention(q, k, v, mask, False), sdpa_attention(q, k, v, mask, False))
    kk, vv = k[:, :, :5], v[:, :, :5]
    torch.testing.assert_close(explicit_attention(q, kk, vv, None, True), sdpa_attention(q, kk, vv, None, True))


@pytest.mark.parametrize("t", [1, 4])  # a decode step and a 4-token verify step
def test_folded_gqa_equals_the_reference_with_a_mask(t):
    """12 query heads over 2 KV heads (the real model's grouping), a padded, slot-causal mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 12, t, 64), torch.randn(3, 2, 40, 64), torch.randn(3, 2, 40, 64)
    mask = torch.rand(3, 1, t, 40) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(folded_sdpa(q, k, v, mask), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(explicit_attention(q, k, v, mask, False), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(folded_sdpa(q, k, v, None), F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               rtol=0, atol=1e-5)


def test_long_causal_queries_repeat_kv_and_match():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 12, 300, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sdpa_attention(q, k, v, None, True), ref, rtol=0, atol=1e-5)


def test_no_attention_call_asks_for_enable_gqa(engines, prompts, monkeypatch):
    """On CUDA only the flash kernel takes enable_gqa, and it takes no mask: a call with it
    would fall back to the slow math kernel. The engine's calls never pass it."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False), kwargs.get("attn_mask") is not None))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)  # engine_lib/model/layers/sdpa.py calls it through F
    engine = engines("half")  # eager, so every call goes through the spy
    engine.generate(prompts[0], max_new_tokens=3, do_sample=False)
    engine.generate_batch([prompts[0], prompts[3]], max_new_tokens=3, do_sample=False)  # masked calls
    assert calls and not any(gqa for _, _, gqa, _ in calls)
    assert all(qh == kh for qh, kh, _, _ in calls)  # heads are equal in every call: folded or repeated
    assert any(masked for _, _, _, masked in calls)
