"""Every chapter: the errors the engine raises on bad input, each with a message that names the culprit.

The loader's appear in chapter 02.
"""


class EngineError(Exception):
    """Base class: every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A config.json that is inconsistent or asks for something unsupported."""


class WeightLoadError(EngineError):
    """A missing, corrupt, unexpected or misshapen weight file or tensor."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """Neither a local checkpoint nor a reachable (or cached) hub repo."""


class ContextLengthError(EngineError, ValueError):
    """The prompt plus the requested tokens do not fit the KV cache or the model."""


class NonFiniteLogitsError(EngineError, FloatingPointError):
    """NaN or Inf appeared in the logits; ``where`` says when. The engine raises it, the server
    reports its text: the advice is written once, here."""

    def __init__(self, where: str, device=None):
        super().__init__(f"NaN or Inf in the logits {where}; in float16 this usually means an activation "
                         f"overflowed: {overflow_advice(device)}")


class UnsupportedOptionError(EngineError, ValueError):
    """An unknown dtype, device, stage or generation option."""


class OptionValueError(UnsupportedOptionError):
    """A known option given a value it cannot take (NaN, infinite, out of range, of the wrong type).
    ``option`` and ``value`` name the culprit for a caller that maps it (the server: a 400)."""

    def __init__(self, option: str, value, rule: str):
        self.option, self.value = option, value
        super().__init__(f"{option} must be {rule}, got {value!r}")


def overflow_advice(device) -> str:
    """What to try after NaN/Inf in half precision: bf16 only where the GPU has it natively
    (sm_80 on; a T4 only emulates it, slowly), else fp32."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "try dtype=torch.float32 (this GPU has no native bfloat16)"
    return "try dtype=torch.bfloat16 or torch.float32"
