"""Each layer against its transformers counterpart on the same random inputs."""

import torch
from transformers.models.qwen2 import modeling_qwen2 as hf

from engine_lib.layers import RMSNorm, RotaryEmbedding
from engine_lib.layers.attention import explicit_attention, sdpa_attention
from engine_lib.layers.rope import apply_rope, apply_rope_


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
