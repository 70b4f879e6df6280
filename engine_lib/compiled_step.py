"""Running the decode step fast, and never failing because of it: compiled, captured, or eager.

Defined in chapter 07 (fusion and CUDA graphs).

- The step is compiled once with dynamic shapes (``dynamic=True``): batch size and cache
  length are symbols in the generated code, so new request shapes reuse it instead of
  recompiling a 28-layer step. A batch of one is a second, specialised compile.
- On CUDA each (cache, pick mode) is captured once as a CUDA graph and replayed for every
  token: the captured kernels read the fixed buffers of ``DecodeState``.
- Any failure to compile or capture (no C compiler, no Triton, dynamo's recompile limit,
  a capture error) falls back one level, graph -> compiled -> eager, with one warning,
  and the token is still produced. A failed compile or capture runs none of the step,
  and the step only writes slots it owns, so re-running it eagerly is exact.
"""

from __future__ import annotations

import types
import warnings

import torch

from .decode_step import DecodeState, decode_step
from .sampling import PickMode

BACKEND = "inductor"  # torch.compile backend; tests swap in one that fails
_COMPILED: dict[tuple, object] = {}  # one compiled step per kind of model, shared by its engines


def compiled_decode_step(key: tuple):
    """``decode_step`` compiled for one kind of model (config, dtype, options, device type).

    Dynamo keeps its compiled variants, and counts them against its recompile limit, per
    code object. Each kind of model gets its own copy of ``decode_step``'s code, so two
    different models in one process never use up each other's budget, while engines of
    the same kind share one compiled step.
    """
    if key not in _COMPILED:
        code = decode_step.__code__.replace()  # an equal but distinct code object
        fn = types.FunctionType(code, decode_step.__globals__, decode_step.__name__, decode_step.__defaults__)
        _COMPILED[key] = torch.compile(fn, dynamic=True, fullgraph=True, backend=BACKEND)
    return _COMPILED[key]


class CompiledStep:
    """Calls ``decode_step`` in the fastest form that works, for fixed-shape (kv_len=None) steps."""

    def __init__(self, compile_step: bool, cuda_graph: bool, key: tuple = ()):
        self.compiled = compiled_decode_step(key) if compile_step else None
        self.cuda_graph = cuda_graph
        self.pool = None  # one CUDA memory pool shared by every graph this runner captures
        self.fallbacks: list[str] = []  # what failed, in order (the warnings' text)

    @property
    def form(self) -> str:
        """What runs now: 'cuda_graph', 'compiled' or 'eager'."""
        return "cuda_graph" if self.cuda_graph else "compiled" if self.compiled else "eager"

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
            try:
                self.compiled(model, st, mode, None)
                return
            except Exception as exc:  # compile errors surface before any kernel has run
                self._fall_back("torch.compile", exc)
                self.compiled = None
        decode_step(model, st, mode, None)

    def _fall_back(self, what: str, exc: Exception) -> None:
        message = f"{what} failed, decoding continues without it: {type(exc).__name__}: {str(exc)[:300]}"
        self.fallbacks.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
