"""Typed Qwen2 model config, read from a Hugging Face ``config.json`` and validated once.

Defined in chapter 02 (from tokens to vectors).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class Qwen2Config:
    """The hyper-parameters of a Qwen2 decoder; field names follow ``config.json``."""

    vocab_size: int = 151936
    hidden_size: int = 1536
    intermediate_size: int = 8960
    num_hidden_layers: int = 28
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"invalid Qwen2 config: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                bad(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            bad(f"num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads} (grouped-query attention)")
        if self.head_dim % 2:
            bad(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act != "silu":
            bad(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.use_sliding_window:
            bad("use_sliding_window=true is not supported: this engine implements full attention")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            bad("rms_norm_eps and rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_groups(self) -> int:
        """How many query heads share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Parameter count of the checkpoint (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        kv = self.num_key_value_heads * d
        attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k, v (+bias), o
        mlp = 3 * h * i
        layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_hidden_layers * layer + h + head

    @classmethod
    def from_dict(cls, raw: dict) -> Qwen2Config:
        model_type = raw.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ConfigError(f"model_type={model_type!r} is not supported (expected 'qwen2')")
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling not in (None, {}) and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise ConfigError(f"rope_scaling={rope_scaling!r} is not supported")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in raw.items() if k in known}
        eos = kwargs.get("eos_token_id")
        if isinstance(eos, list):
            kwargs["eos_token_id"] = eos[0] if eos else None
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen2Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict:
        """A ``config.json`` that ``transformers.Qwen2ForCausalLM`` reads."""
        out = asdict(self)
        out.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], attention_dropout=0.0,
                   initializer_range=0.02, sliding_window=self.max_position_embeddings,
                   max_window_layers=self.num_hidden_layers, use_cache=True)
        return out


def usable_context(cfg: Qwen2Config, max_model_len: int | None) -> int:
    """The one name for the context length, ``max_model_len`` (vLLM's): the positions prompt + new tokens may
    fill. A fixed ``max_model_len`` where one is given, never past the model's ``max_position_embeddings``."""
    return min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
