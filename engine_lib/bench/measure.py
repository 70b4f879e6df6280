"""Timing, memory and kernel-name helpers shared by the benchmark, the load test and the chapters.

Defined in chapter 00 (TTFT, tokens/s, peak memory) and used in every chapter's "Measure".
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

CLEAR_REFS, STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def device_name(device: str | torch.device | None = None) -> str:
    """The GPU's name, or the CPU's with its vector instructions and core count: what every record and
    figure says it ran on. The instructions decide CPU speed as much as the cores do (PyTorch's int4
    decode ran about twice as fast on an AVX-512 + AMX host as on an AVX2 one)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {cpu_instructions()}, {os.cpu_count()} cores)"


def cpu_model() -> str | None:
    """The CPU's model name as the OS gives it (Linux: /proc/cpuinfo's "model name"; None where it is not said).
    Two hosts held to the same instructions differ in caches, memory and clock: a record names which one it ran on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def huge_pages_note() -> str:
    """Whether the engine's weights sit on 2 MiB pages in this process (``huge_pages``), in words for a record
    (a decode step streams them: the page size moves its speed by a fifth on a 2-core Xeon)."""
    from ..cpu.huge_pages import collapse_later, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return f"4 KiB pages: {reason}"
    when = "collapsed in the background after the load" if collapse_later() else "taken before the first token"
    return f"the engine's weights on 2 MiB pages (transparent huge pages, {when})"


def host_meta(device: str | torch.device) -> dict:
    """A CPU record's labels for its host (``cpu_model``, ``huge_pages``); none for a GPU's."""
    return {"cpu_model": cpu_model(), "huge_pages": huge_pages_note()} if torch.device(device).type == "cpu" else {}


def host_words(meta: dict) -> str | None:
    """The CPU a record ran on and its page size, as ``host_meta`` labelled them, in words; None for a record
    that does not name its CPU."""
    if not meta.get("cpu_model"):
        return None
    return meta["cpu_model"] + (f"; {meta['huge_pages']}" if meta.get("huge_pages") else "")


def cpu_instructions() -> str:
    """The widest vector instructions PyTorch uses here ("AVX2", "AVX512"), and AMX where present."""
    isa = torch.backends.cpu.get_cpu_capability()
    if isa == "AVX2" and torch.cpu._is_avx512_supported():  # ATEN_CPU_CAPABILITY=avx2 held it back
        isa = "AVX2 of an AVX512 CPU"  # never passed off as an AVX2-only machine
    return isa + (" + AMX" if torch.cpu._is_amx_tile_supported() else "")


def git_commit() -> str:
    """The commit a record was measured at (``unknown`` outside a git checkout), with ``+uncommitted`` when
    the engine's code (``engine_lib``) differs from it: then the record did not measure that commit alone."""
    here = Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=here, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", str(here.parent)], capture_output=True,
                                 text=True, cwd=here, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+uncommitted" if changed else "")


def timed(fn: Callable, device: torch.device | str, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds, after warm-up, synchronised with the device:
    exactly ``repeats`` single calls of ``timing.measure`` (which keeps every reading)."""
    from .timing import measure

    return measure(fn, device, warmup=warmup, min_total_s=0.0, min_repeats=repeats, max_repeats=repeats,
                   number=1).median


def reset_peak_memory(device: torch.device | str) -> None:
    """GPU: reset the allocator's peak. CPU: reset the process's peak RSS (Linux clear_refs)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif CLEAR_REFS.exists():
        try:
            CLEAR_REFS.write_text("5")
        except OSError:
            pass


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """GPU: ``max_memory_allocated``. CPU: peak RSS of the whole process (VmHWM)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if STATUS.exists():
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None) -> float:
    """Measured device memory bandwidth in bytes/s: a big tensor copy reads and writes each byte once."""
    device = torch.device(device)
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=5, warmup=2)
    return 2 * nbytes / seconds


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's storage; for a wrapper subclass (torchao's quantized weights), of its parts."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every weight once (a tied matrix counted once), integer
    weights and their scales at their own size. An embedding table that is not also the LM head
    (a quantized head has its own copy) counts one row: a step looks up one row of it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    backbone = getattr(model, "model", None)
    embed = getattr(getattr(backbone, "embed_tokens", None), "weight", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    seen, total = set(), 0
    for p in model.parameters():
        key = id(p) if p.device.type == "meta" or is_traceable_wrapper_subclass(p) else p.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        n = tensor_bytes(p)
        if p is embed and head is not embed:
            n //= p.shape[0]
        total += n
    return total


def load_footprint(model_dir, stage: str, device: str = "cpu") -> dict:
    """Load one rung in a fresh Python process (``python -m engine_lib.bench.footprint``, so nothing
    the caller holds is counted), run a
    32-token prefill, and report: ``peak`` memory (CPU: the process's peak RSS; CUDA:
    ``max_memory_allocated``), ``base`` (CPU: the RSS before loading), ``added`` (peak - base),
    ``held_bytes`` (the model's tensors), ``weight_bytes`` (read per decode token) and the
    ``kernels`` of its weight matmuls (``matmul_kernels``)."""
    import json
    import sys

    out = subprocess.run([sys.executable, "-m", "engine_lib.bench.footprint", str(model_dir), stage, str(device)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"loading {stage} in a fresh process failed: {out.stderr[-1000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {**r, "added": r["peak"] - r["base"]}


@contextlib.contextmanager
def cpu_profile() -> Iterator:
    """``torch.profiler.profile`` over the CPU, minus the 'USDT: ... profiler_start' lines that its
    C++ side writes straight to file descriptor 2 (a notebook prints them on the page)."""
    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                yield prof
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def top_level_ops(fn: Callable) -> int:
    """How many operators ``fn()`` dispatches from Python (the profiler's top-level ones: aten's and
    our CPU kernels).

    Kernels inside a compiled region or a CUDA graph replay are not top-level, so this
    counts the eager work around them: the host's per-token overhead.
    """
    return sum(top_level_op_names(fn).values())


DISPATCHED = ("aten::", "engine_lib_cpu::", "engine_lib::")  # aten's operators, our CPU kernels (cpu_kernels, cpu_packed)


def op_name(event_name: str) -> str:
    """A profiler event's operator name: aten's without ``aten::``, ours as ``engine_lib_cpu.<name>`` or ``engine_lib.<name>``."""
    return event_name.removeprefix("aten::").replace("::", ".")


def top_level_op_names(fn: Callable) -> Counter:
    """``top_level_ops`` by name: which operators the host dispatches itself (``op_name``)."""
    with cpu_profile() as prof:
        fn()
    return Counter(op_name(e.name) for e in prof.events() if e.cpu_parent is None and e.name.startswith(DISPATCHED))


def eager_ops_per_token(engine, prompt, short: int = 8, long: int = 40, **options) -> float:
    """Top-level aten ops per generated token: (ops for ``long`` tokens - ops for ``short``) / the
    difference, so the prompt's prefill and the per-call setup cancel out."""
    opts = {"do_sample": False, "stop_token_ids": (), **options}
    engine.generate(prompt, max_new_tokens=long, **opts)  # warm up (and compile) first
    counts = [top_level_ops(lambda n=n: engine.generate(prompt, max_new_tokens=n, **opts)) for n in (short, long)]
    return (counts[1] - counts[0]) / (long - short)


def step_operators(model) -> dict[str, set[str]]:
    """The aten operators (names without ``aten::``) of one 64-token prefill and one decode step,
    run eagerly under the profiler: a compiled step or a graph replay calls the same operators.
    -> {"prefill": names, "decode": names}, read by ``attention_kernels`` and ``matmul_kernels``."""
    from ..cache.contiguous import KVCache
    from ..step.decode import GREEDY, DecodeState, decode_step
    from ..step.forward import Row, contiguous_forward

    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, 64 + 2, model.dtype, model.device)

    def names(fn) -> set[str]:
        with cpu_profile() as prof:
            fn()
        return {op_name(e.name) for e in prof.events() if e.name.startswith(DISPATCHED)}

    with torch.inference_mode():
        prefill = names(lambda: contiguous_forward(model, cache, [Row(list(range(1000, 1064)), 0, [0])]))
        st = DecodeState(cache, cfg.vocab_size, model.device)
        st.load([1000], [64], [[0]])
        decode = names(lambda: decode_step(model, st, GREEDY, None))
    return {"prefill": prefill, "decode": decode}


ATTENTION_OPS = ("_scaled_dot_product", "_efficient_attention", "_flash_attention", "_cudnn_attention")
CPU_ATTENTION_OPS = ("engine_lib_cpu.kv_attention", "engine_lib_cpu.int8_kv_attention")  # ours, over the cache


def attention_kernels(model, ops: dict[str, set[str]] | None = None) -> dict[str, str]:
    """Which attention kernel PyTorch picks for this model's prefill and fixed-shape decode step.

    Reads the SDPA backend's operator name from ``step_operators`` (pass ``ops`` to reuse one
    profiled run), e.g. ``_scaled_dot_product_efficient_attention`` (CUDA) or ``..._math`` (the
    slow fallback that repeats K/V and upcasts), or our CPU kernel over a bf16 or int8 cache
    (``engine_lib_cpu.kv_attention``, ``cpu/kv_attention.py``).
    """
    def backend(names: set[str]) -> str:
        ours = [n for n in CPU_ATTENTION_OPS if n in names]
        if ours:
            return ours[0]
        found = {n for n in names if n.startswith(ATTENTION_OPS)}
        if not found:
            return "written out (matmul + softmax)"
        return min(found, key=len)  # the backend op, not its inner kernels

    return {step: backend(names) for step, names in (ops or step_operators(model)).items()}


def matmul_kernels(model, ops: dict[str, set[str]] | None = None) -> dict[str, str]:
    """Which operators did the weight matmuls of one 64-token prefill and one decode step.

    Like ``attention_kernels``, read from ``step_operators`` (pass ``ops`` to
    reuse one profiled run), e.g. ``_weight_int8pack_mm`` (CPU, packed int8) or
    ``engine_lib_cpu.int8_gemv`` or ``engine_lib_cpu.bf16_linear`` (our CPU kernels, ``cpu_kernels``: an eager bf16
    row's one-call layer), ``engine_lib.packed_linear`` (bf16 weights
    in oneDNN's blocked layout, a CPU with bf16 instructions: ``cpu_packed``).
    ``dequantize + linear``: integers turned into floats, then the ordinary matmul;
    ``int24 rows + _int_mm``: an int8 prefill as one int8 GEMM (a CPU with AMX, ``cpu_kernels.int24_linear``);
    ``linear`` alone: an unquantized model.
    """
    from ..cpu.kernels import BF16_OPS
    from ..cpu.packed import PACKED_LINEAR
    from ..quant.linear import DENSE, INT24_GEMM, PACKED_OPS, quantized_linears

    quantized = bool(quantized_linears(model))

    def kernels(names: set[str]) -> str:
        found = [op for op in (*PACKED_OPS, PACKED_LINEAR, *BF16_OPS) if op in names]
        if "engine_lib_cpu.int24_split" in names:
            found.append(INT24_GEMM)
        if "linear" in names:
            found.append(DENSE if quantized else "linear")
        return " + ".join(found) or "none"

    return {step: kernels(names) for step, names in (ops or step_operators(model)).items()}
