"""The Qwen2 decoder, written from scratch: embedding, N x (attention + MLP), final norm, LM head.

Defined in chapter 04 (the whole model). Module names mirror the checkpoint's tensor
names (``model.layers.3.self_attn.q_proj.weight``), so loading is a loop. How the model
computes (attention kernel, packed projections, residual dtype) is fixed when it is
built, by ``ModelOptions``; everything a forward needs about the request (positions,
cache slots, what to attend to) comes in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache.contiguous import KVLayer, visible_slots
from ..errors import UnsupportedOptionError
from ..quant.embedding import QuantEmbedding
from ..quant.formats import check_mode
from ..quant.linear import QuantLinear, make_linear
from .config import Qwen2Config
from .layers import MLP, Attention, RMSNorm, RotaryEmbedding
from .layers.attention import KERNEL_MAX_QUERY


@dataclass(frozen=True)
class ModelOptions:
    """How the model computes; chosen once, from the rung of the ladder (``stages.py``)."""

    sdpa: bool = False  # attention through scaled_dot_product_attention, not written out
    fused: bool = False  # packed q/k/v and gate/up, in-place RoPE, residual add folded into RMSNorm
    # fp16 tops out at 65504; Qwen's residual stream has outliers that can pass it,
    # so with fp16 weights the stream itself is kept in fp32
    residual_dtype: torch.dtype | None = None
    # weight-only quantization of every linear layer and the LM head (chapter 10): "int8", "int4" or None
    quant: str | None = None
    # our Triton kernels (chapter 14) for add+RMSNorm and, over a cache, decode and verify attention
    kernels: bool = False

    def __post_init__(self) -> None:
        if self.residual_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise UnsupportedOptionError(f"residual_dtype {self.residual_dtype} is not supported")
        check_mode(self.quant)
        if self.kernels and not (self.fused and self.sdpa):
            raise UnsupportedOptionError("the Triton kernels build on the fused rung: kernels=True needs fused "
                                         "and sdpa")


@dataclass
class StepContext:
    """What every layer needs about this forward, built once per forward."""

    cos: torch.Tensor  # (batch, 1, seq, head_dim)
    sin: torch.Tensor
    mask: torch.Tensor | None  # (batch, 1, seq, kv_len), True = may attend; None: see ``causal``
    causal: bool  # no mask: plain causal attention (True) or every key visible (False)
    cache_pos: torch.Tensor | None  # (batch, seq) cache slots the new keys/values go to
    kv_len: int | None  # cache slots read; None = the whole buffer (fixed shape)
    rows: torch.Tensor | None = None  # (batch, 1) arange: which buffer row each batch row writes
    # what the Triton kernels read instead of cos/sin and the mask (chapter 14)
    positions: torch.Tensor | None = None  # (batch, seq) RoPE positions
    key_valid: torch.Tensor | None = None  # (batch, max_len), False for padding slots; None: no padding
    rotary: RotaryEmbedding | None = None  # its fp32 cos/sin tables
    # a left-padded batch whose position-wise work (norms, projections, MLP) skips the padding: the layers
    # carry only the real tokens, (1, n, hidden), and attention lays them out as (batch, seq) (``unpack``)
    tokens: torch.Tensor | None = None  # (n,) flat indices of the real tokens in (batch, seq); None: all real
    shape: tuple[int, int] = (0, 0)  # (batch, seq) of the padded layout

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d) -> (1, n, d): the real tokens only (as is without ``tokens``)."""
        return y if self.tokens is None else y.flatten(0, 1).index_select(0, self.tokens)[None]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """(1, n, d) -> (batch, seq, d), zeros at the padding (which writes only to the scratch block)."""
        if self.tokens is None:
            return y
        b, t = self.shape
        return y.new_zeros(b * t, y.shape[-1]).index_copy_(0, self.tokens, y[0]).view(b, t, -1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config, options: ModelOptions):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernel=options.kernels)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   packed=options.fused, sdpa=options.sdpa, quant=options.quant,
                                   kernels=options.kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernel=options.kernels)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, packed=options.fused, quant=options.quant,
                       fp32_out=options.residual_dtype == torch.float32)

    def forward(self, x, ctx: StepContext, kv=None):
        # pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))
        h = x + self.self_attn(self.input_layernorm(x), ctx, kv)
        return h + self.mlp(self.post_attention_layernorm(h))

    def fused_forward(self, x, residual, ctx: StepContext, kv=None):
        """Same maths with each residual add folded into the next RMSNorm (fused stage)."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.self_attn(normed, ctx, kv)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


class Qwen2Backbone(nn.Module):
    """Holds the ``model.*`` tensors of the checkpoint."""

    def __init__(self, cfg: Qwen2Config, options: ModelOptions):
        super().__init__()
        # no initializer: the loader fills the table, and a normal_ on the meta device imports torch._dynamo
        # (most of a second of every start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, options) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """``forward(input_ids, positions, kv, cache_pos, ...) -> logits``; names match ``transformers``' class."""

    def __init__(self, cfg: Qwen2Config, options: ModelOptions | None = None):
        super().__init__()
        self.config = cfg
        self.options = options or ModelOptions()
        self.model = Qwen2Backbone(cfg, self.options)
        # quantized, the LM head has its own integer copy of the (tied) embedding matrix; on a CPU the
        # embedding then reads its rows from it (``embed_from_head``), elsewhere it stays in half precision
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=False, quant=self.options.quant)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    @property
    def fused(self) -> bool:
        return self.options.fused

    @property
    def residual_dtype(self) -> torch.dtype | None:
        return self.options.residual_dtype

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations, KV cache): the embedding's (a quantized one's: its scales')."""
        emb = self.model.embed_tokens
        return emb.dtype if isinstance(emb, QuantEmbedding) else emb.weight.dtype

    @property
    def device(self) -> torch.device:
        emb = self.model.embed_tokens
        return emb.device if isinstance(emb, QuantEmbedding) else emb.weight.device

    @property
    def quantized_head(self) -> bool:
        return isinstance(self.lm_head, QuantLinear)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head; a quantized head keeps its own integer copy
        (the loader quantizes it from the same checkpoint tensor)."""
        if not self.quantized_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_from_head(self) -> bool:
        """Tied, with a quantized head whose rows can be gathered: let the embedding read its rows from the
        head's integers (``QuantEmbedding``) and drop the half-precision table. -> whether it did."""
        if not (self.config.tie_word_embeddings and self.quantized_head and self.lm_head.gathers_rows):
            return False
        self.model.embed_tokens = QuantEmbedding(self.lm_head)
        return True

    def packed_sources(self) -> dict[str, list[tuple[str, int]]]:
        """Every packed parameter -> the checkpoint tensors the loader concatenates into it."""
        out = {}
        for name, module in self.named_modules():
            if isinstance(module, (Attention, MLP)):
                for param, parts in module.packed_sources().items():
                    out[f"{name}.{param}"] = [(f"{name}.{src}", rows) for src, rows in parts]
        return out

    def step_context(self, input_ids: torch.Tensor, positions: torch.Tensor, cache_pos: torch.Tensor | None,
                     key_valid: torch.Tensor | None, kv_len: int | None, read_span: int | None) -> StepContext:
        """RoPE angles and the cheapest exact mask for this forward."""
        t = input_ids.shape[1]
        cos, sin = self.rotary(positions, self.dtype)  # (batch, 1, seq, head_dim)
        if cache_pos is None:  # no cache: the sequence attends to itself, causally
            return StepContext(cos, sin, None, t > 1, None, None)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None]
        kernel_facts = dict(positions=positions, key_valid=key_valid, rotary=self.rotary)
        if kv_len is not None and key_valid is None and t in (1, kv_len):
            # the new tokens are the last kv_len slots: one token sees all of them, a prompt
            # from slot 0 is plain causal; neither needs a mask tensor
            return StepContext(cos, sin, None, t > 1, cache_pos, kv_len, rows, **kernel_facts)
        if self.options.kernels and t <= KERNEL_MAX_QUERY:
            mask = None  # the Triton attention reads cache_pos and key_valid instead (same rule)
        else:
            mask = visible_slots(cache_pos, key_valid, read_span if kv_len is None else kv_len)
        return StepContext(cos, sin, mask, False, cache_pos, kv_len, rows, **kernel_facts)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv: list[KVLayer] | None = None, cache_pos: torch.Tensor | None = None,
                key_valid: torch.Tensor | None = None, kv_len: int | None = None,
                last_only: bool = False, logits_from: int = 0, real_tokens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """input_ids, positions: (batch, seq) -> logits (batch, seq or 1, vocab).

        Without ``kv`` the whole sequence is recomputed (the naive rung). With it (one
        cache layer per model layer, ``KVCache.layers()``; the paged cache's layers answer the same
        ``write_read``):

        - ``cache_pos`` (batch, seq): the slots the new keys/values are written to;
        - ``kv_len``: attention reads slots [0, kv_len), and the new tokens are the last
          slots of that span; None reads the whole buffer and masks by slot (fixed shape);
        - ``key_valid`` (batch, max_len): False for slots that hold left padding.

        Several new tokens over a filled cache (a speculative "verify" step) are just a
        ``cache_pos`` of several slots. ``logits_from``: logits only for positions from there on
        (perplexity scores only a window's last tokens; the LM head is most of a small model's work).
        ``real_tokens`` (n,) (with ``last_only``, rows left-padded): the flat indices of the real tokens in
        (batch, seq), sorted; every layer's position-wise work skips the rest (a batch of ragged rows, the
        server's prefill chunks with one-token decode rows beside them, costs its real tokens, not batch x seq).
        """
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        read_span = kv[0].read_span if kv is not None and kv_len is None else None  # the fixed-shape step's
        ctx = self.step_context(input_ids, positions, cache_pos if kv is not None else None, key_valid, kv_len, read_span)
        if real_tokens is not None:
            if not last_only:
                raise ValueError("real_tokens needs last_only (the logits of each row's last token)")
            ctx.tokens, ctx.shape = real_tokens, (b, t)
        x = ctx.pack(self.model.embed_tokens(input_ids))  # (batch, seq, hidden), or (1, n, hidden) packed
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            layer_kv = kv[i] if kv is not None else None
            if self.fused:
                x, residual = layer.fused_forward(x, residual, ctx, layer_kv)
            else:
                x = layer(x, ctx, layer_kv)
        if self.fused:
            x = x + residual
        if last_only and ctx.tokens is not None:  # each row's last token, found in the packed order
            last = torch.arange(1, b + 1, device=x.device) * t - 1
            x = x[0, torch.searchsorted(ctx.tokens, last)][:, None]  # (batch, 1, hidden)
        elif last_only:
            x = x[:, -1:]  # the norm is per position: only the last one feeds the next token
        elif logits_from:
            x = x[:, logits_from:]
        return self.lm_head(self.model.norm(x))
