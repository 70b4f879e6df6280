"""engine_lib: a from-scratch inference engine for Qwen2.5-1.5B-Instruct, built in the book's chapters."""

from .engine import Engine, GenerationResult
from .errors import (
                     ConfigError,
                     ContextLengthError,
                     EngineError,
                     ModelNotFoundError,
                     NonFiniteLogitsError,
                     UnsupportedOptionError,
                     WeightLoadError,
)
from .model.checkpoints import ensure_checkpoint, write_checkpoint
from .model.config import Qwen2Config
from .sampling import SamplingParams
from .stages import STAGES

__all__ = ["Engine", "GenerationResult", "Qwen2Config", "SamplingParams", "STAGES", "ensure_checkpoint",
           "write_checkpoint", "EngineError", "ConfigError", "ContextLengthError", "ModelNotFoundError",
           "NonFiniteLogitsError", "UnsupportedOptionError", "WeightLoadError"]
__version__ = "0.1.0"
