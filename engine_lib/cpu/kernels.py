"""Our own CPU matvec kernels (C++, AVX2 and FMA; int8 and int4 also AVX-512 VNNI) for decode steps: bf16, int8
and int4 weights.

Defined in chapter 10 (fewer bytes), beside llama.cpp in chapter 08. A decode step on a CPU is
bound by how fast the weights stream from memory. PyTorch's kernels for one row leave much of
that unused on an AVX2 host, and without OpenMP a hand-written loop would use one core only.
``gemv.cpp`` reads each weight once in its stored width and widens it in registers, four weight
rows at a time, on every core through ATen's OpenMP ``parallel_for``. bf16 weights meet the fp32
activations (the result is the fp32 matmul, summed in another order); int8 weights meet
activations rounded to 16-bit integers per block of inputs (within about 1e-5 of the fp32 matmul
of the dequantized weights), int4 weights activations rounded to 8-bit integers per 32 inputs, as
llama.cpp does (on random rows an error about a twentieth of the int4 weights' own).

The build targets AVX2, so it runs on any x86 CPU with AVX2; where the CPU also has AVX-512 VNNI
(checked at run time) the int8 and int4 kernels take its wider integer dot products (``vpdpwssd``,
``vpdpbusd``): a third (int8) and about half (int4) of the AVX2 inner loop's instructions per weight,
which lets them keep more of the memory stream busy (measured on a 2-core AMX host, one row, cold
weights: 1.02 to 1.29x the AVX2 kernels at the model's shapes, most near 1.2x; least for int8's
down projection, whose long rows AVX2 already streamed near the memory's speed). The activations
are rounded the same way, bit for bit; int8 gives AVX2's sums bit for bit, int4 adds the same
integer sums in another order (within fp32 rounding). ``isa()`` says which set runs;
``ENGINE_LIB_CPU_ISA=avx2`` or ``forced_isa("avx2")`` keeps the AVX2 one (the tests compare the
two, and a benchmark can time both).

Prefills (more rows than a decode step) have helpers here: ``int4_dequantize`` writes a block of
int4 rows as bf16 or fp32 for a GEMM (AVX-512 where present, the same values); on a CPU with AMX
``int24_linear`` runs an int8 layer's prefill of a few rows as one int8 GEMM (``torch._int_mm``) of
the rows written as 24-bit integers, with no float copy of the weight, ``int8_tiles_linear`` does the
same on an int8 weight kept in AMX's tile layout, and ``int4_amx_linear`` dequantizes an int4 weight
32 rows at a time into L2 and multiplies it there on AMX's bf16 unit.

The source is compiled on first use (about 15 s, once per machine: PyTorch caches the build
under ``~/.cache/torch_extensions``) and registered as ``torch.ops.engine_lib_cpu.*``, with
shape functions so a compiled decode step calls them as it calls any extern kernel. Where they
cannot be built (not x86 with AVX2 and FMA, no C++ compiler, a failed build) the layers keep
PyTorch's kernels, and ``unavailable_reason`` says why; ``ENGINE_LIB_CPU_KERNELS=0`` turns
them off (for comparisons).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("gemv.cpp")
# built into the same library: attention over the int8 KV cache (``kv_attention.py``, chapter 05)
SOURCES = (SOURCE, Path(__file__).with_name("kv_attention.cpp"))
# the kernels' names, as a layer's ``kernel`` and the profiler (``engine_lib_cpu::...``) give them
BF16_GEMV, INT8_GEMV, INT4_GEMV = "engine_lib_cpu.bf16_gemv", "engine_lib_cpu.int8_gemv", "engine_lib_cpu.int4_gemv"
BF16_LINEAR = "engine_lib_cpu.bf16_linear"  # an eager bf16 row in one call: the matvec, its bias and rounding
BF16_GEMM = "engine_lib_cpu.bf16_gemm"  # bf16 rows from two on, on a CPU without bf16 instructions
BF16_OPS = (BF16_LINEAR, BF16_GEMV, BF16_GEMM)  # our bf16 kernels, as a profiler names them
INT8_TILES = "engine_lib_cpu.int8_tiles_linear"  # int8 weights in AMX tiles (a CPU with AMX): every row count
INT4_AMX = "engine_lib_cpu.int4_amx_linear"  # an int4 prefill on AMX's bf16 unit, the weight dequantized in L2
MAX_ROWS = 5  # rows the kernels take outside a decode step (bf16: the GEMM from 2 rows, at any count: bf16_linear)
GEMM_MULTIPLE = 16  # our bf16 GEMM takes input widths that are multiples of this (16 weights widened at a time)
ENV = "ENGINE_LIB_CPU_KERNELS"
ISA_ENV = "ENGINE_LIB_CPU_ISA"  # "avx2": the AVX2 int8 and int4 kernels even on a CPU with AVX-512 VNNI (read at load)
ISAS = ("avx512_vnni", "avx2")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def _missing() -> str | None:
    """Why the kernels cannot be built here, before trying (None: try)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they are written for x86 AVX2 (this CPU is {platform.machine()})"
    if not torch.cpu._is_avx2_supported():
        return "this CPU has no AVX2"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on the PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "no ninja (pip install ninja): PyTorch builds C++ extensions with it"
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernels are built and registered; otherwise why not (said once, as a warning)."""
    reason = _missing()
    if reason is None:
        try:
            _build()
        except Exception as exc:  # a compiler or toolchain problem: PyTorch's kernels still work
            reason = f"the build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
    if reason is not None and os.environ.get(ENV, "1") != "0":
        warnings.warn(f"our CPU matvec kernels are off ({reason}); decode uses PyTorch's kernels", RuntimeWarning,
                      stacklevel=2)
    return reason


def available() -> bool:
    return unavailable_reason() is None


def isa() -> str | None:
    """The instructions the int8 and int4 kernels use now: "avx512_vnni" where the CPU has AVX-512 VNNI
    (int4 groups that are not whole 64s keep AVX2), "avx2" otherwise or when forced; None where the
    kernels are off. bf16 is AVX2 and FMA everywhere."""
    return torch.ops.engine_lib_cpu.kernel_isa() if available() else None


@contextlib.contextmanager
def forced_isa(name: str) -> Iterator[str]:
    """Inside: the int8 and int4 kernels of ``name``, "avx2" or "auto" (the widest this CPU has), in every
    thread; yields the set that runs (``isa()``). For comparisons: both give the same sums (int4: to fp32 rounding)."""
    if not available():
        raise RuntimeError(f"our CPU kernels are off ({unavailable_reason()})")
    before = isa()
    try:
        yield torch.ops.engine_lib_cpu.set_isa(name)
    finally:
        torch.ops.engine_lib_cpu.set_isa("avx2" if before == "avx2" else "auto")


def _build() -> None:
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:12]
    start = time.perf_counter()
    announced = False
    if not _built_before(digest):
        print("Building our CPU matvec kernels once (C++, AVX2 and AVX-512)...", end=" ", file=sys.stderr, flush=True)
        announced = True
    _clear_stale_lock(digest)
    load(name=f"engine_lib_cpu_{digest}", sources=[str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    if announced:
        print(f"done in {time.perf_counter() - start:.0f} s.", file=sys.stderr, flush=True)
    _register_shapes()


STALE_LOCK_S = 300  # a build takes about 15 s; a lock this old belongs to a build that was killed


def _clear_stale_lock(digest: str) -> None:
    """PyTorch's build holds a lock file while it compiles, and every other process waits for it to go, silently
    and forever: a build that was interrupted (a notebook stopped, a test run killed) leaves it behind. One that
    old is removed, with a warning."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(f"engine_lib_cpu_{digest}", verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"removing a stale build lock ({lock}, {age / 60:.0f} min old: an interrupted build left it)",
                      RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


def _built_before(digest: str) -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(f"engine_lib_cpu_{digest}", verbose=False))
    return any(folder.glob("*.so"))


def _register_shapes() -> None:
    """Output shapes for tracing (torch.compile, meta tensors): what each op returns, without running it."""
    lib = "engine_lib_cpu::"
    if getattr(_register_shapes, "done", False):
        return

    @torch.library.register_fake(lib + "bf16_gemv")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake(lib + "bf16_gemm")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake(lib + "bf16_linear")
    def _(x, w, bias):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake(lib + "int8_gemv")
    def _(x, q, scales):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake(lib + "int4_gemv")
    def _(x, q, scales_and_zeros, group_size):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake(lib + "int24_split")
    def _(x):
        return x.new_empty(3 * x.shape[0], x.shape[1], dtype=torch.int8), x.new_empty(x.shape[0], dtype=torch.float32)

    @torch.library.register_fake(lib + "int24_combine")
    def _(sums, scale, col_scales):
        return scale.new_empty(scale.shape[0], sums.shape[1])

    @torch.library.register_fake(lib + "int8_tiles_pack")
    def _(w):
        n, k = w.shape
        return w.new_empty(n // 16, k // 64, 16, 16, 4), w.new_empty(n, dtype=torch.int32)

    @torch.library.register_fake(lib + "int8_tiles_linear")
    def _(x, packed, colsum, col_scales):
        return x.new_empty(x.shape[0], packed.shape[0] * 16, dtype=torch.float32)

    @torch.library.register_fake(lib + "int8_tiles_rows")
    def _(packed, a, b, out):
        return None

    @torch.library.register_fake(lib + "int4_amx_linear")
    def _(x, q, scales_and_zeros, group_size):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake(lib + "int8_kv_attention")
    def _(q, k, k_scale, v, v_scale, mask):
        return q.new_empty(q.shape)  # (batch, heads, q_len, head_dim), contiguous, q's dtype

    @torch.library.register_fake(lib + "kv_attention")
    def _(q, k, v, mask):
        return q.new_empty(q.shape)  # (batch, heads, q_len, head_dim), contiguous, q's dtype

    @torch.library.register_fake(lib + "quantize_kv")
    def _(x):
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)

    # their FLOPs for torch.utils.flop_counter (chapter 08's FLOPs per byte): 2 per weight and row
    from torch.utils.flop_counter import register_flop_formula

    ops = torch.ops.engine_lib_cpu

    register_flop_formula([ops.bf16_gemv, ops.bf16_gemm, ops.bf16_linear, ops.int8_gemv, ops.int4_gemv,
                           ops.int4_amx_linear])(linear_flops)

    @register_flop_formula(ops.int8_tiles_linear)
    def _(x_shape, packed_shape, *args, **kwargs) -> int:
        return 2 * x_shape[0] * x_shape[1] * packed_shape[0] * 16

    _register_shapes.done = True


def linear_flops(x_shape, w_shape, *args, **kwargs) -> int:
    """A linear layer's FLOPs for ``torch.utils.flop_counter``: x (..., in) against a weight of ``w_shape[0]``
    output rows, a multiply and an add per weight and row (whatever the weight's stored width or layout)."""
    return 2 * math.prod(x_shape) * w_shape[0]


_decode = threading.local()
# batch invariance (a server's ``batch_invariant``): every row's sums computed alone, by our kernels, at any
# row count. A plain module global, not a thread-local: compiled steps read it (dynamo guards on its value),
# so a runner that sets it compiles its own step (``loop.model_runner``)
ROWS_ALONE = False


@contextlib.contextmanager
def every_row() -> Iterator[None]:
    """Inside: the kernels take any number of rows, as they do inside a compiled decode step (the eager
    fallback of a compiled step runs so, ``compiled_step``), except many bf16 rows where the CPU has a
    native bf16 GEMM (see ``takes``)."""
    before = getattr(_decode, "on", False)
    _decode.on = True
    try:
        yield
    finally:
        _decode.on = before


@contextlib.contextmanager
def rows_alone() -> Iterator[None]:
    """Inside: every row's sums are computed alone, by our kernels, whatever else is in the call (a
    matmul library's are not: its blocking follows the row count). A batch-invariant server runs its
    decode steps and prefills so, and its tokens then do not depend on the batch they were in."""
    global ROWS_ALONE
    before = ROWS_ALONE
    ROWS_ALONE = True
    try:
        with every_row():
            yield
    finally:
        ROWS_ALONE = before


def takes(x2: torch.Tensor, native_gemm: bool = False, max_rows: int = MAX_ROWS) -> bool:
    """x2 (rows, in) on the CPU: up to ``max_rows`` rows (a short prefill), any rows under ``every_row``,
    or any rows inside a compiled step. There a row-count test would guard (and recompile) on the
    batch size; and the kernels still beat a bf16 GEMM on a CPU without bf16 instructions. Many
    rows outside a decode step (a prefill) go to the faster fp32 blocks (``cpu_matmul``).

    ``native_gemm``: the layer's weights have a hardware GEMM here (bf16 on a CPU with AMX or AVX-512
    BF16). It reads the weights once for all rows, where our kernels' time grows with the rows
    (measured on a 2-core AMX host, (16, 1536) x (8960, 1536): 1.0 ms against 10 ms), so from 2 rows
    on it takes the call, unless rows must be summed alone (``rows_alone``). In a compiled step the
    test costs no guard: the step is compiled for one row or for a symbolic batch of 2 or more."""
    if x2.device.type != "cpu":
        return False
    if native_gemm and x2.shape[0] > 1 and not ROWS_ALONE:
        return False
    return torch.compiler.is_compiling() or x2.shape[0] <= max_rows or getattr(_decode, "on", False)


def gemm_takes(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``bf16_linear`` runs our GEMM (``bf16_gemm``) for x2 (rows, in): two rows or more, unless each
    row must be summed alone (``rows_alone``: the GEMM's sums differ from the matvec's one-row sums in their
    order, so a row would change with the rows beside it), on an input width it takes (a multiple of 16)."""
    return x2.shape[0] > 1 and not ROWS_ALONE and weight.shape[1] % GEMM_MULTIPLE == 0


def bf16_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (rows, in) @ weight (out, in, bf16)^T on our kernels: one row (a decode step) through the matvec,
    which streams the weights; more through the GEMM (``gemm_takes``), which widens each weight vector once for
    a tile of rows. Measured on a 2-core Zen 4 held to AVX2, the (8960, 1536) weight: the GEMM took 0.69 / 0.88
    / 1.08 / 1.79 ms at 2 / 4 / 6 / 12 rows, the matvec 0.76 / 1.42 / 2.12 / 4.10."""
    gemm = gemm_takes(x2, weight)
    if not gemm and x2.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16) \
            and not torch.compiler.is_compiling():
        # an eager step: the layer in one call, bf16 in and out (inside a compiled step inductor fuses the conversions)
        return torch.ops.engine_lib_cpu.bf16_linear(x2.contiguous(), weight, bias)
    op = torch.ops.engine_lib_cpu.bf16_gemm if gemm else torch.ops.engine_lib_cpu.bf16_gemv
    y = op(x2.float().contiguous(), weight)  # (rows, out) fp32
    return (y + bias.float() if bias is not None else y).to(x2.dtype)


def int8_linear(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.engine_lib_cpu.int8_gemv(x2.float().contiguous(), q, scales).to(x2.dtype)


def int4_linear(x2: torch.Tensor, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.ops.engine_lib_cpu.int4_gemv(x2.float().contiguous(), q, scales_and_zeros, group_size).to(x2.dtype)


@functools.cache
def int8_gemm_is_native() -> bool:
    """Whether this CPU has an int8 matrix unit (AMX), which oneDNN's ``torch._int_mm`` uses: then
    ``int24_linear`` is the faster prefill of a few rows with int8 weights. Never on AVX2 alone: there oneDNN
    makes the activations unsigned by adding 128 before ``vpmaddubsw``, whose 16-bit pair sums saturate unless
    the weights stay within [-63, 63] (measured on a Zen 4 held to AVX2: sums off by up to 2e5 for full-range
    int8 weights, exact within [-63, 63]); an int8 prefill there takes our row kernel (``int8_linear``)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_amx_tile_supported()


def int8_tiles_fit(out_features: int, in_features: int) -> bool:
    """Whether an int8 layer of this shape can live in AMX tiles (``int8_tiles_linear``) on this CPU: it has
    AMX, the kernels are built with AVX-512 VNNI in use, out_features % 32 == 0 and in_features % 64 == 0."""
    return (out_features % 32 == 0 and in_features % 64 == 0 and int8_gemm_is_native() and available()
            and isa() == "avx512_vnni")


def int8_tiles_pack(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q (out, in) -> (its AMX tiles (out/16, in/64, 16, 16, 4): the same bytes, reordered once; the
    column sums (out,) int32, which the one-row kernel needs). See ``gemv.cpp``, ``int8_tiles_pack``."""
    return torch.ops.engine_lib_cpu.int8_tiles_pack(q.contiguous())


def int8_tiles_unpack(tiles: torch.Tensor) -> torch.Tensor:
    """The plain (out, in) int8 matrix back from its tiles (a copy)."""
    nb, kb = tiles.shape[:2]
    return tiles.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 64)


def int8_tiles_bf16_rows(tiles: torch.Tensor, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
    """Output rows a..b-1 (whole 16s) of a weight in AMX tiles, as bf16 (exact), written into ``out``: for a
    prefill longer than the tiles pay for (``routing.TILES_MAX_ROWS``), which runs the bf16 GEMM on blocks."""
    out = out[:(b - a) * tiles.shape[1] * 64].view(b - a, tiles.shape[1] * 64)
    torch.ops.engine_lib_cpu.int8_tiles_rows(tiles, a, b, out)
    return out


def int8_tiles_linear(x2: torch.Tensor, tiles: torch.Tensor, colsum: torch.Tensor, scales: torch.Tensor
                      ) -> torch.Tensor:
    """x2 (rows, in) @ (q * scales)^T for q in AMX tiles: each row written as 24-bit integers (``int24_split``),
    exact integer sums (one row: AVX-512 VNNI over the tiles; more: the AMX unit), combined in fp32 and
    rounded once to x2's dtype. Each row's result is the same at any row count (the sums are exact)."""
    return torch.ops.engine_lib_cpu.int8_tiles_linear(x2, tiles, colsum, scales).to(x2.dtype)


def int24_linear(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) @ (q * scales)^T for int8 q (out, in): each row written as three int8 parts of one
    24-bit integer per row (``gemv.cpp``, ``int24_split``), one int8 GEMM of the 3 x rows parts (exact int32
    sums), combined in fp32 and rounded once to x2's dtype. Every bf16 activation within 2^15 of its row's
    largest is held exactly: the result is the fp32 matmul of the dequantized weight to fp32 rounding,
    each row computed alone. Measured on a 2-core AMX host against dequantizing into bf16 blocks for the
    bf16 GEMM (``routing.prefill_matmul``), 35 rows: see ``routing.INT24_MAX_ROWS``."""
    parts, row_scale = torch.ops.engine_lib_cpu.int24_split(x2)
    sums = torch._int_mm(parts, q.t())
    return torch.ops.engine_lib_cpu.int24_combine(sums, row_scale, scales.float().contiguous()).to(x2.dtype)


def int4_dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, a: int, b: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Rows a..b-1 of a plain-layout int4 weight into ``out`` ((b - a) * in elements, fp32 or bf16)."""
    out = out[:(b - a) * q.shape[1] * 2].view(b - a, q.shape[1] * 2)
    torch.ops.engine_lib_cpu.int4_dequantize(q, scales_and_zeros, group_size, a, b, out)
    return out


def int4_rows_beat_gemm(group_size: int) -> bool:
    """Whether an int4 prefill of a few dozen rows runs faster through our kernel (``int4_linear``, four rows
    at a time) than through bf16 blocks and the bf16 GEMM here: a CPU whose int4 kernel is the AVX-512 VNNI
    one (groups of whole 64s) and that has no AMX (which has its own int4 prefill, ``int4_amx_linear``).
    See ``routing.VNNI_INT4_KERNEL_ROWS``."""
    return group_size % 64 == 0 and isa() == "avx512_vnni" and not torch.ops.engine_lib_cpu.amx_bf16()


def int4_amx_fit(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether an int4 layer's prefill can run on AMX's bf16 unit here (``int4_amx_linear``): the CPU has
    AMX-BF16 and AVX-512, the kernels are built with AVX-512 in use, out_features % 32 == 0 and the group
    size is a multiple of 32."""
    return (out_features % 32 == 0 and group_size % 32 == 0 and in_features % group_size == 0 and available()
            and isa() == "avx512_vnni" and torch.ops.engine_lib_cpu.amx_bf16())


def int4_amx_linear(x2: torch.Tensor, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
                    ) -> torch.Tensor:
    """x2 (rows, in) bf16 @ W^T for an int4 weight in the plain layout (``q``: two per byte): 32 weight rows at
    a time dequantized into a buffer in L2 (the bf16 values ``int4_dequantize`` writes, bit for bit) and
    multiplied on AMX (``tdpbf16ps``, fp32 sums) -> (rows, out) bf16. No bf16 copy of the weight leaves the
    cache, and a row's result does not depend on the other rows (see ``gemv.cpp``)."""
    return torch.ops.engine_lib_cpu.int4_amx_linear(x2.contiguous(), q, scales_and_zeros, group_size)
