"""One scaled_dot_product_attention call, with its CUDA kernel chosen here, not by torch.

Defined in chapter 06 (half precision and the SDPA kernels); used by every call site in
``attention.py``. Left to itself, torch picks a kernel per call from a priority list, and
on sm_90 recent versions rank cuDNN first: cuDNN builds a plan for every new shape, and
an eager decode step changes the key length every token (20 to 40 ms of host time per
plan). So on CUDA each call names the kernels it may use:

- no mask, fp16/bf16, sm_80 or later (A100, H100, H200): flash attention, which takes any
  length without a plan;
- everything else (a mask, fp32, or a T4, sm_75, where flash and cuDNN do not exist): the
  memory-efficient kernel, which takes masks, fp32 and fp16 on every GPU since sm_50.

Neither list names the math kernel: a call that no fused kernel takes fails loudly instead
of running many times slower. Both kernels return (batch, heads, q_len, head_dim) *views*
of storage they lay out themselves (memory-efficient: (batch, q_len, heads, head_dim)), so
callers reshape the output, never ``view`` it. CPU keeps torch's own choice.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FLASH_ONLY = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]  # flash first; efficient if flash refuses
MASKED = [SDPBackend.EFFICIENT_ATTENTION]
FORCED: list[SDPBackend] | None = None  # set by ``forced``: every CUDA call uses these (GPU tests, gpu_check)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None on CPU (where torch's own choice is kept). Compiled, a constant
    (``constant_when_compiled``)."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def constant_when_compiled() -> None:
    """Let torch.compile bake ``cuda_capability``'s answer into the graph. Called before a step is compiled, not
    as a decorator: marking it imports torch._dynamo, most of a second of every start, long before the first
    compile (a CPU start reaches its first token through an eager prefill)."""
    torch.compiler.assume_constant_result(cuda_capability)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # asked once per GPU, not per layer and token


def backends_for(capability: tuple[int, int], dtype: torch.dtype, masked: bool) -> list[SDPBackend]:
    """The kernels a call may use on a GPU of this compute capability (see the module docstring)."""
    if FORCED is not None:
        return FORCED
    if not masked and dtype in (torch.float16, torch.bfloat16) and capability >= (8, 0):
        return FLASH_ONLY
    return MASKED


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """q: (batch, heads, q_len, head_dim), k/v: (batch, heads, kv_len, head_dim), equal head counts.

    -> (batch, heads, q_len, head_dim), in whatever memory layout the kernel chose.
    """
    capability = cuda_capability(q.device)
    if capability is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with sdpa_kernel(backends_for(capability, q.dtype, mask is not None)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


@contextlib.contextmanager
def forced(*backends: SDPBackend):
    """Run every CUDA SDPA call of the engine on ``backends`` (a test or a check forcing each kernel
    in turn; an outer ``sdpa_kernel`` would be overridden by the engine's own). Compiled steps see
    it at trace time: a compiled step traced under another choice recompiles."""
    global FORCED
    before, FORCED = FORCED, list(backends)
    try:
        yield
    finally:
        FORCED = before
