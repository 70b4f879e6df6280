"""The Qwen2 decoder, written from scratch: embedding, N x (attention + MLP), final norm, LM head.

Defined in chapter 04 (the whole model). Module names mirror the checkpoint's tensor
names (``model.layers.3.self_attn.q_proj.weight``), so loading is a loop.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Qwen2Config
from .kv_cache import KVCache
from .layers import MLP, Attention, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, causal, kv=None):
        # pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, causal, kv)
        return h + self.mlp(self.post_attention_layernorm(h))

    def fused_forward(self, x, residual, cos, sin, mask, causal, kv=None):
        """Same maths with each residual add folded into the next RMSNorm (fused stage)."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.self_attn(normed, cos, sin, mask, causal, kv)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


class Qwen2Backbone(nn.Module):
    """Holds the ``model.*`` tensors of the checkpoint."""

    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """``forward(input_ids, positions) -> logits``; names match ``transformers``' class."""

    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen2Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.fused = False
        # fp16 tops out at 65504; Qwen's residual stream has outliers that can pass it,
        # so with fp16 weights the stream itself is kept in fp32 (set by the Engine)
        self.residual_dtype: torch.dtype | None = None

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def use_sdpa(self, enabled: bool = True) -> None:
        """Attention through PyTorch's fused SDPA kernel instead of the written-out softmax(qk^T)v."""
        for layer in self.model.layers:
            layer.self_attn.use_sdpa = enabled

    def enable_fusion(self) -> None:
        """Pack q/k/v and gate/up and take the fused residual + norm path."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self.fused = True

    def _mask(self, t: int, cache: KVCache | None) -> tuple[torch.Tensor | None, bool]:
        """Attention mask (batch or 1, 1, q_len, kv_len), True = may attend; or (None, causal)."""
        if cache is None:
            return None, t > 1
        read_len = cache.read_len
        if read_len is not None and not cache.padded:  # eager shapes, no padding: no mask needed
            if read_len == t:  # prefill from position 0: plain causal
                return None, t > 1
            if t == 1:  # one new token sees every cached one
                return None, False
        s = cache.max_len if read_len is None else read_len
        q_pos = cache.write_pos  # (q_len,)
        k_idx = torch.arange(s, device=q_pos.device)
        allowed = k_idx[None, :] <= q_pos[:, None]  # (q_len, kv_len) causal
        if cache.key_valid is not None:
            # padding keys are hidden; a query always sees itself, so padded rows stay finite
            allowed = (allowed & cache.key_valid[:, None, :s]) | (k_idx[None, :] == q_pos[:, None])
            return allowed.unsqueeze(1), False  # (batch, 1, q_len, kv_len)
        return allowed[None, None], False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """input_ids, positions: (batch, seq) -> logits (batch, seq or 1, vocab).

        Without a cache the whole sequence is recomputed (the naive rung). With one,
        ``cache.write_pos`` says where the new keys/values go.
        """
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)  # (batch, seq, hidden)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        cos, sin = self.rotary(positions, self.lm_head.weight.dtype)  # (batch, 1, seq, head_dim)
        mask, causal = self._mask(t, cache)
        residual = None
        for i, layer in enumerate(self.model.layers):
            kv = cache.layer(i) if cache is not None else None
            if self.fused:
                x, residual = layer.fused_forward(x, residual, cos, sin, mask, causal, kv)
            else:
                x = layer(x, cos, sin, mask, causal, kv)
        if self.fused:
            x = x + residual
        if last_only:
            x = x[:, -1:]  # the norm is per position: only the last one feeds the next token
        return self.lm_head(self.model.norm(x))
