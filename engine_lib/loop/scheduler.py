"""Continuous batching's bookkeeping: queues, admission, the block budget and prefill chunks in, frozen
``ScheduledBatch``es out.

Defined in chapter 12 (serving many users). Static batching runs a batch until its longest request
ends, so finished rows idle and new requests wait. Here the batch is rebuilt every step (``admit``,
then ``schedule``):

1. admit waiting requests while there is room in the batch and blocks for their prompt; with
   prefix caching, full blocks of the prompt that are cached already are shared, not computed;
2. prefill: push up to ``prefill_chunk`` prompt tokens through the model, in chunks, so a long prompt
   delays the running decodes by one chunk at a time, not by its whole length; the chunks of several
   prompts run as one forward;
3. decode: one batched forward for every sequence that needs exactly one token; a sequence that needs
   a block when none is free preempts the most recently admitted one, whose blocks are freed and whose
   tokens are recomputed when it is admitted again. In a step that also prefills, these one-token rows
   ride along in the prefill's forward, as vLLM's chunked prefill does: the weights are read once for
   both. When nothing waits, nothing prefills and every row is picked inside the step, the batch runs
   ``decode_steps`` steps ahead before the host looks at its tokens (``steps_ahead``).

The scheduler holds no thread and no model: the engine core (``engine_core``) runs what it plans, and
tells it what ran (``on_forward``, ``on_output``). Its cache is either kind: the paged one gives a
sequence a block of 16 slots at a time, chapter 05's contiguous one a whole row at admission.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Iterator

import torch

from ..cache.blocks import OutOfBlocks, blocks_for
from ..cache.prefix import PrefixCachingAllocator
from ..step.decode import MAX_AHEAD
from ..step.forward import Row
from .config import SchedulerConfig
from .metrics import Metrics
from .model_runner import ScheduledBatch, StepResult
from .sampler import RowSampler
from .sequence import Sequence


class Scheduler:
    """Which sequences run this step, and how: the waiting queue, the admitted sequences and their blocks."""

    def __init__(self, cache, config: SchedulerConfig, max_model_len: int, metrics: Metrics, vocab_size: int,
                 device: torch.device):
        self.cache, self.config, self.max_model_len, self.metrics = cache, config, max_model_len, metrics
        if config.prefix_caching and not cache.one_block_per_sequence \
                and not isinstance(cache.allocator, PrefixCachingAllocator):
            cache.allocator = PrefixCachingAllocator(cache.allocator.num_blocks, cache.block_size)
        self.vocab_size, self.device = vocab_size, device
        self.decode_steps = config.steps_for(device)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []  # admitted: they hold blocks

    # ---------------------------------------------------------------- admission
    def admit(self) -> list[Sequence]:
        """Admit waiting sequences, first come first served, while the batch and the blocks have room;
        -> those admitted for the first time (their prompt tokens are counted from now)."""
        alloc, first = self.cache.allocator, []
        while self.waiting and len(self.active) < self.config.max_batch:
            seq = self.waiting[0]
            need = blocks_for(seq.length, self.cache.block_size)
            # keep one block for the running decodes' next token (a row of the contiguous cache holds it already)
            spare = 1 if self.active and not self.cache.one_block_per_sequence else 0
            try:  # cached blocks of its prefix are shared: its prefill starts after them
                seq.blocks, seq.computed = alloc.acquire(seq.tokens, need, reserve=spare, share=self._shares(seq))
            except OutOfBlocks:
                break  # the head waits for blocks
            self.waiting.popleft()
            self.active.append(seq)
            if seq.sampler is None:  # its tensors are made in the loop's thread (see serving.py on OpenMP)
                seq.sampler = RowSampler(seq.params, self.vocab_size, self.device, seq.matcher)
                seq.sampler.observe(seq.prompt_ids)
            if self._shares(seq):
                self.metrics.prefix_cache(hit_tokens=seq.computed, query_tokens=seq.length)
            if seq.preemptions == 0:
                seq.admitted_at = time.perf_counter()
                self.metrics.tokens(prompt=len(seq.prompt_ids))
                self.metrics.queued(seq.admitted_at - seq.arrival)
                first.append(seq)
        return first

    # ---------------------------------------------------------------- the plan
    def schedule(self) -> Iterator[ScheduledBatch]:
        """This step's forwards: prefill chunks (grouped, see ``_prefills``) and one decode batch of every
        sequence that needs exactly one token. When both run, the decode rows ride along in the first prefill
        forward (``riders``), one token each, their blocks given first; a batch-invariant server keeps them
        apart (a row's numbers must not depend on a prompt beside it). Lazily: a prefill's blocks are sealed
        (``on_forward``) before the next batch is planned."""
        decode = [s for s in self.active if s.pending == 1]
        if decode and not self.config.batch_invariant and any(s.pending > 1 for s in self.active):
            riders = self._decode_batch(decode)  # may preempt the latest admitted, prefilling or not
            left = yield from self._prefills([s for s in self.active if s.pending > 1], riders)
            if left is not None:  # no prefill forward could take them (each prompt runs alone)
                yield left
            return
        prefill = [s for s in self.active if s.pending > 1]
        yield from self._prefills(prefill)
        decode = [s for s in decode if not s.done]
        batch = self._decode_batch(decode, 1 if prefill else self.steps_ahead(decode))
        if batch is not None:
            yield batch

    def steps_ahead(self, seqs: list[Sequence]) -> int:
        """How many steps this decode batch runs before the host reads its tokens: ``decode_steps``
        when no request waits (a new one would wait for them all), no row needs the host between
        tokens (a grammar's mask, logprobs, logit adjustments that count the tokens so far, a draft)
        and every row has that many tokens left to make; otherwise 1. A row that stops early (a stop
        token or string) drops the tokens made after it: at most ``decode_steps - 1`` steps of wasted work."""
        if self.decode_steps == 1 or not seqs or self.waiting:
            return 1
        if not all(self.no_host_between_tokens(s) and not s.draft_k for s in seqs):
            return 1
        left = min(min(s.max_tokens - len(s.output_ids), self.max_model_len - s.length) for s in seqs)
        return max(1, min(self.decode_steps, left, MAX_AHEAD))

    @staticmethod
    def no_host_between_tokens(seq: Sequence) -> bool:
        """No grammar mask, no logprobs, no logits adjustment that counts the tokens so far: the row's next
        tokens can be picked on the device, several before the host looks (run ahead, or verified drafts)."""
        return seq.sampler.in_step and seq.sampler.adjust is None and seq.params.logprobs is None

    def draft_room(self, seq: Sequence, k: int) -> int:
        """Blocks for a row's newest token and ``k`` drafted ones, where they are free; -> how many drafted
        tokens fit (the slots the row holds cap a draft when no block is free)."""
        alloc, bs = self.cache.allocator, self.cache.block_size
        need = blocks_for(seq.computed + 1 + k, bs) - len(seq.blocks)
        if need <= alloc.num_free:
            seq.blocks += alloc.allocate(max(need, 0))
            return k
        return min(k, max(len(seq.blocks) * bs - seq.computed - 1, 0))

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
        return self.config.prefix_caching and not self.cache.one_block_per_sequence and seq.prompt_entries is None

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

    # ---------------------------------------------------------------- what ran
    def on_forward(self, batch: ScheduledBatch) -> None:
        """A batch's forward ran: its rows' keys and values are in the cache, and full blocks become findable.
        A batch that ran ahead or verified drafts knows which inputs count only after its output (``on_output``)."""
        if batch.steps > 1 or batch.drafts:
            return
        for seq, row in zip(batch.seqs, batch.rows):
            seq.computed += len(row.tokens)
            if not seq.done:
                self.cache.allocator.seal(seq.blocks, seq.tokens, seq.computed)

    def on_output(self, batch: ScheduledBatch, result: StepResult) -> None:
        """After the output processor took a batch's tokens: the picks that ran ahead and the kept drafts were
        inputs too, so all but a row's newest token are cached."""
        if batch.steps > 1 or batch.drafts:
            for seq in batch.seqs:
                if not seq.done:
                    seq.computed = seq.length - 1
                    self.cache.allocator.seal(seq.blocks, seq.tokens, seq.computed)

    def release(self, seq: Sequence) -> None:
        """A retired sequence leaves every queue and gives its blocks back."""
        if seq.blocks:
            self.cache.allocator.free(seq.blocks)
            seq.blocks = []
        for pool in (self.active, self.waiting):
            if seq in pool:
                pool.remove(seq)
