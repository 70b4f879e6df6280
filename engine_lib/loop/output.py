"""What happens to a token after the runner made it: text, stop checks, logprobs, metrics, events.

Defined in chapter 12 (serving many users); every generation's tokens pass through it, the naive
rung's included, so stops have this one implementation and the text is decoded once. The output
processor turns each ``StepResult`` (one token per row, or several when the batch ran ahead or kept
drafts) into the events a client sees (``Delta``, ``PromptLogprobs``, ``Finished``) through each
sequence's ``sink``, and retires the sequences that hit a stop token, a stop string or their
``max_tokens``. Retiring frees the sequence's blocks through ``release`` (the scheduler's).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

from ..errors import NonFiniteLogitsError
from .logprobs import token_logprobs
from .metrics import Metrics
from .model_runner import ScheduledBatch, StepResult
from .sequence import Delta, Finished, PromptLogprobs, Sequence


class OutputProcessor:
    def __init__(self, metrics: Metrics, max_model_len: int, release: Callable[[Sequence], None]):
        self.metrics, self.max_model_len, self.release = metrics, max_model_len, release

    def process(self, batch: ScheduledBatch, result: StepResult, device=None) -> None:
        """Apply one executed batch: errors for non-finite rows, prompt logprobs, then each new token."""
        for row in result.bad:
            self.finish(batch.seqs[row], "error", str(NonFiniteLogitsError("of this request", device)))
        if result.prompt_logits is not None:
            self.prompt_logprobs(batch.seqs[0], result.prompt_logits, batch.rows[0].start)
        now = time.perf_counter()
        for i, (seq, token) in enumerate(zip(batch.seqs, result.tokens)):
            if token is None or seq.done:
                continue
            if i in result.logprobs:
                seq.unsent_logprobs.append(result.logprobs[i])
            self.append(seq, token, now)
            for ahead in result.ahead[i] if result.ahead else ():
                if seq.done:  # a stop or max_tokens came first: the tokens made after it are dropped
                    break
                self.append(seq, ahead, now)

    def prompt_logprobs(self, seq: Sequence, logits, start: int) -> None:
        """Position p's logits score prompt token p + 1; sent once the whole prompt is scored."""
        del seq.prompt_entries[start + 1:]  # recomputed from the start after a preemption: score again
        end = min(start + len(logits), len(seq.prompt_ids) - 1)
        if end > start:
            nxt = seq.prompt_ids[start + 1:end + 1]
            k = seq.params.prompt_logprobs
            seq.prompt_entries += token_logprobs(logits[:end - start], nxt, [k] * len(nxt))
        if len(seq.prompt_entries) == len(seq.prompt_ids):
            self.send(seq, PromptLogprobs(tuple(seq.prompt_entries)))

    def append(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft(now - seq.arrival)
        else:
            self.metrics.inter_token(now - seq.last_token_at)
        seq.last_token_at = now
        seq.made += 1
        if token in seq.params.stop_token_ids:
            seq.unsent_logprobs.clear()  # the stop token is not part of the output
            self.send_text(seq, seq.text.flush())
            self.finish(seq, "stop")
            return
        seq.output_ids.append(token)
        self.metrics.tokens(generated=1)
        text, hit = seq.text.push(token, may_stop=len(seq.output_ids) >= seq.params.min_tokens)
        if hit:
            self.send_text(seq, text)
            self.finish(seq, "stop")
        elif len(seq.output_ids) >= seq.max_tokens or seq.length >= self.max_model_len:
            self.send_text(seq, text + seq.text.flush())
            self.finish(seq, "length")
        elif text:
            self.send_text(seq, text)

    def send_text(self, seq: Sequence, text: str) -> None:
        self.send(seq, Delta(text, len(seq.output_ids), tuple(seq.unsent_logprobs)))
        seq.unsent_logprobs.clear()

    def finish(self, seq: Sequence, reason: str, message: str = "") -> None:
        if seq.done:
            return
        seq.done, seq.finish_reason = True, reason
        self.release(seq)
        outcome = {"stop": "completed", "length": "completed"}.get(reason, reason)
        self.metrics.request(outcome)
        if outcome == "completed":
            self.metrics.finished(reason, time.perf_counter() - seq.arrival, len(seq.prompt_ids), len(seq.output_ids))
        self.send(seq, Finished(reason, len(seq.prompt_ids), len(seq.output_ids), message))

    @staticmethod
    def send(seq: Sequence, event) -> None:
        try:
            seq.sink(event)
        except Exception:  # a sink that fails (its client is gone) must not stop the loop
            traceback.print_exc(file=sys.stderr)
