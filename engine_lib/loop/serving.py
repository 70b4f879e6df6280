"""The token loop in a thread of its own, fed by the server as requests arrive.

Defined in chapter 12 (serving many users). ``ServingLoop`` wraps an ``EngineCore``: ``submit`` and
``cancel`` may be called from any thread (the HTTP handlers'), the loop runs in one (``run``: the server's
main thread; ``start``: a background one, as in a notebook), and events go out through each sequence's
``sink``, which must not block. ``generate`` is the synchronous way in, for checks and notebooks: submit
every prompt at once and wait for all of them.

All of the model's work, each request's sampler included, runs in the loop's thread: PyTorch's CPU
kernels run on OpenMP, and GNU OpenMP, once two threads of a process have run parallel work on a CPU
with fewer cores than their teams, stops spinning between parallel regions and wakes its threads from
sleep for each one (measured on a 2-core host: a (8960, 1536) matvec 0.67 ms from the only such thread,
0.78 ms with a second one).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import deque

from ..sampling import SamplingParams
from .engine_core import EngineCore
from .metrics import Metrics
from .result import GenerationResult, result_of
from .scheduler import SchedulerConfig
from .sequence import Delta, Sequence


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``: the server answers 429."""


class ServingLoop:
    def __init__(self, model, tokenizer, cache, config: SchedulerConfig | None = None,
                 metrics: Metrics | None = None, max_model_len: int | None = None, compile_step: bool = False,
                 cuda_graph: bool = False):
        self.core = EngineCore(model, tokenizer, cache, config, metrics, max_model_len, compile_step, cuda_graph)
        self.core.metrics.gauges = self.gauges
        self._inbox: deque[Sequence] = deque()
        self._cancels: set[str] = set()
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # what the server reads of the loop
    config = property(lambda self: self.core.config)
    metrics = property(lambda self: self.core.metrics)
    cache = property(lambda self: self.core.cache)
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    max_model_len = property(lambda self: self.core.max_model_len)
    vocab_size = property(lambda self: self.core.vocab_size)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, sink=None, request_id: str | None = None,
                     matcher=None) -> Sequence:
        return self.core.new_sequence(prompt_ids, params, sink, request_id, matcher)

    # ---------------------------------------------------------------- any thread
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; raises ``QueueFull`` when ``max_queue`` requests already wait, and
        ``ContextLengthError`` for one that could never fit."""
        self.core.check_fits(seq)
        with self._wake:
            if len(self._inbox) + len(self.core.scheduler.waiting) >= self.config.max_queue:
                raise QueueFull(f"{self.config.max_queue} requests are already waiting")
            self._inbox.append(seq)
            self._wake.notify_all()

    def cancel(self, seq_id: str) -> None:
        """Drop a request (its client went away); its blocks are freed before the next step."""
        with self._wake:
            self._cancels.add(seq_id)
            self._wake.notify_all()

    def gauges(self) -> dict[str, float]:
        out = self.core.gauges()
        out["requests_waiting"] += len(self._inbox)
        return out

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 timeout: float = 600.0) -> list[GenerationResult]:
        """Submit every prompt at once and wait for all of them (each ``params`` with its ``max_tokens``): the
        same ``GenerationResult`` as ``Engine.generate``, timed from each request's arrival."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        events: queue.Queue = queue.Queue()
        seqs = [self.new_sequence(p, sp, sink=lambda ev, i=i: events.put((i, ev)))
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
        model = self.core.runner.model
        return [result_of(s, "".join(t), s.arrival, "served", str(model.dtype).removeprefix("torch."), str(model.device))
                for s, t in zip(seqs, texts)]

    # ---------------------------------------------------------------- the loop's thread
    def start(self) -> ServingLoop:
        """Run the loop in a background thread (returns at once); again after ``stop``, too."""
        self._stop = False
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
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
        routed in module-level caches, and through their closures this loop, for the life of the
        process; a stopped server must not hold a model's memory with it (a notebook starts several)."""
        self.core = None

    def run(self) -> None:
        """The loop, in the calling thread, until ``stop``."""
        core = self.core
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._cancels or core.scheduler.waiting
                           or core.scheduler.active):
                    self._wake.wait()
                if self._stop:
                    break
                core.scheduler.waiting.extend(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, set()
            core.cancel(cancels)
            try:
                core.step()
            except Exception:  # never let one bad step take the server down
                traceback.print_exc(file=sys.stderr)
                for seq in list(core.scheduler.active):
                    core.output.finish(seq, "error", "internal error in the loop's step")
        for seq in [*core.scheduler.active, *core.scheduler.waiting, *self._inbox]:
            core.output.finish(seq, "error", "the server is shutting down")
