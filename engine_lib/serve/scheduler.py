"""Continuous batching: one loop owns the model and, every step, admits, prefills, decodes, retires.

Defined in chapter 12 (serving many users). Static batching runs a batch until its
longest request ends, so finished rows idle and new requests wait. Here the batch is
rebuilt every step:

1. apply cancellations (a client went away): free the sequence's blocks at once;
2. admit waiting requests while there is room in the batch and blocks for their prompt; with
   prefix caching, full blocks of the prompt that are cached already are shared, not computed;
3. prefill: push up to ``prefill_chunk`` prompt tokens through the model, in chunks, so a
   long prompt delays the running decodes by one chunk at a time, not by its whole length;
4. decode: one batched forward for every sequence that needs exactly one token; a sequence
   that needs a block when none is free preempts the most recently admitted one, whose
   blocks are freed and whose tokens are recomputed when it is admitted again;
5. retire sequences that hit a stop token, a stop string or ``max_tokens``.

A sequence that asks for logprobs gets them from the logits its token was picked from
(``logprobs``); one that asks for its prompt's logprobs (completions' ``echo``) has its
prefill return every position's logits, the others only the last one's.

The loop runs in a background thread; ``submit`` and ``cancel`` are thread-safe, and
events go out through each sequence's ``sink`` (which must not block).
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import ContextLengthError, NonFiniteLogitsError
from ..generate import non_finite_rows
from ..sampling import SamplingParams
from .batch_forward import Row, paged_forward
from .logprobs import token_logprobs
from .metrics import Metrics
from .paged_cache import OutOfBlocks, PagedKVCache, blocks_for
from .prefix_cache import PrefixCachingAllocator
from .processors import NO_EXTRAS, Extras
from .sampler import RowSampler, pick_rows
from .sequence import Delta, Finished, PromptLogprobs, Sequence, StopText


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``: the server answers 429."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences admitted at once (prefilling or decoding)
    max_queue: int = 256  # requests waiting for admission before new ones are refused
    prefill_chunk: int = 256  # prompt tokens pushed through the model per step, over all sequences
    # a request's tokens do not depend on which others share its batch: decode rows read a fixed
    # span of slots and a lone row is padded to ``min_rows`` (see batch_forward.paged_forward)
    batch_invariant: bool = False
    min_rows: int = 2
    prefix_caching: bool = True  # share cached full blocks of equal prefixes (prefix_cache.py)


@dataclass
class Result:
    """What ``Scheduler.generate`` returns for one request."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int


class Scheduler:
    def __init__(self, model, tokenizer, cache: PagedKVCache, config: SchedulerConfig = SchedulerConfig(),
                 metrics: Metrics | None = None, max_len: int | None = None):
        self.model, self.tokenizer, self.cache, self.config = model, tokenizer, cache, config
        self.metrics = metrics or Metrics()
        self.metrics.gauges = self.gauges
        if config.prefix_caching and not isinstance(cache.allocator, PrefixCachingAllocator):
            cache.allocator = PrefixCachingAllocator(cache.allocator.num_blocks, cache.block_size)
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.max_len = min(max_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.read_len = blocks_for(self.max_len, cache.block_size) * cache.block_size  # batch-invariant decode
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
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
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
        self.model = self.cache = None

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                     stop: tuple[str, ...] = (), sink=None, request_id: str | None = None,
                     extras: Extras = NO_EXTRAS, grammar=None) -> Sequence:
        sampler = RowSampler(params, self.vocab_size, self.device, extras, grammar)
        sampler.observe(prompt_ids)
        seq = Sequence(request_id or f"seq-{next(self._ids)}", list(prompt_ids), params, max_tokens,
                       StopText(self.tokenizer, tuple(stop), extras.include_stop_str), sampler,
                       sink or (lambda event: None), extras)
        if extras.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has nothing before it
        return seq

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; raises ``QueueFull`` when ``max_queue`` requests already wait, and
        ``ContextLengthError`` for one that could never fit (the HTTP layer refuses those first, with a 400)."""
        total = len(seq.prompt_ids) + seq.max_tokens
        if total > self.max_len or total > self.cache.capacity_tokens:
            raise ContextLengthError(f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.max_tokens}) = {total} "
                             f"does not fit: context {self.max_len}, KV cache {self.cache.capacity_tokens} tokens")
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
                 stop: tuple[str, ...] = (), timeout: float = 600.0) -> list[Result]:
        """Submit every prompt at once and wait for all of them (for checks and notebooks, no HTTP)."""
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
        return [Result(list(s.output_ids), "".join(t), done[i].reason, len(s.prompt_ids))
                for i, (s, t) in enumerate(zip(seqs, texts))]

    # -------------------------------------------------------------------- the loop
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._cancels or self.waiting or self.active):
                    self._wake.wait()
                if self._stop:
                    break
                self.waiting.extend(self._inbox)
                self._inbox.clear()
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
        """One scheduler step: admit, prefill a chunk, decode every ready sequence, retire."""
        self.steps += 1
        self._admit()
        prefill = [s for s in self.active if s.pending > 1]
        decode = [s for s in self.active if s.pending == 1]
        if prefill:
            self._prefill(prefill)
        if decode:
            self._decode(decode)

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
            if self._shares(seq):
                self.metrics.prefix_cache(hit_tokens=seq.computed, query_tokens=seq.length)
            if seq.preemptions == 0:
                seq.admitted_at = time.perf_counter()
                self.metrics.tokens(prompt=len(seq.prompt_ids))
                self.metrics.queued(seq.admitted_at - seq.arrival)
                if seq.length == 1:  # a one-token prompt has no prefill: its echo is complete (and all) now
                    if seq.prompt_logprobs is not None:
                        self._send(seq, PromptLogprobs(tuple(seq.prompt_logprobs)))
                    if seq.max_tokens == 0:
                        self._finish(seq, "length")

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Up to ``prefill_chunk`` prompt tokens this step, one sequence per forward, in chunks
        that start at multiples of ``prefill_chunk``: a prompt is cut the same way however busy
        the server is, so its numbers do not depend on the other requests."""
        chunk, budget = self.config.prefill_chunk, self.config.prefill_chunk
        for seq in seqs:
            if budget <= 0:
                break
            if self._shares(seq):  # blocks cached since admission (a sibling with the same prompt was first)
                found = self.cache.allocator.reuse(seq.blocks, seq.tokens, seq.computed)
                self.metrics.prefix_cache(hit_tokens=found - seq.computed, query_tokens=0)
                seq.computed = found
            n = min(seq.pending, chunk - seq.computed % chunk)
            budget -= n
            start, wants = seq.computed, seq.scores_prompt
            if wants:  # recomputed from the start after a preemption: score again from there
                del seq.prompt_logprobs[start + 1:]
            logits = self._forward([Row(seq.tokens[start:start + n], start, seq.blocks)], [seq], all_positions=wants)
            if logits is None:
                continue
            if wants:
                self._prompt_logprobs(seq, logits[0], start)
                logits = logits[:, -1]
            seq.computed += n
            if not seq.done:
                self.cache.allocator.seal(seq.blocks, seq.tokens, seq.computed)  # full blocks become findable
            if seq.pending == 0 and not seq.done:
                if seq.max_tokens == 0:  # echo only: the prompt's logprobs were all it asked for
                    self._finish(seq, "length")
                else:
                    self._pick(logits, [seq])

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """Position p's logits score prompt token p + 1; sent once the whole prompt is scored."""
        end = min(start + len(logits), len(seq.prompt_ids) - 1)
        if end > start:
            nxt = seq.prompt_ids[start + 1:end + 1]
            k = seq.extras.prompt_logprobs
            seq.prompt_logprobs += token_logprobs(logits[:end - start], nxt, [k] * len(nxt))
        if len(seq.prompt_logprobs) == len(seq.prompt_ids):
            self._send(seq, PromptLogprobs(tuple(seq.prompt_logprobs)))

    def _shares(self, seq: Sequence) -> bool:
        """Whether a sequence may start from cached blocks: not one that asks for its prompt's
        logprobs (``echo``), which needs the logits of every prompt position (as in vLLM)."""
        return self.config.prefix_caching and getattr(seq, "prompt_logprobs", None) is None

    def _decode(self, seqs: list[Sequence]) -> None:
        alloc, bs = self.cache.allocator, self.cache.block_size
        ready = []
        for seq in seqs:  # in admission order (``active`` is), so the earliest get blocks first
            if seq not in self.active:
                continue  # preempted for an earlier sequence's block
            need = blocks_for(seq.computed + 1, bs) - len(seq.blocks)
            while need > alloc.num_free:
                victim = self.active[-1]  # the latest admitted
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.active:
                seq.blocks += alloc.allocate(max(need, 0))
                ready.append(seq)
        if not ready:
            return
        logits = self._forward([Row([seq.last_token], seq.computed, seq.blocks) for seq in ready], ready)
        if logits is None:
            return
        for seq in ready:
            seq.computed += 1
            if not seq.done:
                alloc.seal(seq.blocks, seq.tokens, seq.computed)
        self._pick(logits, ready)

    def _forward(self, rows: list[Row], seqs: list[Sequence], all_positions: bool = False) -> torch.Tensor | None:
        options = dict(all_positions=all_positions)
        if self.config.batch_invariant and len(rows[0].tokens) == 1:
            options.update(min_rows=self.config.min_rows, read_len=self.read_len)
        try:
            logits = paged_forward(self.model, self.cache, rows, **options)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            for seq in seqs:
                self._finish(seq, "error", f"the forward pass failed: {type(exc).__name__}: {exc}")
            return None
        for row in non_finite_rows(logits):
            self._finish(seqs[row], "error", str(NonFiniteLogitsError("of this request", logits.device)))
        return logits

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        keep = [i for i, s in enumerate(seqs) if not s.done]
        tokens = pick_rows(logits[keep], [seqs[i].sampler for i in keep])
        wants = [j for j, i in enumerate(keep) if seqs[i].extras.logprobs is not None]
        if wants:  # of the raw logits, as vLLM reports by default (see logprobs)
            rows = [keep[j] for j in wants]
            for i, lp in zip(rows, token_logprobs(logits[rows], [tokens[j] for j in wants],
                                                  [seqs[i].extras.logprobs for i in rows])):
                seqs[i].unsent_logprobs.append(lp)
        now = time.perf_counter()
        for i, token in zip(keep, tokens):
            self._append(seqs[i], token, now)

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft(now - seq.arrival)
        else:
            self.metrics.inter_token(now - seq.last_token_at)
        seq.last_token_at = now
        if token in seq.params.stop_token_ids:
            seq.unsent_logprobs.clear()  # the stop token is not part of the output
            self._send_text(seq, seq.text.flush())
            self._finish(seq, "stop")
            return
        seq.output_ids.append(token)
        self.metrics.tokens(generated=1)
        text, hit = seq.text.push(token, may_stop=len(seq.output_ids) >= seq.extras.min_tokens)
        if hit:
            self._send_text(seq, text)
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.max_tokens or seq.length >= self.max_len:
            self._send_text(seq, text + seq.text.flush())
            self._finish(seq, "length")
        elif text:
            self._send_text(seq, text)

    def _send_text(self, seq: Sequence, text: str) -> None:
        self._send(seq, Delta(text, len(seq.output_ids), tuple(seq.unsent_logprobs)))
        seq.unsent_logprobs.clear()

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
        if seq.done:
            return
        seq.done = True
        if seq.blocks:
            self.cache.allocator.free(seq.blocks)
            seq.blocks = []
        for pool in (self.active, self.waiting, self._inbox):
            if seq in pool:
                pool.remove(seq)
        outcome = {"stop": "completed", "length": "completed"}.get(reason, reason)
        self.metrics.request(outcome)
        if outcome == "completed":
            self.metrics.finished(reason, time.perf_counter() - seq.arrival, len(seq.prompt_ids), len(seq.output_ids))
        self._send(seq, Finished(reason, len(seq.prompt_ids), len(seq.output_ids), message))

    @staticmethod
    def _send(seq: Sequence, event) -> None:
        try:
            seq.sink(event)
        except Exception:  # a sink that fails (its client is gone) must not stop the loop
            traceback.print_exc(file=sys.stderr)
