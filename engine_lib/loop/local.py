"""The token loop run in the caller's thread: how ``Engine.generate`` and ``Engine.stream`` make tokens.

Defined in chapter 12 (serving many users). The server runs the loop in a thread of its own and feeds
it requests as they arrive. An engine's caller has all its prompts at once and waits for them, so
``LocalLoop`` queues them on the same ``Scheduler``, steps it in the calling thread until they are done
(``Scheduler.drive``), and hands back each sequence: its tokens, their times and how it finished. The
paged cache is sized for the call (every row's prompt and new tokens, rounded up to ``CACHE_BUCKET``
positions, in blocks, and the two reserved blocks) and kept while calls need that size, so its buffers and
captured graphs are reused, as chapter 05's contiguous cache is.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..cache.paged import BLOCK_SIZE, RESERVED, PagedKVCache, blocks_for
from ..errors import NonFiniteLogitsError
from ..sampling.pick import SamplingParams
from ..step.paged import BATCH_BUCKETS
from ..step.runner import CACHE_BUCKET
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Delta, Finished, Sequence


class LocalLoop:
    def __init__(self, model, tokenizer, max_model_len: int, compile_step: bool = False, cuda_graph: bool = False):
        self.model, self.tokenizer, self.max_model_len = model, tokenizer, max_model_len
        self.compile_step, self.cuda_graph = compile_step, cuda_graph
        # every prompt of a call is admitted at once and prefilled whole, in one forward (the cache holds them
        # all); a call's prompts share no cached prefix with the last call's, so each call does the same work
        self.config = SchedulerConfig(max_batch=BATCH_BUCKETS[-1], max_queue=BATCH_BUCKETS[-1],
                                      prefill_chunk=max_model_len, prefix_caching=False)
        self.scheduler: Scheduler | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return self.scheduler.cache.nbytes if self.scheduler is not None else 0

    def scheduler_for(self, rows: int, needed: int) -> Scheduler:
        """A scheduler whose paged cache holds ``rows`` sequences of ``needed`` positions (a new one, and a new
        cache, when the call needs another size)."""
        length = min(-(-needed // CACHE_BUCKET) * CACHE_BUCKET, self.max_model_len)
        blocks = rows * blocks_for(length, BLOCK_SIZE) + RESERVED
        if self.scheduler is None or self.scheduler.cache.allocator.num_blocks != blocks:
            self.scheduler = None  # free the old cache (and its graphs) before allocating the new one
            cfg = self.model.config
            cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks,
                                 self.model.dtype, self.model.device)
            self.scheduler = Scheduler(self.model, self.tokenizer, cache, self.config, max_model_len=self.max_model_len,
                                       compile_step=self.compile_step, cuda_graph=self.cuda_graph, raise_errors=True)
        return self.scheduler

    def run(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, reads_every: int = 1
            ) -> Iterator[tuple[list[Sequence], list[list[str]]]]:
        """Queue every prompt and step the loop until all are done. After each step, yields the sequences and
        the text each made in it (whole characters, from the output processor). ``reads_every``: decode steps
        the loop may run before the host reads the tokens (``Scheduler.steps_ahead``): a caller that waits for
        the whole reply loses nothing by it, one that streams wants every token as it comes (1). Raises
        ``NonFiniteLogitsError`` when a row's logits held NaN or Inf (naming the rows), and whatever a
        forward raised."""
        sched = self.scheduler_for(len(prompts), max(map(len, prompts)) + max_new_tokens)
        sched.decode_steps = reads_every
        texts: list[list[str]] = [[] for _ in prompts]
        failed: list[int] = []

        def sink(event, row: int) -> None:
            if isinstance(event, Delta) and event.text:
                texts[row].append(event.text)
            elif isinstance(event, Finished) and event.reason == "error":
                failed.append(row)

        seqs = [sched.new_sequence(p, params, max_new_tokens, sink=lambda ev, i=i: sink(ev, i))
                for i, p in enumerate(prompts)]
        for _ in sched.drive(seqs):
            if failed:
                made = max(len(s.output_ids) for s in seqs)
                raise NonFiniteLogitsError(f"before generated token {made + 1} (batch rows {sorted(failed)})",
                                           self.model.device)
            yield seqs, texts
            for t in texts:
                t.clear()
