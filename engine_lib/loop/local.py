"""The token loop run in the caller's thread: how ``Engine.generate`` and ``Engine.stream`` make tokens.

Defined in chapter 05 (the contiguous cache it runs over) and chapter 12 (the loop). The server runs the
loop in a thread of its own and feeds it requests as they arrive. An engine's caller has all its prompts
at once and waits for them, so ``LocalLoop`` puts them on an ``EngineCore`` of its own and steps it in the
calling thread until they are done (``EngineCore.drive``). Its cache is chapter 05's contiguous one, sized
for the call: one row per prompt, of every row's prompt and new tokens rounded up to ``CACHE_BUCKET``
positions, plus the scratch slot. The core, its cache, its decode state and
captured graphs are kept while calls need that size.

``paused`` stops a generation after its prefill, for the chapters that look at one decode step: its
``decode()`` runs the runner's decode batch again, which is harmless (a step writes the same values to
the same slots), so it can be timed, profiled and counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..cache.contiguous import KVCache
from ..errors import NonFiniteLogitsError
from ..sampling import SamplingParams
from ..step.forward import Row
from .engine_core import EngineCore
from .model_runner import ScheduledBatch, StepResult
from .scheduler import SchedulerConfig
from .sequence import Delta, Finished, Sequence

CACHE_BUCKET = 256  # cache lengths are rounded up to this, so buffers (and captured graphs) get reused
MAX_ROWS = 1024  # prompts one call may run at once


class LocalLoop:
    def __init__(self, model, tokenizer, max_model_len: int, compile_step: bool = False, cuda_graph: bool = False,
                 drafter=None, speculative_tokens: int = 8, fixed_len: bool = False, kv_cache_dtype: str | None = None):
        self.model, self.tokenizer, self.max_model_len = model, tokenizer, max_model_len
        self.kv_cache_dtype = kv_cache_dtype  # None: the model's dtype; "int8" (cache/quantized.py)
        self.fixed_len = fixed_len  # every row holds max_model_len positions, whatever the call needs
        self.compile_step, self.cuda_graph, self.drafter = compile_step, cuda_graph, drafter
        # every prompt of a call is admitted at once and prefilled in one forward; nothing is shared between
        # calls (the contiguous cache has no prefix caching), so each call does the same work
        self.config = SchedulerConfig(max_batch=MAX_ROWS, max_queue=MAX_ROWS, prefill_chunk=max_model_len,
                                      prefix_caching=False, speculative_tokens=speculative_tokens,
                                      speculate_sampled=True)
        self.core: EngineCore | None = None

    @property
    def cache(self) -> KVCache | None:
        return self.core.cache if self.core is not None else None

    @property
    def kv_cache_bytes(self) -> int:
        return self.core.cache.nbytes if self.core is not None else 0

    @property
    def step_form(self) -> str:
        """How decode steps run now: 'cuda_graph', 'compiled' or 'eager' (before the first call: how they will)."""
        if self.core is not None:
            return self.core.runner.step_form
        if self.cuda_graph and self.model.device.type == "cuda":
            return "cuda_graph"
        return "compiled" if self.compile_step else "eager"

    @property
    def fallbacks(self) -> list[str]:
        return self.core.runner.fallbacks if self.core is not None else []

    def slots_for(self, needed: int) -> int:
        """A row's slots for a call whose longest row needs ``needed`` positions: rounded up to the bucket (or the
        whole context, where the engine fixed it), at most the context, and the scratch slot. A verify step never
        writes past a row's last position: its drafts stop short of ``max_tokens``."""
        positions = self.max_model_len if self.fixed_len else -(-needed // CACHE_BUCKET) * CACHE_BUCKET
        return min(positions, self.max_model_len) + 1

    def core_for(self, rows: int, needed: int) -> EngineCore:
        """A core whose contiguous cache holds ``rows`` sequences of ``needed`` positions (a new one, and a new
        cache, when the call needs another shape)."""
        length = self.slots_for(needed)
        if self.core is None or (self.core.cache.batch, self.core.cache.max_len) != (rows, length):
            self.core = None  # free the old cache (and its graphs) before allocating the new one
            cfg = self.model.config
            cache = KVCache(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim, length,
                            self.model.dtype, self.model.device, self.kv_cache_dtype)
            self.core = EngineCore(self.model, self.tokenizer, cache, self.config, max_model_len=self.max_model_len,
                                   compile_step=self.compile_step, cuda_graph=self.cuda_graph, raise_errors=True,
                                   drafter=self.drafter)
        return self.core

    def run(self, prompts: list[list[int]], params: SamplingParams, reads_every: int = 1
            ) -> Iterator[tuple[list[Sequence], list[list[str]]]]:
        """Queue every prompt (``params.max_tokens`` new tokens each) and step the loop until all are done. After
        each step, yields the sequences and the text each made in it (whole characters, from the output
        processor). ``reads_every``: decode steps the loop may run before the host reads the tokens
        (``Scheduler.steps_ahead``): a caller that waits for the whole reply loses nothing by it, one that
        streams wants every token as it comes (1). Raises ``NonFiniteLogitsError`` when a row's logits held
        NaN or Inf (naming the rows), and whatever a forward raised."""
        core = self.core_for(len(prompts), max(map(len, prompts)) + params.max_tokens)
        core.scheduler.decode_steps = reads_every
        texts: list[list[str]] = [[] for _ in prompts]
        failed: list[int] = []

        def sink(event, row: int) -> None:
            if isinstance(event, Delta) and event.text:
                texts[row].append(event.text)
            elif isinstance(event, Finished) and event.reason == "error":
                failed.append(row)

        seqs = [core.new_sequence(p, params, sink=lambda ev, i=i: sink(ev, i)) for i, p in enumerate(prompts)]
        for _ in core.drive(seqs):
            if failed:
                made = max(len(s.output_ids) for s in seqs)
                raise NonFiniteLogitsError(f"before generated token {made + 1} (batch rows {sorted(failed)})",
                                           self.model.device)
            yield seqs, texts
            for t in texts:
                t.clear()

    def paused(self, prompts: list[list[int]], params: SamplingParams) -> Paused:
        """The loop stopped right after the prefill of ``prompts`` (each picks its first token): a decode batch
        of all of them, ready to run (``params.max_tokens`` sizes the cache)."""
        core = self.core_for(len(prompts), max(map(len, prompts)) + params.max_tokens)
        seqs = [core.new_sequence(p, params) for p in prompts]
        steps = core.drive(seqs)
        next(steps)  # admit and prefill: every row has its first token
        rows = tuple(Row([s.last_token], s.length - 1, list(s.blocks)) for s in seqs)
        steps.close()  # the rest is not run: the sequences are let go, their rows stay written
        return Paused(core, ScheduledBatch(tuple(seqs), rows, prefill=False))


@dataclass
class Paused:
    """A generation stopped after its prefill: ``decode()`` runs its next decode step (again and again: the
    same step writes the same values to the same slots), ``forward(k)`` a verify forward of ``k`` drafted
    tokens. For measurements: neither moves the sequences on."""

    core: EngineCore
    batch: ScheduledBatch

    @property
    def runner(self):
        return self.core.runner

    @property
    def cache(self) -> KVCache:
        return self.core.cache

    def decode(self) -> StepResult:
        return self.core.runner.execute(self.batch)

    def forward(self, k: int):
        """The forward a verify step runs: each row's newest token and ``k`` drafted tokens (copies of it), every
        position's logits (k = 0: one token through the same code, the unit a verify's cost is counted in)."""
        rows = [Row([*r.tokens, *[r.tokens[0]] * k], r.start, r.table) for r in self.batch.rows]
        return self.core.runner.steps.forward(rows, all_positions=True)
