"""Continuous batching: one loop owns the model and, every step, admits, prefills, decodes, retires.

Defined in chapter 12 (serving many users). Static batching runs a batch until its
longest request ends, so finished rows idle and new requests wait. Here the batch is
rebuilt every step:

1. apply cancellations (a client went away): free the sequence's blocks at once;
2. admit waiting requests while there is room in the batch and blocks for their prompt; with
   prefix caching, full blocks of the prompt that are cached already are shared, not computed;
3. prefill: push up to ``prefill_chunk`` prompt tokens through the model, in chunks, so a
   long prompt delays the running decodes by one chunk at a time, not by its whole length;
   the chunks of several prompts run as one forward;
4. decode: one batched forward for every sequence that needs exactly one token; a sequence
   that needs a block when none is free preempts the most recently admitted one, whose
   blocks are freed and whose tokens are recomputed when it is admitted again. In a step that
   also prefills, these one-token rows ride along in the prefill's forward, as vLLM's chunked
   prefill does: the weights are read once for both, and on a CPU, where a prefill chunk is bound
   by arithmetic, a row costs a prompt token's arithmetic, not a decode step. When nothing
   waits, nothing prefills and every row is picked inside the step, the batch runs
   ``decode_steps`` steps ahead before the host looks at its tokens (``steps_ahead``). With
   ``speculative``, greedy rows that find a draft in their own context verify it instead
   (``_with_drafts``): several tokens per forward where the model agrees;
5. retire sequences that hit a stop token, a stop string or ``max_tokens``.

A sequence that asks for logprobs gets them from the logits its token was picked from
(``logprobs``); one that asks for its prompt's logprobs (completions' ``echo``) has its
prefill return every position's logits, the others only the last one's.

The loop runs in one thread (``run``: the server's main thread; ``start``: a background one, as in a
notebook); ``submit`` and ``cancel`` are thread-safe, and events go out through each sequence's
``sink`` (which must not block). All of the model's work, each request's sampler included, runs in
the loop's thread: PyTorch's CPU kernels run on OpenMP, and GNU OpenMP, once two threads of a
process have run parallel work on a CPU with fewer cores than their teams, stops spinning between
parallel regions and wakes its threads from sleep for each one (measured on a 2-core host: a
(8960, 1536) matvec 0.67 ms from the only such thread, 0.78 ms with a second one).
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import torch

from ..cache.paged import OutOfBlocks, PagedKVCache, blocks_for
from ..cache.prefix import PrefixCachingAllocator
from ..errors import ContextLengthError, OptionValueError
from ..sampling.pick import SamplingParams
from ..speculative.drafters import PromptLookup
from ..step.paged import MAX_AHEAD
from ..step.paged_forward import Row
from ..step.runner import usable_context
from .metrics import Metrics
from .model_runner import ModelRunner, ScheduledBatch
from .output import OutputProcessor
from .processors import NO_EXTRAS, Extras
from .result import GenerationResult
from .sampler import RowSampler
from .sequence import Delta, PromptLogprobs, Sequence, StopText


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``: the server answers 429."""


SPECULATIVE_METHODS = (None, "prompt_lookup")  # the drafters the loop can run (a draft model needs its own cache)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences admitted at once (prefilling or decoding)
    max_queue: int = 256  # requests waiting for admission before new ones are refused
    prefill_chunk: int = 256  # prompt tokens pushed through the model per step, over all sequences
    # a request's tokens do not depend on which others share its batch: decode rows read a fixed
    # span of slots and a lone row is padded to ``min_rows`` (see model_runner.ModelRunner)
    batch_invariant: bool = False
    min_rows: int = 2
    prefix_caching: bool = True  # share cached full blocks of equal prefixes (prefix_cache.py)
    # decode steps a batch may run before the host reads its tokens (see steps_ahead); None: 8 on a GPU,
    # where each read is a sync the device idles through, and 1 on a CPU, where a read costs nothing
    decode_steps: int | None = None
    # speculative decoding (chapter 11) in the loop: "prompt_lookup" drafts up to ``speculative_tokens`` tokens
    # per greedy row from its own context, and one forward verifies them (see ``_with_drafts``); None: off
    speculative: str | None = None
    speculative_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "min_rows", "decode_steps", "speculative_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise OptionValueError(name, value, "a whole number >= 1")
        if self.decode_steps is not None and self.decode_steps > MAX_AHEAD:
            raise OptionValueError("decode_steps", self.decode_steps, f"at most {MAX_AHEAD} (a decode batch keeps "
                                   "that many picks for the host to read)")
        if self.speculative not in SPECULATIVE_METHODS:
            raise OptionValueError("speculative", self.speculative, "one of " + ", ".join(map(repr, SPECULATIVE_METHODS)))

    def steps_for(self, device) -> int:
        """``decode_steps`` on this device (its default where None)."""
        return self.decode_steps or (DECODE_STEPS_GPU if torch.device(device).type == "cuda" else 1)


DECODE_STEPS_GPU = 8  # vLLM's multi-step scheduling used 8 too; Engine.generate reads every 16


def served_result(seq: Sequence, text: str, reason: str, model) -> GenerationResult:
    """A finished sequence as ``GenerationResult``: TTFT from its arrival, decode rate after its first token."""
    first, last, n = seq.first_token_at, seq.last_token_at, len(seq.output_ids)
    rate = (n - 1) / (last - first) if first is not None and last is not None and n > 1 and last > first else 0.0
    return GenerationResult(list(seq.output_ids), text, len(seq.prompt_ids),
                            (first - seq.arrival) if first is not None else float("nan"), rate, reason,
                            "served", str(model.dtype).removeprefix("torch."), str(model.device))


class Scheduler:
    """The serving loop: the scheduler's bookkeeping (queues, admission, blocks, preemption, chunks)
    decides each step's ``ScheduledBatch``es, the ``ModelRunner`` executes them, and the
    ``OutputProcessor`` turns their tokens into events. ``compile_step`` and ``cuda_graph`` are
    the engine's own choice for its rung (``Engine.compile_step``, ``Engine.cuda_graph``)."""

    def __init__(self, model, tokenizer, cache: PagedKVCache, config: SchedulerConfig = SchedulerConfig(),
                 metrics: Metrics | None = None, max_model_len: int | None = None, compile_step: bool = False,
                 cuda_graph: bool = False, raise_errors: bool = False):
        self.tokenizer, self.cache, self.config = tokenizer, cache, config
        # a server reports a failed forward to the requests in it and goes on; an engine's caller gets the exception
        self.raise_errors = raise_errors
        self.metrics = metrics or Metrics()
        self.metrics.gauges = self.gauges
        if config.prefix_caching and not isinstance(cache.allocator, PrefixCachingAllocator):
            cache.allocator = PrefixCachingAllocator(cache.allocator.num_blocks, cache.block_size)
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.max_model_len = usable_context(model.config, max_model_len)
        read_len = blocks_for(self.max_model_len, cache.block_size) * cache.block_size
        invariant = dict(min_rows=config.min_rows, fixed_span=read_len) if config.batch_invariant else {}
        self.runner = ModelRunner(model, cache, self.max_model_len, compile_step, cuda_graph, **invariant)
        self.output = OutputProcessor(self.metrics, self.max_model_len, self._release)
        self.decode_steps = config.steps_for(self.device)
        # a batch-invariant server does not speculate: a verify forward's sums are not a decode step's
        self._speculates = bool(config.speculative) and not config.batch_invariant
        self.waiting: deque[Sequence] = deque()  # owned by the loop
        self.active: list[Sequence] = []  # admitted: they hold blocks; owned by the loop
        self._inbox: deque[Sequence] = deque()
        self._cancels: set[str] = set()
        self._wake = threading.Condition()
        self._stop = False
        self._ids = itertools.count()
        self.steps = 0
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- outside the loop
    def start(self) -> Scheduler:
        """Run the loop in a background thread (returns at once); again after ``stop``, too."""
        self._stop = False
        self._thread = threading.Thread(target=self.run, name="engine-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def release(self) -> None:
        """After ``stop``: let go of the model and the KV cache. FastAPI keeps every endpoint it has
        routed in module-level caches, and through their closures this scheduler, for the life of the
        process; a stopped server must not hold a model's memory with it (a notebook starts several)."""
        self.runner = self.cache = None

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                     stop: tuple[str, ...] = (), sink=None, request_id: str | None = None,
                     extras: Extras = NO_EXTRAS, grammar=None) -> Sequence:
        # its sampler's tensors are made by the loop, at admission (see the module's note on OpenMP)
        seq = Sequence(request_id or f"seq-{next(self._ids)}", list(prompt_ids), params, max_tokens,
                       StopText(self.tokenizer, tuple(stop), extras.include_stop_str), None,
                       sink or (lambda event: None), extras, grammar=grammar)
        if extras.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has nothing before it
        return seq

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; raises ``QueueFull`` when ``max_queue`` requests already wait, and
        ``ContextLengthError`` for one that could never fit (the HTTP layer refuses those first, with a 400)."""
        total = len(seq.prompt_ids) + seq.max_tokens
        if total > self.max_model_len or total > self.cache.capacity_tokens:
            raise ContextLengthError(f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.max_tokens}) = {total} "
                             f"does not fit: context {self.max_model_len}, KV cache {self.cache.capacity_tokens} tokens")
        with self._wake:
            if len(self._inbox) + len(self.waiting) >= self.config.max_queue:
                raise QueueFull(f"{self.config.max_queue} requests are already waiting")
            self._inbox.append(seq)
            self._wake.notify_all()

    def cancel(self, seq_id: str) -> None:
        """Drop a request (its client went away); its blocks are freed before the next step."""
        with self._wake:
            self._cancels.add(seq_id)
            self._wake.notify_all()

    def gauges(self) -> dict[str, float]:
        a = self.cache.allocator
        return {"requests_running": len(self.active), "requests_waiting": len(self.waiting) + len(self._inbox),
                "kv_blocks_free": a.num_free, "kv_blocks_total": a.usable, "kv_block_size": self.cache.block_size,
                "scheduler_steps_total": self.steps}

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams, max_tokens: int,
                 stop: tuple[str, ...] = (), timeout: float = 600.0) -> list[GenerationResult]:
        """Submit every prompt at once and wait for all of them (for checks and notebooks, no HTTP): the
        same ``GenerationResult`` as ``Engine.generate``, timed from each request's arrival."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        events: queue.Queue = queue.Queue()
        seqs = [self.new_sequence(p, sp, max_tokens, stop, sink=lambda ev, i=i: events.put((i, ev)))
                for i, (p, sp) in enumerate(zip(prompts, params))]
        for s in seqs:
            self.submit(s)
        texts, done = [[] for _ in seqs], {}
        deadline = time.monotonic() + timeout
        while len(done) < len(seqs):
            i, ev = events.get(timeout=max(deadline - time.monotonic(), 0.001))
            if isinstance(ev, Delta):
                texts[i].append(ev.text)
            else:
                done[i] = ev
        return [served_result(s, "".join(t), done[i].reason, self.runner.model) for i, (s, t) in enumerate(zip(seqs, texts))]

    # -------------------------------------------------------------------- the loop
    def drive(self, seqs: list[Sequence]) -> Iterator[None]:
        """The loop in the calling thread until every one of ``seqs`` is done, yielding after each step: for a
        caller that owns this scheduler and has all its requests at once (``LocalLoop``, ``Engine.generate``);
        no thread may run the loop meanwhile. A sequence still running when the caller stops early (or an
        exception comes out of a step) is cancelled, so its blocks come back."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("this scheduler's loop runs in a thread already: submit to it instead")
        try:
            for seq in seqs:
                self.submit(seq)
            while not all(s.done for s in seqs):
                with self._wake:
                    self._admit_inbox()
                self.step()
                yield
        finally:
            for seq in seqs:
                if not seq.done:
                    self._finish(seq, "cancelled")

    def _admit_inbox(self) -> None:
        """Move what ``submit`` queued into the waiting queue (the caller holds ``_wake``)."""
        self.waiting.extend(self._inbox)
        self._inbox.clear()

    def run(self) -> None:
        """The loop, in the calling thread, until ``stop``."""
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._cancels or self.waiting or self.active):
                    self._wake.wait()
                if self._stop:
                    break
                self._admit_inbox()
                cancels, self._cancels = self._cancels, set()
            self._apply_cancels(cancels)
            try:
                self.step()
            except Exception:  # never let one bad step take the server down
                traceback.print_exc(file=sys.stderr)
                for seq in list(self.active):
                    self._finish(seq, "error", "internal error in the scheduler step")
        for seq in [*self.active, *self.waiting, *self._inbox]:
            self._finish(seq, "error", "the server is shutting down")

    def _apply_cancels(self, ids: set[str]) -> None:
        for seq in [s for s in [*self.active, *self.waiting] if s.id in ids]:
            self._finish(seq, "cancelled")

    def step(self) -> None:
        """One step of the token loop: schedule, run, process the output."""
        self.steps += 1
        self._admit()
        for batch in self._schedule():  # lazily: a prefill's blocks are sealed before the next is planned
            self._execute(batch)

    def _execute(self, batch: ScheduledBatch) -> None:
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            if self.raise_errors:
                raise
            traceback.print_exc(file=sys.stderr)
            for seq in batch.seqs:
                self._finish(seq, "error", f"the forward pass failed: {type(exc).__name__}: {exc}")
            return
        # a batch that ran ahead or verified drafts knows which of its inputs count only after the output: below
        several = batch.steps > 1 or bool(batch.drafts)
        for seq, row in zip(batch.seqs, batch.rows):  # their keys and values are in the cache now
            if not several:
                seq.computed += len(row.tokens)
                if not seq.done:
                    self.cache.allocator.seal(seq.blocks, seq.tokens, seq.computed)  # full blocks become findable
        self.output.process(batch, result, self.device)
        if batch.drafts:
            self.metrics.speculated(sum(map(len, batch.drafts)), sum(map(len, result.ahead)))
        if several:  # the picks that ran ahead and the kept drafts were inputs too: all but a row's newest are cached
            for seq in batch.seqs:
                if not seq.done:
                    seq.computed = seq.length - 1
                    self.cache.allocator.seal(seq.blocks, seq.tokens, seq.computed)
        for seq in batch.seqs:
            if batch.prefill and seq.pending == 0 and seq.max_tokens == 0:  # echo only: the prompt's logprobs
                self._finish(seq, "length")

    def _admit(self) -> None:
        alloc = self.cache.allocator
        while self.waiting and len(self.active) < self.config.max_batch:
            seq = self.waiting[0]
            need = blocks_for(seq.length, self.cache.block_size)
            spare = 1 if self.active else 0  # keep one block for the running decodes' next token
            try:  # cached blocks of its prefix are shared: its prefill starts after them
                seq.blocks, seq.computed = alloc.acquire(seq.tokens, need, reserve=spare, share=self._shares(seq))
            except OutOfBlocks:
                break  # first come, first served: the head waits for blocks
            self.waiting.popleft()
            self.active.append(seq)
            if seq.sampler is None:
                seq.sampler = RowSampler(seq.params, self.vocab_size, self.device, seq.extras, seq.grammar)
                seq.sampler.observe(seq.prompt_ids)
            if self._shares(seq):
                self.metrics.prefix_cache(hit_tokens=seq.computed, query_tokens=seq.length)
            if seq.preemptions == 0:
                seq.admitted_at = time.perf_counter()
                self.metrics.tokens(prompt=len(seq.prompt_ids))
                self.metrics.queued(seq.admitted_at - seq.arrival)
                if seq.length == 1:  # a one-token prompt has no prefill: its echo is complete (and all) now
                    if seq.prompt_logprobs is not None:
                        self.output.send(seq, PromptLogprobs(tuple(seq.prompt_logprobs)))
                    if seq.max_tokens == 0:
                        self._finish(seq, "length")

    def _schedule(self) -> Iterator[ScheduledBatch]:
        """This step's forwards: prefill chunks (grouped, see ``_prefills``) and one decode batch of every
        sequence that needs exactly one token. When both run, the decode rows ride along in the first prefill
        forward (``riders``), one token each, their blocks given first; a batch-invariant server keeps them
        apart (a row's numbers must not depend on a prompt beside it)."""
        decode = [s for s in self.active if s.pending == 1]
        if decode and not self.config.batch_invariant and any(s.pending > 1 for s in self.active):
            riders = self._decode_batch(decode)  # may preempt the latest admitted, prefilling or not
            left = yield from self._prefills([s for s in self.active if s.pending > 1], riders)
            if left is not None:  # no prefill forward could take them (each prompt runs alone)
                yield from self._with_drafts(left)
            return
        prefill = [s for s in self.active if s.pending > 1]
        yield from self._prefills(prefill)
        decode = [s for s in decode if not s.done]
        batch = self._decode_batch(decode, 1 if prefill else self.steps_ahead(decode))
        if batch is not None:
            yield from self._with_drafts(batch)

    def steps_ahead(self, seqs: list[Sequence]) -> int:
        """How many steps this decode batch runs before the host reads its tokens: ``decode_steps``
        when no request waits (a new one would wait for them all), no row needs the host between
        tokens (a grammar's mask, logprobs, logit adjustments that count the tokens so far) and every
        row has that many tokens left to make; otherwise 1. A row that stops early (a stop token or
        string) drops the tokens made after it: at most ``decode_steps - 1`` steps of wasted work."""
        if self.decode_steps == 1 or not seqs or self.waiting or self._inbox:
            return 1
        if not all(self._no_host_between_tokens(s) for s in seqs):
            return 1
        if self._speculates and any(s.sampler.mode.greedy for s in seqs):
            return 1  # a greedy row drafts from the tokens so far, on the host, every step
        left = min(min(s.max_tokens - len(s.output_ids), self.max_model_len - s.length) for s in seqs)
        return max(1, min(self.decode_steps, left, MAX_AHEAD))

    @staticmethod
    def _no_host_between_tokens(seq: Sequence) -> bool:
        """No grammar mask, no logprobs, no logits adjustment that counts the tokens so far: the row's next
        tokens can be picked on the device, several before the host looks (run ahead, or verified drafts)."""
        return seq.sampler.in_step and seq.sampler.adjust is None and seq.extras.logprobs is None

    def _with_drafts(self, batch: ScheduledBatch) -> Iterator[ScheduledBatch]:
        """Speculative decoding: a greedy row that needs nothing of the host between tokens and finds a draft in its
        own context (``PromptLookup``: what followed the latest earlier occurrence of its last n-gram) verifies it
        instead of decoding one token. The verify rows run as one forward (``paged_forward``, every position's
        logits) and keep the longest prefix the model agrees with, plus the model's own next token; the others
        stay one decode batch. A draft gets blocks for its slots where they are free, else it is cut to the slots
        the row holds. Rejected drafts' slots are written over later; nothing is recomputed."""
        if not self._speculates or batch.steps > 1:
            yield batch
            return
        alloc, bs = self.cache.allocator, self.cache.block_size
        verify, plain = [], []
        for seq, row in zip(batch.seqs, batch.rows):
            draft = self._draft(seq)
            if draft:
                need = blocks_for(seq.computed + 1 + len(draft), bs) - len(seq.blocks)
                if need <= alloc.num_free:
                    seq.blocks += alloc.allocate(max(need, 0))
                else:
                    draft = draft[:max(len(seq.blocks) * bs - seq.computed - 1, 0)]
            if draft:
                verify.append((seq, Row([*row.tokens, *draft], row.start, seq.blocks), tuple(draft)))
            else:
                plain.append((seq, row))
        if verify:
            seqs, rows, drafts = zip(*verify)
            yield ScheduledBatch(seqs, rows, prefill=False, drafts=drafts)
        if plain:
            seqs, rows = zip(*plain)
            yield ScheduledBatch(seqs, rows, prefill=False)

    def _draft(self, seq: Sequence) -> list[int]:
        """Up to ``speculative_tokens`` drafted tokens for a greedy row, no more than it may still make after the
        model's own next token (``max_tokens``, the context); [] for a row that does not speculate."""
        if not (seq.sampler.mode.greedy and self._no_host_between_tokens(seq)):
            return []
        k = min(self.config.speculative_tokens, seq.max_tokens - len(seq.output_ids) - 1,
                self.max_model_len - seq.length)
        return PromptLookup.lookup(seq.tokens, k) if k > 0 else []

    def _prefills(self, seqs: list[Sequence], riders: ScheduledBatch | None = None
                  ) -> Generator[ScheduledBatch, None, ScheduledBatch | None]:
        """Up to ``prefill_chunk`` prompt tokens this step, in chunks that start at multiples of
        ``prefill_chunk``: a prompt is cut the same way however busy the server is, so its numbers do
        not depend on the other requests. The chunks run as one forward (the weights are read once
        for all of them), except a prompt that is scored (``echo``), every prompt of a batch-invariant
        server (a row's numbers must not depend on its neighbours), and a prompt whose first block
        matches a chunk already planned: it waits for that forward, so it finds the sibling's blocks.
        ``riders`` (a decode batch) join the first forward that is not a scored prompt's; returned if none did."""
        chunk, budget = self.config.prefill_chunk, self.config.prefill_chunk
        group: list[tuple[Sequence, Row, bool]] = []

        def batch_of(group):
            nonlocal riders
            batch = self._prefill_batch(group, None if group[0][0].scores_prompt else riders)
            if len(batch.rows) > len(group):
                riders = None
            return batch

        for seq in seqs:
            if budget <= 0:
                break
            if seq.done:
                continue
            alone = self.config.batch_invariant or seq.scores_prompt
            if group and (alone or self._awaits(seq, [g[0] for g in group])):
                yield batch_of(group)
                group = []
                if seq.done:
                    continue
            if self._shares(seq):  # blocks cached since admission (a sibling with the same prompt was first)
                found = self.cache.allocator.reuse(seq.blocks, seq.tokens, seq.computed)
                self.metrics.prefix_cache(hit_tokens=found - seq.computed, query_tokens=0)
                seq.computed = found
            n = min(seq.pending, chunk - seq.computed % chunk)
            budget -= n
            start = seq.computed
            ends = n == seq.pending and seq.max_tokens > 0  # the prompt's last chunk picks the first token
            group.append((seq, Row(seq.tokens[start:start + n], start, seq.blocks), ends))
            if alone:
                yield batch_of(group)
                group = []
        if group:
            yield batch_of(group)
        return riders

    @staticmethod
    def _prefill_batch(group: list[tuple[Sequence, Row, bool]], riders: ScheduledBatch | None = None
                       ) -> ScheduledBatch:
        seqs, rows, picks = zip(*group)
        if riders is not None:  # one-token rows: each picks its next token from its own last position
            seqs, rows, picks = seqs + riders.seqs, rows + riders.rows, picks + (True,) * len(riders.rows)
        return ScheduledBatch(seqs, rows, prefill=True, all_positions=seqs[0].scores_prompt, pick=picks)

    def _awaits(self, seq: Sequence, planned: list[Sequence]) -> bool:
        """Whether ``seq`` may find blocks that a planned chunk is about to compute (prefix caching
        only): its first full block equals that of a planned sequence that has not computed it yet.
        Blocks computed in an earlier forward are found already, so chat prompts that share a cached
        system prompt still run together."""
        bs = self.cache.block_size
        if not self._shares(seq) or seq.length < bs:
            return False
        return any(p.computed < bs and p.tokens[:bs] == seq.tokens[:bs] for p in planned)

    def _shares(self, seq: Sequence) -> bool:
        """Whether a sequence may start from cached blocks: not one that asks for its prompt's
        logprobs (``echo``), which needs the logits of every prompt position (as in vLLM)."""
        return self.config.prefix_caching and getattr(seq, "prompt_logprobs", None) is None

    def _decode_batch(self, seqs: list[Sequence], steps: int = 1) -> ScheduledBatch | None:
        """A block for each sequence's next token (preempting the latest admitted when none is
        free), then one batch of them all. Blocks for ``steps`` tokens each, where they are free;
        else one step."""
        alloc, bs = self.cache.allocator, self.cache.block_size
        if steps > 1 and sum(max(blocks_for(s.computed + steps, bs) - len(s.blocks), 0) for s in seqs) > alloc.num_free:
            steps = 1
        ready = []
        for seq in seqs:  # in admission order (``active`` is), so the earliest get blocks first
            if seq not in self.active:
                continue  # preempted for an earlier sequence's block
            need = blocks_for(seq.computed + steps, bs) - len(seq.blocks)
            while need > alloc.num_free:
                victim = self.active[-1]  # the latest admitted
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.active:
                seq.blocks += alloc.allocate(max(need, 0))
                ready.append(seq)
        if not ready:
            return None
        rows = tuple(Row([seq.last_token], seq.computed, seq.blocks) for seq in ready)
        return ScheduledBatch(tuple(ready), rows, prefill=False, steps=steps)

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and queue it first; it recomputes its tokens when readmitted
        (with prefix caching, only those past its blocks still cached)."""
        self.cache.allocator.free(seq.blocks)
        seq.blocks, seq.computed = [], 0
        seq.preemptions += 1
        self.active.remove(seq)
        self.waiting.appendleft(seq)
        self.metrics.preempted()

    def _finish(self, seq: Sequence, reason: str, message: str = "") -> None:
        self.output.finish(seq, reason, message)

    def _release(self, seq: Sequence) -> None:
        """A retired sequence leaves every queue and gives its blocks back."""
        if seq.blocks:
            self.cache.allocator.free(seq.blocks)
            seq.blocks = []
        for pool in (self.active, self.waiting, self._inbox):
            if seq in pool:
                pool.remove(seq)
