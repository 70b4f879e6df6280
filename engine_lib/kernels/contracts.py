"""Resource contracts: every kernel launch the engine makes, compiled ahead of time for the GPUs it targets.

Defined for issue 26 (chapter 14's kernels on a T4 and an H200). No GPU is needed: Triton
compiles for a ``GPUTarget`` on any host and ships the ``ptxas`` that turns its PTX into
machine code, and ``ptxas -v`` reports what a program costs the chip:

- **registers and spills**: a thread has at most 255 registers; what does not fit spills to
  local memory (off-chip), which turns a bandwidth-bound kernel's one pass into several;
- **shared memory** per block (Triton's metadata): a T4 block may have 64 KiB, an H100/H200
  block 227 KiB; more and the launch fails;
- **tensor cores**: on sm_80 and later a 16-bit ``tl.dot`` should compile to ``mma``/``wgmma``.

The launches are the engine's own: each kernel module's ``_launch`` is called with CPU tensors
of the real model's shapes while ``JITFunction.run`` is replaced by a recorder, so the
arguments, constexprs and launch options are exactly what the engine would pass, tile choices
included (``decode_attention.tiles``, one source of truth). Triton's own binder then
specialises them as its runtime would (which integers are 1 or divisible by 16).

Run ``python -m engine_lib.kernels.contracts`` for the table (exit status 1 on a violation);
``tests/test_kernels_contracts.py`` runs it in a subprocess, because the tests' interpreter
mode (``TRITON_INTERPRET=1``) replaces every kernel with its numpy stand-in at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

# the real model's shapes (Qwen2.5-1.5B): 12 query heads sharing 2 KV heads of 128, hidden 1,536
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 12, 2, 128, 1536, 8960
BUFFER, PAGE = 4096, 16  # a cache bucket and the paged cache's block size
KERNEL_MAX_QUERY = 8  # layers/attention.py: longer forwards take SDPA (not imported: it pulls in the model)


@dataclass(frozen=True)
class Chip:
    name: str
    capability: tuple[int, int]
    shared_limit: int  # bytes of shared memory a block may use, with the margin this contract keeps
    why: str

    @property
    def tensor_cores(self) -> bool:
        """Whether 16-bit dots must use tensor cores (Triton uses them for 16-bit dots from sm_80)."""
        return self.capability >= (8, 0)


CHIPS = {
    # a T4 block may take all 64 KiB, but then it runs alone on its SM, and above 48 KiB it needs
    # the dynamic opt-in: 48 KiB keeps 16 KiB of headroom for another Triton's layouts
    "t4": Chip("T4", (7, 5), 48 * 1024, "48 KiB: a T4's 64 KiB per block less a quarter of headroom"),
    "h200": Chip("H200", (9, 0), 227 * 1024, "227 KiB: an sm_90 block's maximum"),
}


@dataclass
class Launch:
    """One kernel launch as the engine makes it: the JIT function, its arguments and options."""

    kernel: str
    config: str  # what the engine runs it for, e.g. "float16, q_len 8 (M=64), paged"
    half: bool  # 16-bit activations: its dots may run on tensor cores
    fn: object
    args: tuple
    kwargs: dict


@dataclass
class Resources:
    kernel: str
    config: str
    chip: str
    registers: int
    spill_bytes: int  # spill stores per thread
    shared: int  # bytes per block
    tensor_core: bool  # an mma/wgmma instruction in the PTX
    needs_tensor_core: bool
    num_warps: int

    def violations(self) -> list[str]:
        chip = CHIPS[self.chip]
        out = []
        if self.spill_bytes:
            out.append(f"{self.spill_bytes} B of register spill per thread ({self.registers} registers)")
        if self.shared > chip.shared_limit:
            out.append(f"{self.shared:,} B of shared memory > {chip.shared_limit:,} ({chip.why})")
        if self.needs_tensor_core and not self.tensor_core:
            out.append(f"no tensor-core instruction (mma/wgmma) on sm_{''.join(map(str, chip.capability))}")
        return out


@contextlib.contextmanager
def recording():
    """Inside: every ``kernel[grid](...)`` launch is recorded, not run, as (kernel, grid, args, kwargs)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    calls: list[tuple] = []
    real = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}  # compiled kernels, interpreted ones

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, grid, args, kwargs))

    for cls in real:
        cls.run = record
    try:
        yield calls
    finally:
        for cls, run in real.items():
            cls.run = run


def engine_launches(chip: Chip, attention_tiles=None) -> list[Launch]:
    """Every configuration the engine launches on ``chip``; ``attention_tiles(dtype)`` overrides the tiles."""
    from . import add_rmsnorm, decode_attention, int8_matvec, rope_kv_write

    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if chip.capability >= (8, 0) else [])
    out: list[Launch] = []

    def take(calls, config):
        half = dtype != torch.float32
        out.extend(Launch(fn.__name__, config, half, fn, args, kwargs) for fn, _, args, kwargs in calls)

    # the model's dtype in the cache, and an int8 cache (its own compile: int8 tiles and scales); the legacy
    # tiles predate the int8 cache
    caches = (False, True) if attention_tiles is None else (False,)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for q_len in query_lengths():
            # the batch-1 engine's cache, and the server's (paged, with key_valid): the other two mixes do a
            # subset of the second's work (the block table, the padding mask)
            for (paged, padded), int8 in itertools.product(((False, False), (True, True)), caches):
                m = decode_attention.rows_padded(HEADS // KV_HEADS, q_len)
                tile = (decode_attention.tiles(chip.capability, dtype, m) if attention_tiles is None
                        else attention_tiles(dtype))
                with recording() as calls:
                    _attention(decode_attention, dtype, q_len, paged, padded, tile, int8=int8)
                take(calls, f"{name}, q_len {q_len} (M={m}), {'paged, padded' if paged else 'contiguous'}, "
                            f"{'int8 cache, ' if int8 else ''}block_n {tile.block_n}, {tile.num_warps} warps")
        if attention_tiles is not None:
            continue
        x = torch.zeros(KERNEL_MAX_QUERY, HIDDEN, dtype=dtype)
        with recording() as calls:
            weight = torch.ones(HIDDEN, dtype=dtype)
            add_rmsnorm._launch(x, x.clone(), weight, 1e-6)
            add_rmsnorm._launch(x, None, weight, 1e-6)
        take(calls, name)
        for bias in (False, True):  # q/k/v have a bias, the other projections none
            with recording() as calls:
                qweight = torch.zeros(INTERMEDIATE, HIDDEN, dtype=torch.int8)
                scales = torch.ones(INTERMEDIATE, dtype=dtype)
                int8_matvec._launch(x, qweight, scales, scales if bias else None,
                                    int8_matvec.tiles(chip.capability, dtype))
            take(calls, f"{name}, {'bias' if bias else 'no bias'}")
        for paged, int8 in itertools.product((False, True), (False, True)):
            with recording() as calls:
                _rope(rope_kv_write, dtype, paged, int8)
            take(calls, f"{name}, {'paged' if paged else 'contiguous'}{', int8 cache' if int8 else ''}")
    return out


def query_lengths() -> list[int]:
    """Decode (1) and the largest query of each other padded-rows bucket up to ``KERNEL_MAX_QUERY``: a
    bucket's queries share its tile sizes, so one compile stands for all (1, 5 and 8 for 6 groups)."""
    from .decode_attention import rows_padded

    groups = HEADS // KV_HEADS
    largest = {rows_padded(groups, t): t for t in range(1, KERNEL_MAX_QUERY + 1)}
    return sorted({1, *largest.values()} - {largest[rows_padded(groups, 1)]})  # 1 stands for its bucket


def variants(chip: Chip) -> dict[str, int]:
    """How many compiles each kernel needs as the per-step values move (``kv_len`` and with it the number of
    chunks; the rows of an int8 product): 1 each, or a decode would recompile as its context grows."""
    from . import decode_attention, int8_matvec

    compiler = Compiler(chip)
    keys: dict[str, set] = {}
    for kv_len in (1, 16, 17, 33, 64, 100, 4096):
        with recording() as calls:
            tile = decode_attention.tiles(chip.capability, torch.float16, 16)
            _attention(decode_attention, torch.float16, 1, False, False, tile, kv_len=kv_len, chunk=64)
        for fn, _, args, kwargs in calls:
            keys.setdefault(fn.__name__, set()).add(compiler.source(Launch(fn.__name__, "", True, fn, args, kwargs))[0])
    for rows in range(1, int8_matvec.MAX_ROWS + 1):
        with recording() as calls:
            int8_matvec._launch(torch.zeros(rows, HIDDEN, dtype=torch.float16), torch.zeros(HIDDEN, HIDDEN, dtype=torch.int8),
                                torch.ones(HIDDEN, dtype=torch.float16), None, int8_matvec.tiles(chip.capability,
                                                                                                   torch.float16))
        for fn, _, args, kwargs in calls:
            keys.setdefault(fn.__name__, set()).add(compiler.source(Launch(fn.__name__, "", True, fn, args, kwargs))[0])
    return {name: len(k) for name, k in keys.items()}


def _cache(shape: tuple, dtype, int8: bool) -> tuple:
    """A cache buffer (..., head_dim) in ``dtype``, or int8 with its fp32 scales (...): (values, scales or None)."""
    if int8:
        return torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1], dtype=torch.float32)
    return torch.zeros(shape, dtype=dtype), None


def _attention(module, dtype, q_len: int, paged: bool, padded: bool, tile, kv_len: int = BUFFER,
               chunk: int | None = None, int8: bool = False) -> None:
    """One decode_attention call as the engine makes it (``layers/attention.py``)."""
    q = torch.zeros(1, q_len, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)[:, :HEADS]  # packed view
    pos = torch.zeros(1, q_len, dtype=torch.long)
    valid = torch.ones(1, BUFFER, dtype=torch.bool) if padded else None
    if paged:
        k, scale = _cache((BUFFER, KV_HEADS, HEAD_DIM), dtype, int8)  # (num_slots, kv_heads, head_dim)
        table = torch.zeros(1, BUFFER // PAGE, dtype=torch.int32)
    else:
        (k, scale), table = _cache((1, KV_HEADS, BUFFER, HEAD_DIM), dtype, int8), None
    chunk = module.chunk_size(kv_len, 1, KV_HEADS) if chunk is None else chunk
    module._launch(q, k, k, pos, valid, table, PAGE, kv_len, chunk, tile, scale, scale)


def _rope(module, dtype, paged: bool, int8: bool = False) -> None:
    """One rope_kv_write_ call for a decode token, into either cache layout, in ``dtype`` or int8."""
    qkv = torch.zeros(1, 1, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    pos = torch.zeros(1, 1, dtype=torch.long)
    table = torch.zeros(BUFFER, HEAD_DIM, dtype=torch.float32)
    shape = (BUFFER, KV_HEADS, HEAD_DIM) if paged else (1, KV_HEADS, BUFFER, HEAD_DIM)
    cache, scale = _cache(shape, dtype, int8)
    module._launch(q, k, v, pos, table, table, cache, cache, pos, scale, scale)


def ptxas_path(chip: Chip) -> str | None:
    """The ptxas Triton ships (or ``TRITON_PTXAS_PATH``), None when it is missing."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(chip.capability[0] * 10 + chip.capability[1]).path
    except Exception:  # no NVIDIA backend in this Triton build, or no binary
        return None
    return path if path and os.path.exists(path) else None


class Compiler:
    """Specialises launches for a chip as Triton's runtime would, and compiles each distinct one once."""

    def __init__(self, chip: Chip):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.chip = chip
        self.target = GPUTarget("cuda", chip.capability[0] * 10 + chip.capability[1], 32)
        self.backend = make_backend(self.target)
        self.ptxas = ptxas_path(chip)

    def source(self, launch: Launch):
        """(key, ASTSource, options): what ``JITFunction.run`` builds before it compiles, for this chip."""
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        fn = launch.fn
        kwargs = dict(launch.kwargs, debug=False)
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        src = ASTSource(fn, signature, constexprs, attrs)
        return f"{self.target}-{src.hash()}-{options.hash()}", src, options

    def compile(self, src, options) -> tuple[int, int, int, bool, int]:
        """(registers, spill bytes, shared bytes, tensor-core instruction?, warps) of one compiled kernel."""
        import triton

        compiled = triton.compile(src, target=self.target, options=options.__dict__)
        ptx = compiled.asm["ptx"]
        registers, spill = self._ptxas(ptx)
        return registers, spill, compiled.metadata.shared, bool(re.search(r"\b(w?gmma|mma)\.", ptx)), options.num_warps

    def resources(self, launch: Launch, measured: tuple) -> Resources:
        registers, spill, shared, tensor_core, warps = measured
        needs = self.chip.tensor_cores and launch.kernel in TENSOR_CORE_KERNELS and launch.half
        return Resources(launch.kernel, launch.config, _chip_key(self.chip), registers, spill, shared,
                         tensor_core, needs, warps)

    def _ptxas(self, ptx: str) -> tuple[int, int]:
        """(registers, spill store bytes) per thread, from ``ptxas -v``; kept beside Triton's cache, which
        skips its own compile on a rerun, so that a rerun skips this one too."""
        import triton
        from triton.backends.nvidia.compiler import sm_arch_from_capability

        arch = sm_arch_from_capability(self.chip.capability[0] * 10 + self.chip.capability[1])
        digest = hashlib.sha256(f"{self.ptxas}\n{arch}\n{ptx}".encode()).hexdigest()
        saved = os.path.join(triton.knobs.cache.dir, "ptxas-v", f"{digest}.json")
        if os.path.exists(saved):
            with open(saved) as f:
                return tuple(json.load(f))
        counts = self._run_ptxas(ptx, arch)
        os.makedirs(os.path.dirname(saved), exist_ok=True)
        with open(saved + f".{os.getpid()}", "w") as f:  # written whole, then renamed: workers may race
            json.dump(counts, f)
        os.replace(saved + f".{os.getpid()}", saved)
        return counts

    def _run_ptxas(self, ptx: str, arch: str) -> tuple[int, int]:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "kernel.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            run = subprocess.run([self.ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "kernel.o")],
                                 capture_output=True, text=True, check=True)
        log = run.stdout + run.stderr
        registers = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        if registers is None or spill is None:
            raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
        return int(registers.group(1)), int(spill.group(1))


_JOBS: list = []  # (compiler, src, options) for the forked workers


def _compile_job(i: int) -> tuple:
    compiler, src, options = _JOBS[i]
    return compiler.compile(src, options)


def compile_all(jobs: dict, workers: int) -> dict:
    """{key: (compiler, src, options)} -> {key: measurements}, on ``workers`` forked processes."""
    _JOBS[:] = list(jobs.values())
    if workers <= 1 or len(_JOBS) <= 1:
        done = [_compile_job(i) for i in range(len(_JOBS))]
    else:  # fork: the workers inherit the JIT functions, which do not pickle
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = pool.map(_compile_job, range(len(_JOBS)), chunksize=1)
    return dict(zip(jobs, done))


# the kernels whose 16-bit dots must run on tensor cores from sm_80 (int8_matvec's are checked too)
TENSOR_CORE_KERNELS = ("_partial_kernel", "_int8_matvec_kernel")


def _chip_key(chip: Chip) -> str:
    return next(k for k, c in CHIPS.items() if c == chip)


def check(chips=tuple(CHIPS), legacy: bool = True, workers: int | None = None) -> dict:
    """{"triton", "engine": [Resources as dicts], "legacy": [...]}; {"unavailable": why} when ptxas is missing."""
    import triton

    from .decode_attention import LEGACY_TILES

    planned = []  # (section, compiler, launch, key)
    jobs = {}
    for name in chips:
        compiler = Compiler(CHIPS[name])
        if compiler.ptxas is None:
            return {"triton": triton.__version__, "unavailable": "this Triton has no ptxas (NVIDIA backend)"}
        sections = [("engine", engine_launches(compiler.chip))]
        if legacy and compiler.chip.capability < (8, 0):
            # the tiles before issue 26, which the contract must reject on a T4: 16-bit decode and verify
            old = engine_launches(compiler.chip, attention_tiles=LEGACY_TILES.get)
            sections.append(("legacy", [x for x in old if x.kernel == "_partial_kernel" and x.half
                                        and "contiguous" in x.config]))
        for section, launches in sections:
            for launch in launches:
                key, src, options = compiler.source(launch)
                jobs.setdefault(key, (compiler, src, options))
                planned.append((section, compiler, launch, key))
    measured = compile_all(jobs, workers or os.cpu_count() or 1)
    result: dict = {"triton": triton.__version__, "compiles": len(jobs), "engine": [], "legacy": [],
                    "variants": {name: variants(CHIPS[name]) for name in chips}}
    for section, compiler, launch, key in planned:
        result[section].append(asdict(compiler.resources(launch, measured[key])))
    return result


def report(result: dict) -> str:
    if "unavailable" in result:
        return f"resource contracts not checked: {result['unavailable']}"
    lines = [f"triton {result['triton']}: registers, spill stores (B/thread), shared memory (B/block)"]
    for section in ("engine", "legacy"):
        if result[section]:
            lines.append(f"{section}:" if section == "engine" else "legacy tiles (must violate on a T4):")
        for r in result[section]:
            bad = Resources(**r).violations()
            lines.append(f"  {r['chip']:<5} {r['kernel']:<21} {r['registers']:>3} regs {r['spill_bytes']:>6} spill "
                         f"{r['shared']:>7,} smem {'mma' if r['tensor_core'] else '   '} {r['num_warps']}w  "
                         f"{r['config']}{'  <- ' + '; '.join(bad) if bad else ''}")
    for chip, counts in result["variants"].items():
        lines.append(f"compiles as kv_len and rows move ({chip}): {counts}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="Compile every kernel launch for a T4 and an H200; check the contracts.")
    p.add_argument("--chips", nargs="+", default=list(CHIPS), choices=list(CHIPS))
    p.add_argument("--json", default=None, help="write the measurements here")
    p.add_argument("--no-legacy", action="store_true", help="skip the old T4 tiles")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels that would be compiled")
    result = check(tuple(args.chips), legacy=not args.no_legacy)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if any(Resources(**r).violations() for r in result.get("engine", [])):
        sys.exit(1)


if __name__ == "__main__":
    main()
