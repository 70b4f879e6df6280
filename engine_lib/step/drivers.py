"""How the token loop's runner drives each cache: its forward for rows of new tokens, its decode state, and
one run of the decode step.

Defined in chapter 05 (``ContiguousSteps``: the engine's own generations) and chapter 12 (``PagedSteps``:
the server's). The runner (``loop.model_runner``) asks both the same four things: ``forward`` (prompt
chunks and drafts to verify, eagerly), ``state_for`` (the decode state of a batch, loaded with its rows),
``run`` (one decode step on it) and ``runs_ahead`` (whether steps may follow each other on the device).
"""

from __future__ import annotations

import time

from ..cache.blocks import blocks_for
from ..cache.contiguous import KVCache
from ..cache.paged import PagedKVCache
from .compiled import CompiledStep
from .decode import DecodeState, decode_step
from .forward import Row, contiguous_forward, paged_forward
from .paged import PagedDecodeState, batch_bucket, span_bucket

MAX_STATES = 8  # paged decode states (buffers, graphs) kept; the least recently used goes first


def announce_capture(st, seconds: float, held: int) -> None:
    print(f"Captured the decode step as a CUDA graph (batch {st.batch}, read span {st.key_valid.shape[1]}) in "
          f"{seconds:.1f} s; {held} graphs held.", flush=True)


class ContiguousSteps:
    """Chapter 05's cache: one decode state over every row, and the step the rung chose: compiled (and
    captured on a GPU) where it compiles, else eager over exactly the slots written so far."""

    def __init__(self, model, cache: KVCache, compile_step: bool, cuda_graph: bool):
        self.model, self.cache = model, cache
        cuda_graph = cuda_graph and cache.device.type == "cuda"
        key = (model.config, model.dtype, model.options, cache.device.type)
        self.step = CompiledStep(compile_step, cuda_graph, key) if compile_step or cuda_graph else None
        self.state = DecodeState(cache, model.config.vocab_size, cache.device)
        self.states = {(cache.batch, cache.max_len): self.state}
        self.captures: list[tuple[int, int, float]] = []

    @property
    def step_form(self) -> str:
        return self.step.form if self.step is not None else "eager"

    @property
    def fallbacks(self) -> list[str]:
        return self.step.fallbacks if self.step is not None else []

    def forward(self, rows: list[Row], all_positions: bool = False):
        return contiguous_forward(self.model, self.cache, rows, all_positions)

    def runs_ahead(self, rows: int) -> bool:
        """Only with every row in the batch: a row that sits out would walk past its scratch slot."""
        return rows == self.cache.batch

    def state_for(self, rows: tuple[Row, ...], steps: int) -> DecodeState:
        self.state.load([r.tokens[0] for r in rows], [r.start for r in rows], [r.table for r in rows])
        return self.state

    def run(self, st: DecodeState, mode) -> None:
        if self.step is None:  # eager: the first read_span slots, masked by slot where rows are ragged
            decode_step(self.model, st, mode, kv_len=st.read_span)
            st.read_span += 1
            return
        new = mode not in st.graphs and self.step.cuda_graph
        t0 = time.perf_counter()
        self.step(self.model, st, mode)
        if new and st.graphs:
            self.captures.append((st.batch, st.max_len, time.perf_counter() - t0))
            announce_capture(st, self.captures[-1][2], len(st.graphs))


class PagedSteps:
    """Chapter 12's cache: a decode state per (batch bucket, read span), the least recently used dropped
    past ``MAX_STATES``, and the step through ``CompiledStep`` (compiled where the rung compiles, captured
    per bucket on a GPU, else eager over the fixed read span)."""

    def __init__(self, model, cache: PagedKVCache, max_model_len: int, compile_step: bool, cuda_graph: bool,
                 min_rows: int = 1, fixed_read_span: int | None = None, pad_to_bucket: bool | None = None):
        self.model, self.cache = model, cache
        self.max_read_span = blocks_for(max_model_len, cache.block_size) * cache.block_size
        self.min_rows = min_rows  # batch invariance: a lone row still runs as a batch
        self.fixed_read_span = fixed_read_span  # batch invariance: every row reads the same span
        # a batch-invariant runner compiles its own step: inside it, every row is summed alone (rows_alone)
        key = (model.config, model.dtype, model.options, cache.device.type, "paged", bool(fixed_read_span))
        self.step = CompiledStep(compile_step, cuda_graph and cache.device.type == "cuda", key)
        # buckets are for CUDA graphs (one capture per bucket); elsewhere a batch runs at its own size
        # (the compiled step takes any batch): no padding rows to compute, and a row's numbers stay
        # those of the same rows without padding
        self.pad_to_bucket = self.step.cuda_graph if pad_to_bucket is None else pad_to_bucket
        self.states: dict[tuple[int, int], PagedDecodeState] = {}
        self.captures: list[tuple[int, int, float]] = []  # (bucket, read span, seconds) per new decode state

    @property
    def step_form(self) -> str:
        return self.step.form

    @property
    def fallbacks(self) -> list[str]:
        return self.step.fallbacks

    def forward(self, rows: list[Row], all_positions: bool = False):
        return paged_forward(self.model, self.cache, rows, all_positions)

    def runs_ahead(self, rows: int) -> bool:
        return True

    def state_for(self, rows: tuple[Row, ...], steps: int) -> PagedDecodeState:
        """The decode state of this batch's bucket and read span (made on first use), loaded with its rows."""
        n, longest = len(rows), max(r.start + steps for r in rows)
        bucket = batch_bucket(n, self.min_rows) if self.pad_to_bucket else max(n, self.min_rows)
        key = (bucket, self.fixed_read_span or span_bucket(longest, self.max_read_span))
        st = self.states.pop(key, None)
        if st is None:
            if len(self.states) >= MAX_STATES:
                self.states.pop(next(iter(self.states)))  # least recently used: its buffers and graphs go
            st = PagedDecodeState(self.cache, key[0], key[1], self.model.config.vocab_size)
            self.captures.append((*key, 0.0))
        self.states[key] = st  # most recently used last
        st.load([r.tokens[0] for r in rows], [r.start for r in rows], [r.table for r in rows])
        return st

    def run(self, st: PagedDecodeState, mode) -> None:
        new = mode not in st.graphs and self.step.cuda_graph
        t0 = time.perf_counter()
        self.step(self.model, st, mode)
        if new and st.graphs:  # a capture happened: say so, with its count and cost
            self.captures[-1] = (st.batch, st.read_span, time.perf_counter() - t0)
            announce_capture(st, self.captures[-1][2], len([s for s in self.states.values() if s.graphs]))
