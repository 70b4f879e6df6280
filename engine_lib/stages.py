"""The optimisation ladder: each rung is a named configuration of the same Engine.

Defined in chapter 00; each rung has its own chapter (04 naive, 05 kv_cache, 06 half, 07 fused,
10 int8 and int4, 14 triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedOptionError
from .model.qwen2 import ModelOptions


@dataclass(frozen=True)
class Stage:
    """One rung: everything it decides, read once when the engine is built."""

    name: str
    use_cache: bool  # preallocated KV cache, separate prefill and decode steps
    half: bool  # default dtype: fp16/bf16 instead of fp32
    sdpa: bool  # attention through scaled_dot_product_attention instead of the written-out form
    fused: bool  # packed projections, fused add+norm, in-place RoPE, compiled decode step (+ CUDA graph)
    summary: str
    quant: str | None = None  # weight-only quantization of the linear layers and LM head: "int8", "int4"
    kernels: bool = False  # our Triton kernels in the decode step (chapter 14); needs a GPU or the interpreter

    @property
    def compiles_step(self) -> bool:
        """Whether the decode step goes through ``torch.compile``: fused and cached, except with our
        Triton kernels, which run eagerly (inductor would treat them as opaque anyway)."""
        return self.use_cache and self.fused and not self.kernels

    def model_options(self, dtype: torch.dtype) -> ModelOptions:
        # fp16's range ends at 65504: keep the residual stream in fp32 (bf16 has fp32's range)
        return ModelOptions(sdpa=self.sdpa, fused=self.fused,
                            residual_dtype=torch.float32 if dtype == torch.float16 else None, quant=self.quant,
                            kernels=self.kernels)


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("naive", False, False, False, False, "fp32, no cache: the whole sequence is recomputed for every token"),
    Stage("kv_cache", True, False, True, False, "fp32, preallocated KV cache: prefill once, then one token per step;"
                                                " attention through one SDPA kernel"),
    Stage("half", True, True, True, False, "the KV cache in half precision (bf16 where native, else fp16)"),
    Stage("fused", True, True, True, True, "packed q/k/v and gate/up, fused add+RMSNorm, in-place RoPE, compiled"
                                           " decode step, captured as a CUDA graph on GPU"),
    Stage("int8", True, True, True, True, "fused, with int8 weights (one scale per output channel) in every linear"
                                          " layer and the LM head; a packed kernel converts them as it multiplies"
                                          " where one fits, else a block of rows is dequantized first", quant="int8"),
    Stage("int4", True, True, True, True, "fused, with int4 weights (a scale and zero per group of 128 inputs) in"
                                          " every linear layer and the LM head; converted like int8", quant="int4"),
    Stage("triton", True, True, True, True, "fused, with our own Triton kernels in the decode step: add+RMSNorm,"
                                            " RoPE fused with the cache write, split-KV attention", kernels=True),
)}


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise UnsupportedOptionError(f"unknown stage {name!r}; choose one of {list(STAGES)}")
    return STAGES[name]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedOptionError(f"unknown device {device!r} (use 'cpu', 'cuda' or 'cuda:N')") from exc
    if dev.type not in ("cpu", "cuda"):
        raise UnsupportedOptionError(f"device {device!r} is not supported (use 'cpu' or 'cuda')")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedOptionError("device 'cuda' was asked for but no CUDA GPU is available")
    return dev


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU): every timer reads the clock after this."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def half_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware has it natively, fp16 otherwise.

    On CUDA, check the compute capability (Ampere, 8.0, and later): on a T4 (7.5)
    ``torch.cuda.is_bf16_supported()`` can say True through slow emulation. On CPU,
    bf16 is used: it has fp32's range, and its matrix-vector product measured faster
    than fp16's on the project's 2-core AVX2 machine.
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    return torch.bfloat16


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, stage: Stage, device: torch.device) -> torch.dtype:
    if dtype is None:
        return half_dtype(device) if stage.half else torch.float32
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key not in DTYPES:
            raise UnsupportedOptionError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[key]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedOptionError(f"dtype {dtype} is not supported (float32, float16, bfloat16)")
    return dtype
