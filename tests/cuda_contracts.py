"""CUDA's scaled_dot_product_attention contract, simulated on CPU (issue 14).

CPU SDPA accepts any input and returns a contiguous output; CUDA does neither. Inside
``simulate("t4")`` or ``simulate("h200")`` every ``F.scaled_dot_product_attention`` call:

1. picks the kernel that GPU would pick: torch's priority order for that compute capability,
   restricted by ``sdpa_kernel`` (the enabled-backend flags), each backend's input rules
   checked as ``sdp_utils.cpp`` checks them (dtype, mask, GQA, head_dim, strides);
2. fails with ``CudaContractError`` when no enabled kernel takes the call (CUDA's
   "No available kernel"), and records every pick in ``SIM.picks``;
3. returns the right numbers (CPU's math kernel) in the output layout the chosen kernel
   returns, read from torch's own meta kernels (``_scaled_dot_product_*_attention`` on meta
   tensors), not written here. Compiled, the same layout comes from the op's fake kernel,
   so inductor plans for it as it would on CUDA.

The engine's own choice of backend (``engine_lib.model.layers.sdpa``) is steered too: while a
simulation runs, it sees the simulated compute capability for CPU tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
_FLAGS = {FLASH: torch.backends.cuda.flash_sdp_enabled, EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled,
          CUDNN: torch.backends.cuda.cudnn_sdp_enabled, MATH: torch.backends.cuda.math_sdp_enabled}
BACKEND_OF = {SDPBackend.FLASH_ATTENTION: FLASH, SDPBackend.EFFICIENT_ATTENTION: EFFICIENT,
              SDPBackend.CUDNN_ATTENTION: CUDNN, SDPBackend.MATH: MATH}


class CudaContractError(RuntimeError):
    """A call that the simulated GPU's SDPA would refuse (or run on a kernel it must not)."""


@dataclass(frozen=True)
class SimDevice:
    name: str
    capability: tuple[int, int]
    # torch's default order (sdp_utils.cpp priority_order); on sm_90 recent torch ranks cuDNN first
    priority: tuple[str, ...]


DEVICES = {
    "t4": SimDevice("T4", (7, 5), (FLASH, EFFICIENT, MATH, CUDNN)),
    "h200": SimDevice("H200", (9, 0), (CUDNN, FLASH, EFFICIENT, MATH)),
}


@dataclass
class Pick:
    backend: str
    dtype: torch.dtype
    q_shape: tuple
    kv_shape: tuple
    masked: bool
    causal: bool


@dataclass
class _Sim:
    device: SimDevice | None = None
    picks: list[Pick] = field(default_factory=list)


SIM = _Sim()  # the simulation in force (one at a time)


# ------------------------------------------------------------------ the input rules, per backend
def _refusal(backend: str, dev: SimDevice, q, k, v, mask, causal: bool, enable_gqa: bool) -> str | None:
    """Why ``backend`` would not take this call on ``dev`` (None: it would)."""
    sm = dev.capability
    d = q.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if any(t.dtype != q.dtype for t in (k, v)):
        return "q, k and v must share a dtype"
    if backend == MATH:
        return None
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the last dimension of q, k and v must be contiguous (stride 1)"
    if q.dtype == torch.bfloat16 and sm < (8, 0):
        return f"bf16 needs sm_80 or later (this is sm_{sm[0]}{sm[1]})"
    gqa = q.shape[1] != k.shape[1]
    if backend == FLASH:
        if sm < (8, 0):
            return f"flash attention needs sm_80 or later (this is sm_{sm[0]}{sm[1]})"
        if not half:
            return f"flash attention takes fp16/bf16, not {q.dtype}"
        if mask is not None:
            return "flash attention takes no attn_mask"
        if d % 8 or d > 256:
            return f"flash attention needs head_dim % 8 == 0 and <= 256 (got {d})"
        if causal and q.shape[2] != k.shape[2]:
            return "flash attention: is_causal with q_len != kv_len"
        if gqa and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
            return "flash attention: unequal head counts without enable_gqa"
        return None
    if gqa:  # only flash (and math) implement enable_gqa
        return f"{backend} attention: {q.shape[1]} query heads vs {k.shape[1]} KV heads (GQA is flash/math only)"
    if backend == EFFICIENT:
        align = 16 // q.element_size()  # 16-byte aligned rows: 8 half or 4 fp32 elements
        if d % align:
            return f"memory-efficient attention needs head_dim % {align} == 0 for {q.dtype} (got {d})"
        return None
    if backend == CUDNN:
        if sm < (8, 0):
            return f"cuDNN attention needs sm_80 or later (this is sm_{sm[0]}{sm[1]})"
        if not half:
            return f"cuDNN attention takes fp16/bf16, not {q.dtype}"
        if d % 8 or d > 128:
            return f"cuDNN attention needs head_dim % 8 == 0 and <= 128 (got {d})"
        return None
    raise ValueError(backend)


@torch.compiler.assume_constant_result
def _enabled() -> tuple[str, ...]:
    """The backends ``sdpa_kernel`` leaves enabled (global flags, read at trace time when compiled)."""
    return tuple(name for name, flag in _FLAGS.items() if flag())


def choose(dev: SimDevice, q, k, v, mask, causal: bool, enable_gqa: bool) -> str:
    """The kernel ``dev`` runs this call on, or CudaContractError with every backend's reason."""
    enabled = _enabled()
    why = {}
    for backend in dev.priority:
        if backend not in enabled:
            why[backend] = "disabled by sdpa_kernel"
            continue
        reason = _refusal(backend, dev, q, k, v, mask, causal, enable_gqa)
        if reason is None:
            return backend
        why[backend] = reason
    detail = "; ".join(f"{b}: {r}" for b, r in why.items())
    raise CudaContractError(f"no SDPA kernel on the {dev.name} (sm_{dev.capability[0]}{dev.capability[1]}) takes "
                            f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, mask={mask is not None}, "
                            f"causal={causal}: {detail}")


# ------------------------------------------------------------------ the output layout, from torch's meta kernels
def _kernel_output(backend: str, q, k, v):
    """The output of the CUDA kernel's meta implementation (shape and strides; q, k, v may be fake)."""
    if backend == EFFICIENT:
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False)[0]
    if backend == FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
    if backend == CUDNN:
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[0]
    return None  # math: a composite of matmuls, contiguous


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@torch.library.custom_op("cuda_contracts::sdpa", mutates_args=())
def _sdpa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
             scale: float | None, enable_gqa: bool, backend: str) -> torch.Tensor:
    """CPU numbers in the layout ``backend`` returns on CUDA (recorded here: this runs for every call,
    eager or compiled)."""
    SIM.picks.append(Pick(backend, q.dtype, tuple(q.shape), tuple(k.shape), mask is not None, causal))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, causal, scale=scale,
                                                            enable_gqa=enable_gqa)[0]
    like = _kernel_output(backend, _meta(q), _meta(k), _meta(v))
    if like is None:
        return out.contiguous()
    return torch.empty_strided(like.shape, like.stride(), dtype=out.dtype).copy_(out)


@_sdpa_op.register_fake
def _(q, k, v, mask, causal, scale, enable_gqa, backend):
    like = _kernel_output(backend, q, k, v)  # fake tensors: torch's meta kernel gives the (symbolic) strides
    if like is None:
        return q.new_empty(q.shape)
    return like


def contract_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stands in for ``F.scaled_dot_product_attention`` during a simulation."""
    dev = SIM.device
    backend = choose(dev, query, key, value, attn_mask, is_causal, enable_gqa)
    return _sdpa_op(query, key, value, attn_mask, is_causal, scale, enable_gqa, backend)


@contextlib.contextmanager
def simulate(name: str):
    """Every SDPA call behaves as on the named GPU ("t4" or "h200"); dynamo's caches are
    reset on the way in and out, so no graph compiled outside the simulation is reused."""
    try:
        from engine_lib.model.layers import sdpa as engine_sdpa  # the engine's per-call-site backend choice
    except ImportError:  # an engine from before issue 14 leaves the choice to torch
        engine_sdpa = None
    try:  # our CPU attention kernel over a bf16 cache never runs on a GPU: there that attention is SDPA's
        from engine_lib.cpu import kv_attention as cpu_kv
        from engine_lib.model.layers.attention import sdpa_attention
    except ImportError:
        cpu_kv = None
    dev = DEVICES[name]
    real_sdpa = F.scaled_dot_product_attention
    real_cap = engine_sdpa.cuda_capability if engine_sdpa else None
    real_float = getattr(cpu_kv, "kv_attention", None)
    _reset_compiled()
    SIM.device, SIM.picks = dev, []
    F.scaled_dot_product_attention = contract_sdpa
    if engine_sdpa:
        engine_sdpa.cuda_capability = lambda device: dev.capability
    if real_float:
        cpu_kv.kv_attention = lambda q, k, v, mask: sdpa_attention(q, k, v, mask, False)
    try:
        yield SIM
    finally:
        F.scaled_dot_product_attention = real_sdpa
        if real_float:
            cpu_kv.kv_attention = real_float
        if engine_sdpa:
            engine_sdpa.cuda_capability = real_cap
        SIM.device = None
        _reset_compiled()


def _reset_compiled() -> None:
    from engine_lib.step import compiled as compiled_step

    # torch._dynamo.reset() drops every compiled graph, so nothing compiled outside the simulation is reused.
    # The registry of compiled steps stays: an engine built before (a session fixture's) keeps its step, and a
    # later engine of the same model must get that same step (test_step_compiled checks it), not a new one
    getattr(compiled_step, "_VARIANTS", {}).clear()  # (absent before issue 14): each variant compiles again
    torch._dynamo.reset()
