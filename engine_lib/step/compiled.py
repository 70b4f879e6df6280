"""Running the decode step fast, and never failing because of it: compiled, captured, or eager.

Defined in chapter 07 (fusion and CUDA graphs).

- The step is compiled once per variant, with batch size (from 2 on) and cache length
  as the only symbols in the generated code (``mark_dynamic``), so new request shapes
  reuse it instead of recompiling a 28-layer step; floats and every other size are
  constants, so dynamo traces the step once. The variants are few by design
  (``max_variants``: a batch of one or more, times the four pick modes), under dynamo's
  recompile limit. Before each variant compiles, one line says so, and after it, what it
  cost: a first ``generate()`` on a Colab CPU host otherwise sits silent for minutes.
- On CUDA each (cache, pick mode) is captured once as a CUDA graph and replayed for every
  token: the captured kernels read the fixed buffers of ``DecodeState``.
- Any failure to compile or capture (no C compiler, no Triton, dynamo's recompile limit,
  a capture error) falls back one level, graph -> compiled -> eager, with one warning,
  and the token is still produced. A failed compile or capture runs none of the step,
  and the step only writes slots it owns, so re-running it eagerly is exact.
"""

from __future__ import annotations

import time
import types
import warnings

import torch

from ..cpu import kernels as cpu_kernels
from ..model.layers import sdpa
from ..sampling import PickMode, pick_modes
from .decode import DecodeState, decode_step

BACKEND = "inductor"  # torch.compile backend; tests swap in one that fails
ANNOUNCE = True  # print one line per compile (its variant and cost)
_COMPILED: dict[tuple, object] = {}  # one compiled step per kind of model, shared by its engines
_VARIANTS: dict[tuple, set] = {}  # per compiled step: the variants compiled so far


def max_variants(vocab_size: int) -> int:
    """Compiled variants one step can have: batch of one or not, times every pick mode."""
    return 2 * len(pick_modes(vocab_size))


def variant(st: DecodeState, mode: PickMode) -> tuple:
    return (st.batch == 1, mode)


def mark_dynamic(st) -> None:
    """Make batch (from 2 on: dynamo specialises a size of 1) and cache length the step's only
    symbolic sizes; every other size (heads, head_dim, vocab, candidates) stays a constant.
    The state names its own (buffer, dim) pairs: ``dynamic_dims``."""
    for t, dim in st.dynamic_dims():
        torch._dynamo.maybe_mark_dynamic(t, dim)


def compiled_decode_step(key: tuple):
    """``decode_step`` compiled for one kind of model (config, dtype, options, device type).

    Dynamo keeps its compiled variants, and counts them against its recompile limit, per
    code object. Each kind of model gets its own copy of ``decode_step``'s code, so two
    different models in one process never use up each other's budget, while engines of
    the same kind share one compiled step.
    """
    if key not in _COMPILED:
        sdpa.constant_when_compiled()
        code = decode_step.__code__.replace()  # an equal but distinct code object
        fn = types.FunctionType(code, decode_step.__globals__, decode_step.__name__, decode_step.__defaults__)
        _COMPILED[key] = torch.compile(fn, dynamic=None, fullgraph=True, backend=BACKEND)
        _VARIANTS[key] = set()
    return _COMPILED[key]


class CompiledStep:
    """Calls ``decode_step`` in the fastest form that works, for fixed-shape (kv_len=None) steps."""

    def __init__(self, compile_step: bool, cuda_graph: bool, key: tuple = ()):
        self.wants_compile, self._compiled = compile_step, None
        self.key = key
        self.cuda_graph = cuda_graph
        self.pool = None  # one CUDA memory pool shared by every graph this runner captures
        self.fallbacks: list[str] = []  # what failed, in order (the warnings' text)

    @property
    def compiled(self):
        """The compiled step (None: eager), made at the first decode step: ``torch.compile`` imports
        torch._dynamo, most of a second, which the prompt's first token (an eager prefill) need not wait for."""
        if self._compiled is None and self.wants_compile:
            self._compiled = compiled_decode_step(self.key)
        return self._compiled

    @compiled.setter
    def compiled(self, value) -> None:
        self._compiled, self.wants_compile = value, value is not None

    @property
    def form(self) -> str:
        """What runs now: 'cuda_graph', 'compiled' or 'eager'."""
        return "cuda_graph" if self.cuda_graph else "compiled" if self.wants_compile else "eager"

    def __call__(self, model, st: DecodeState, mode: PickMode) -> None:
        if self.cuda_graph:
            graph = st.graphs.get(mode) or self._capture(model, st, mode)
            if graph is not None:
                graph.replay()
                return
        self._run(model, st, mode)

    def _capture(self, model, st: DecodeState, mode: PickMode):
        saved = st.snapshot()
        device = st.token.device
        try:
            with torch.cuda.device(device):  # streams, pool and capture on the engine's GPU, not the current one
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # warm up (and compile) outside the capture
                    self.warm_up(model, st, mode, saved)
                torch.cuda.current_stream(device).wait_stream(stream)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._run(model, st, mode)
            st.graphs[mode] = graph
            return graph
        except Exception as exc:
            torch.cuda.synchronize(device)
            st.restore(saved)
            self._fall_back("CUDA graph capture", exc)
            self.cuda_graph = False
            return None

    def warm_up(self, model, st: DecodeState, mode: PickMode, saved: list[torch.Tensor], runs: int = 2) -> None:
        """Run the step ``runs`` times from the same state, restoring it after each run.

        Each run writes exactly the slots the real step will write next (the newest token's
        cache slot and the history slot after it), never further: a warm-up that let the
        step advance would write past the cache when the first decode sits near its end,
        a device-side assert on CUDA that leaves the context unusable.
        """
        for _ in range(runs):
            self._run(model, st, mode)
            st.restore(saved)

    def _run(self, model, st: DecodeState, mode: PickMode) -> None:
        """The step without a graph: compiled if that works, else eager."""
        if self.compiled is not None:
            if not getattr(st, "marked_dynamic", False):
                # every state, not only a variant's first: dynamo also recompiles a variant when a guard
                # on global state fails (an fp16 engine turns allow_fp16_reduced_precision_reduction off),
                # and that recompile must stay dynamic in the batch and the cache length
                mark_dynamic(st)
                st.marked_dynamic = True
            seen = _VARIANTS.setdefault(self.key, set())
            new = variant(st, mode) not in seen
            try:
                if new:
                    self._compile(model, st, mode)
                    seen.add(variant(st, mode))
                else:
                    self.compiled(model, st, mode, None)
                return
            except Exception as exc:  # compile errors surface before any kernel has run
                self._fall_back("torch.compile", exc)
                self.compiled = None
        with cpu_kernels.every_row():  # on a CPU, our matvec kernels for every row, as compiled
            decode_step(model, st, mode, None)

    def _compile(self, model, st: DecodeState, mode: PickMode) -> None:
        """The first call of a variant: announce it, compile (and run) it, say what it cost."""
        what = (f"batch {'1' if st.batch == 1 else '>= 2'}, {'greedy' if mode.greedy else 'sampling'}"
                f"{' + penalty' if mode.penalize and mode.greedy else ''}")
        if ANNOUNCE:  # one line, under the book's 90 columns even at "batch >= 2, greedy + penalty ... 999.9 s."
            print(f"Compiling the decode step once ({what})...", end="", flush=True)
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(specialize_float=True):  # eps and other floats: constants
            try:
                self.compiled(model, st, mode, None)
            except Exception:
                if ANNOUNCE:
                    print(" failed.", flush=True)
                raise
        if ANNOUNCE:
            print(f" done in {time.perf_counter() - t0:.1f} s.", flush=True)

    def _fall_back(self, what: str, exc: Exception) -> None:
        message = f"{what} failed, decoding continues without it: {type(exc).__name__}: {str(exc)[:300]}"
        self.fallbacks.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
