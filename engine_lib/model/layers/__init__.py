"""The building blocks of a Qwen2 decoder layer, one file each."""

from .attention import Attention
from .mlp import MLP
from .rmsnorm import RMSNorm
from .rope import RotaryEmbedding

__all__ = ["Attention", "MLP", "RMSNorm", "RotaryEmbedding"]
