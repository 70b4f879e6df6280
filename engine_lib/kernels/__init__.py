"""Chapter 14: kernels we write ourselves, in Triton: the decode step's hot spots.

One file per kernel, each with a bytes-moved model (what the roofline says the kernel should cost);
what each must compute is the engine's own operations, which the tests and chapter 14 hold it to
(``engine_lib/book/kernel_references.py``). The kernels import nothing of the engine: its layers call them.

- ``add_rmsnorm``: residual add + RMSNorm in one pass, the residual updated in place;
- ``rope_kv_write``: RoPE on q and k, fused with the KV-cache write (contiguous or paged);
- ``decode_attention``: split-KV ("flash-decoding") attention for one or a few query tokens;
- ``int8_matvec``: weight-only int8 matrix-vector products for 1 to 8 rows.

Triton is optional: nothing here imports it until a kernel is asked for, and
``unavailable_reason`` says, before anything runs, why the kernels cannot run on a device.
On a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``, numpy, slow but
exact), which is how CI tests every kernel without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel is defined, so it must be set before the first
    kernel module is imported (``conftest.py`` and chapter 14 set it first thing)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_version() -> str | None:
    """The installed Triton's version, None when it is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return triton.__version__


# Triton's CPU interpreter before this version turns a runtime loop bound into a Python int with
# int(array) on a shape-(1,) NumPy array, which NumPy 2 refuses (seen with Triton 3.6, the GPU
# machine's; 3.9, the lock's, squeezes first). Compiled kernels on a GPU are not affected.
INTERPRETER_MIN_TRITON = (3, 9)


def interpreter_reason() -> str | None:
    """Why Triton's CPU interpreter cannot run our kernels here (None: it can)."""
    version = triton_version()
    if version is None:
        return "Triton is not installed (pip install triton)"
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < INTERPRETER_MIN_TRITON:
        return (f"Triton {version}'s CPU interpreter cannot run these kernels' runtime loop bounds with "
                f"NumPy 2 (fixed by Triton {'.'.join(map(str, INTERPRETER_MIN_TRITON))}); compiled on a GPU they run")
    return None


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """A CUDA device's compute capability, asked once per device (None off CUDA).

    The engine asks on every kernel call (about 56 times an eager step): the answer cannot
    change while the process lives, so it is cached."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _capability(torch.cuda.get_device_capability, device.index)


@functools.cache
def _capability(query, index: int | None) -> tuple[int, int]:
    # keyed by the query function too: a test that stands in for the device is asked afresh
    major, minor = query(index)
    return major, minor


def unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why our kernels cannot run on ``device`` in ``dtype`` (None: they can).

    - no ``triton`` package (``pip install triton``; Colab's GPU runtimes have it);
    - a CPU without the interpreter (the kernels are GPU code; the interpreter is for tests);
    - a GPU older than sm_70 (Triton's minimum), or bf16 below sm_80 (a T4 has no bf16
      arithmetic: the engine runs it in fp16, and so do the kernels).
    """
    device = torch.device(device)
    if triton_version() is None:
        return "Triton is not installed (pip install triton)"
    if device.type == "cpu":
        if not interpreting():
            return "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 to test them on CPU)"
        return interpreter_reason()
    if device.type != "cuda":
        return f"Triton kernels do not run on {device.type}"
    major, minor = device_capability(device)
    if (major, minor) < (7, 0):
        return f"Triton needs a GPU of compute capability 7.0 or later; this one is {major}.{minor}"
    if dtype == torch.bfloat16 and major < 8:
        return f"bf16 needs compute capability 8.0 or later; this GPU is {major}.{minor} (use fp16)"
    return None


def check_cache_dtypes(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, dtype: torch.dtype) -> None:
    """ValueError unless the caches are in ``dtype`` without scales, or an int8 cache (``cache/quantized.py``)
    with an fp32 scale per slot and KV head, k's and v's laid out alike (the kernels share their strides)."""
    if k_scale is None and v_scale is None:
        if k_cache.dtype != dtype or v_cache.dtype != dtype:
            hint = "; an int8 cache needs k_scale and v_scale" if torch.int8 in (k_cache.dtype, v_cache.dtype) else ""
            raise ValueError(f"caches in {k_cache.dtype}/{v_cache.dtype}: they must be in the queries' dtype, {dtype}"
                             f"{hint}")
        return
    if k_scale is None or v_scale is None:
        raise ValueError("an int8 cache needs both k_scale and v_scale, got only one")
    if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8:
        raise ValueError(f"k_scale/v_scale go with an int8 cache, got {k_cache.dtype}/{v_cache.dtype}")
    want = tuple(k_cache.shape[:-1])  # (batch, kv_heads, max_len) or (num_slots, kv_heads): one per slot and head
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"{name} must be fp32 {want} (one scale per slot and KV head), "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    if v_scale.stride() != k_scale.stride():
        raise ValueError(f"v_scale's strides {v_scale.stride()} must be k_scale's {k_scale.stride()}")
