"""The token loop's core: ``step()`` is schedule, run, process, and every cached generation is made by it.

Defined in chapter 12 (serving many users). The core owns the three parts and the drafter: the scheduler
plans each step's forwards (``scheduler``), the runner executes each one (``model_runner``), the output
processor turns its tokens into text, stops and events (``output``). Speculative decoding (chapter 11)
happens here too, between planning and running: a decode row that drafts asks the drafter for its
draft and verifies it in one forward instead of decoding one token (``_with_drafts``). The core has no
thread: the serving loop (``serving``) steps it in a thread of its own as requests arrive, the engine's
local loop (``local``) in the caller's thread.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from collections.abc import Iterator

from ..cpu.huge_pages import collapse_pending
from ..errors import ContextLengthError
from ..model.config import usable_context
from ..sampling import SamplingParams
from ..speculative import drafter_named
from ..step.forward import Row
from .metrics import Metrics
from .model_runner import ModelRunner, ScheduledBatch
from .output import OutputProcessor
from .scheduler import Scheduler, SchedulerConfig
from .sequence import PromptLogprobs, Sequence, make_sequence

FIRST_DRAFT = 4  # a row's first draft length; each later one adapts to what the model kept


class EngineCore:
    """``compile_step`` and ``cuda_graph`` are the engine's own choice for its rung (``Engine.compile_step``,
    ``Engine.cuda_graph``); ``drafter`` overrides ``config.speculative`` (an engine's own drafter object)."""

    def __init__(self, model, tokenizer, cache, config: SchedulerConfig | None = None,
                 metrics: Metrics | None = None, max_model_len: int | None = None, compile_step: bool = False,
                 cuda_graph: bool = False, raise_errors: bool = False, drafter=None):
        config = config or SchedulerConfig()
        self.tokenizer, self.cache, self.config = tokenizer, cache, config
        # a server reports a failed forward to the requests in it and goes on; an engine's caller gets the exception
        self.raise_errors = raise_errors
        self.metrics = metrics or Metrics()
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.max_model_len = usable_context(model.config, max_model_len)
        read_span = blocks_read(self.max_model_len, cache) if config.batch_invariant else None
        invariant = dict(min_rows=config.min_rows, fixed_read_span=read_span) if read_span else {}
        self.runner = ModelRunner(model, cache, self.max_model_len, compile_step, cuda_graph, **invariant)
        self.scheduler = Scheduler(cache, config, self.max_model_len, self.metrics, self.vocab_size, self.device)
        self.output = OutputProcessor(self.metrics, self.max_model_len, self.scheduler.release)
        # a batch-invariant server does not speculate: a verify forward's sums are not a decode step's
        self.drafter = None if config.batch_invariant else drafter or (
            drafter_named(config.speculative) if config.speculative else None)
        if self.drafter is not None:
            self.drafter.start(cache)
        self.steps = 0
        self._ids = itertools.count()

    # ---------------------------------------------------------------- requests
    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, sink=None, request_id: str | None = None,
                     matcher=None) -> Sequence:
        """A request as the loop holds it; its sampler's tensors are made at admission, in the loop's thread."""
        return make_sequence(self.tokenizer, prompt_ids, params, sink, request_id or f"seq-{next(self._ids)}", matcher)

    def check_fits(self, seq: Sequence) -> None:
        """``ContextLengthError`` for a sequence that could never fit (the HTTP layer refuses those first, with a 400)."""
        total = len(seq.prompt_ids) + seq.max_tokens
        if total > self.max_model_len or total > self.cache.capacity_tokens:
            raise ContextLengthError(f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.max_tokens}) = "
                                     f"{total} does not fit: context {self.max_model_len}, KV cache "
                                     f"{self.cache.capacity_tokens} tokens")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.scheduler.waiting.append(seq)

    def cancel(self, ids: set[str]) -> None:
        for seq in [s for s in [*self.scheduler.active, *self.scheduler.waiting] if s.id in ids]:
            self.output.finish(seq, "cancelled")

    def gauges(self) -> dict[str, float]:
        a, s = self.cache.allocator, self.scheduler
        return {"requests_running": len(s.active), "requests_waiting": len(s.waiting),
                "kv_blocks_free": a.num_free, "kv_blocks_total": a.usable, "kv_block_size": self.cache.block_size,
                "kv_cache_capacity_tokens": a.usable * self.cache.block_size, "kv_cache_bytes": self.cache.nbytes,
                "scheduler_steps_total": self.steps}

    # ---------------------------------------------------------------- the loop
    def step(self) -> None:
        """One step of the token loop: schedule, run, process the output."""
        self.steps += 1
        for seq in self.scheduler.admit():
            self._admitted(seq)
        for batch in self.scheduler.schedule():
            for part in self._with_drafts(batch):
                self._execute(part)
        if self.steps == 1:  # the first token is out: a CPU model's weights go onto 2 MiB pages in the background
            collapse_pending()

    def drive(self, seqs: list[Sequence]) -> Iterator[None]:
        """The loop in the calling thread until every one of ``seqs`` is done, yielding after each step: for a
        caller that owns this core and has all its requests at once (``LocalLoop``). A sequence still running
        when the caller stops early (or an exception comes out of a step) is cancelled, so its blocks come back."""
        try:
            for seq in seqs:
                self.add(seq)
            while not all(s.done for s in seqs):
                self.step()
                yield
        finally:
            for seq in seqs:
                if not seq.done:
                    self.output.finish(seq, "cancelled")

    def _admitted(self, seq: Sequence) -> None:
        if self.drafter is not None and self._may_draft(seq):
            seq.draft_k = min(FIRST_DRAFT, self._draft_cap(seq))
        if seq.length == 1:  # a one-token prompt has no prefill: its echo is complete (and all) now
            if seq.prompt_entries is not None:
                self.output.send(seq, PromptLogprobs(tuple(seq.prompt_entries)))
            if seq.max_tokens == 0:
                self.output.finish(seq, "length")

    def _execute(self, batch: ScheduledBatch) -> None:
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            if self.raise_errors:
                raise
            traceback.print_exc(file=sys.stderr)
            for seq in batch.seqs:
                self.output.finish(seq, "error", f"the forward pass failed: {type(exc).__name__}: {exc}")
            return
        self.scheduler.on_forward(batch)
        for seq, token in zip(batch.seqs, result.tokens):
            seq.forwards += 0 if token is None else 1 if batch.prefill or batch.drafts else batch.steps
        self.output.process(batch, result, self.device)
        if batch.drafts:
            self._kept(batch, result)
        self.scheduler.on_output(batch, result)
        for seq in batch.seqs:
            if batch.prefill and seq.pending == 0 and seq.max_tokens == 0:  # echo only: the prompt's logprobs
                self.output.finish(seq, "length")
        if hasattr(self.drafter, "finished"):  # a drafter that learns from finished replies (suffix speculation)
            for seq in batch.seqs:
                if seq.done and seq.finish_reason in ("stop", "length"):
                    self.drafter.finished(seq)

    # ---------------------------------------------------------- speculation
    def _may_draft(self, seq: Sequence) -> bool:
        return (seq.params.greedy or self.config.speculate_sampled) and self._draft_cap(seq) > 0 \
            and self.scheduler.no_host_between_tokens(seq)

    def _draft_cap(self, seq: Sequence) -> int:
        asked = seq.params.speculative_tokens
        return self.config.speculative_tokens if asked is None else min(asked, self.config.speculative_tokens)

    def _with_drafts(self, batch: ScheduledBatch) -> Iterator[ScheduledBatch]:
        """A decode row that drafts (``draft_k``) and gets a draft verifies it instead of decoding one token: the
        verify rows run as one forward (every position's logits) and keep the longest prefix the model agrees
        with, plus the model's own next token; the others stay one decode batch. A draft never runs past the
        tokens the row may still make after the model's own next one (``max_tokens``, the context), and gets
        blocks for its slots where they are free (else it is cut to the slots the row holds). Rejected drafts'
        slots are written over later; nothing is recomputed."""
        if batch.prefill or batch.steps > 1 or not any(s.draft_k for s in batch.seqs):
            yield batch
            return
        asks = [(i, min(s.draft_k, s.max_tokens - len(s.output_ids) - 1, self.max_model_len - s.length))
                for i, s in enumerate(batch.seqs) if s.draft_k]
        asks = [(i, k) for i, k in asks if k > 0]
        drafts = dict(zip((i for i, _ in asks), self.drafter.propose([(batch.seqs[i], k) for i, k in asks])
                          if asks else []))
        verify, plain = [], []
        for i, (seq, row) in enumerate(zip(batch.seqs, batch.rows)):
            draft = drafts.get(i, [])
            draft = draft[:self.scheduler.draft_room(seq, len(draft))] if draft else []
            if draft:
                verify.append((seq, Row([*row.tokens, *draft], row.start, seq.blocks), tuple(draft)))
            else:
                plain.append((seq, row))
        if verify:
            seqs, rows, drafted = zip(*verify)
            yield ScheduledBatch(seqs, rows, prefill=False, drafts=drafted)
        if plain:
            seqs, rows = zip(*plain)
            yield ScheduledBatch(seqs, rows, prefill=False)

    def _kept(self, batch: ScheduledBatch, result) -> None:
        """Count each verify row's drafted and kept tokens, and size its next draft: one longer after a draft
        kept whole (up to the cap), else one past what was kept."""
        self.metrics.speculated(sum(map(len, batch.drafts)), sum(map(len, result.ahead)))
        for seq, draft, kept in zip(batch.seqs, batch.drafts, result.ahead):
            seq.drafted, seq.accepted = seq.drafted + len(draft), seq.accepted + len(kept)
            full = len(kept) == len(draft)
            seq.draft_k = min(len(draft) + 1, self._draft_cap(seq)) if full else len(kept) + 1


def blocks_read(max_model_len: int, cache) -> int:
    """The context rounded up to whole blocks: the fixed read span of a batch-invariant server."""
    bs = cache.block_size
    return -(-max_model_len // bs) * bs
