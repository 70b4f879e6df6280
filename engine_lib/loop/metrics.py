"""Server metrics in the Prometheus text format (``GET /metrics``), without a client library.

Defined in chapter 12 (serving many users). Counters: requests by outcome, successes by
finish reason, tokens in and out, preemptions, prefix-cache hits and queries (tokens; fed
by the paged cache through ``prefix_cache``), drafted and accepted speculative tokens.
Histograms: time to first token, inter-token latency, end-to-end latency, time in the queue,
prompt and generated tokens per request. Gauges (running and waiting requests, free KV blocks)
are read from the scheduler at scrape time. Every series carries a ``model_name`` label, as
vLLM's do, so one dashboard can tell servers apart.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable

SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, math.inf)
OUTCOMES = ("completed", "cancelled", "error", "rejected", "invalid")
FINISH_REASONS = ("stop", "length")
PREFIX = "engine"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.n = 0.0, 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.sum += value
        self.n += 1

    def lines(self, label: str) -> list[str]:
        h = f"{PREFIX}_{self.name}"
        out = [f"# HELP {h} {self.help}", f"# TYPE {h} histogram"]
        for edge, count in zip(self.buckets, self.counts):
            le = "+Inf" if math.isinf(edge) else repr(edge)
            out.append(f'{h}_bucket{{{label},le="{le}"}} {count}')
        return out + [f"{h}_sum{{{label}}} {self.sum}", f"{h}_count{{{label}}} {self.n}"]


class Metrics:
    def __init__(self, model_name: str = ""):
        self._lock = threading.Lock()
        self.model_name = model_name
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.successes = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_hits = self.prefix_queries = 0
        self.drafted = self.accepted = 0  # speculative decoding: tokens proposed, and kept by the model
        self.ttft_h = Histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl_h = Histogram("inter_token_latency_seconds", "Time between two tokens of a request.", SECONDS)
        self.e2e_h = Histogram("e2e_request_latency_seconds", "Arrival to the last token, requests that completed.",
                               SECONDS)
        self.queue_h = Histogram("request_queue_time_seconds", "Arrival to admission into the batch.", SECONDS)
        self.prompt_h = Histogram("request_prompt_tokens", "Prompt tokens per completed request.", TOKENS)
        self.gen_h = Histogram("request_generation_tokens", "Generated tokens per completed request.", TOKENS)
        self.gauges: Callable[[], dict[str, float]] = dict

    def request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def preempted(self) -> None:
        with self._lock:
            self.preemptions += 1

    def ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_h.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl_h.observe(seconds)

    def queued(self, seconds: float) -> None:
        with self._lock:
            self.queue_h.observe(seconds)

    def finished(self, reason: str, seconds: float, prompt_tokens: int, generated_tokens: int) -> None:
        """A request that completed (finish reason ``stop`` or ``length``)."""
        with self._lock:
            self.successes[reason] = self.successes.get(reason, 0) + 1
            self.e2e_h.observe(seconds)
            self.prompt_h.observe(prompt_tokens)
            self.gen_h.observe(generated_tokens)

    def prefix_cache(self, hit_tokens: int, query_tokens: int) -> None:
        """Prompt tokens found in the prefix cache, of those looked up (the hit rate is their ratio)."""
        with self._lock:
            self.prefix_hits += hit_tokens
            self.prefix_queries += query_tokens

    def speculated(self, drafted: int, accepted: int) -> None:
        """A verify forward's drafted tokens, and how many of them the model kept (vLLM's spec_decode counters)."""
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted

    def render(self) -> str:
        p, label = PREFIX, f'model_name="{self.model_name}"'
        with self._lock:
            lines = [f"# HELP {p}_requests_total Requests finished, by outcome.", f"# TYPE {p}_requests_total counter"]
            lines += [f'{p}_requests_total{{{label},outcome="{k}"}} {v}' for k, v in self.requests.items()]
            lines += [f"# HELP {p}_request_success_total Completed requests, by finish reason.",
                      f"# TYPE {p}_request_success_total counter"]
            lines += [f'{p}_request_success_total{{{label},finished_reason="{k}"}} {v}'
                      for k, v in self.successes.items()]
            for name, value, what in (("prompt_tokens_total", self.prompt_tokens, "Prompt tokens admitted."),
                                      ("generation_tokens_total", self.generation_tokens, "Tokens generated."),
                                      ("preemptions_total", self.preemptions, "Sequences preempted (blocks freed, "
                                       "recomputed later)."),
                                      ("prefix_cache_hits_total", self.prefix_hits, "Prompt tokens found in the "
                                       "prefix cache."),
                                      ("prefix_cache_queries_total", self.prefix_queries, "Prompt tokens looked up "
                                       "in the prefix cache."),
                                      ("spec_decode_draft_tokens_total", self.drafted, "Tokens drafted by speculative "
                                       "decoding."),
                                      ("spec_decode_accepted_tokens_total", self.accepted, "Drafted tokens the model "
                                       "kept.")):
                lines += [f"# HELP {p}_{name} {what}", f"# TYPE {p}_{name} counter", f"{p}_{name}{{{label}}} {value}"]
            for h in (self.ttft_h, self.itl_h, self.e2e_h, self.queue_h, self.prompt_h, self.gen_h):
                lines += h.lines(label)
        for name, value in self.gauges().items():
            lines += [f"# TYPE {p}_{name} gauge", f"{p}_{name}{{{label}}} {value}"]
        return "\n".join(lines) + "\n"


_MODEL_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*",?')


def parse(text: str, keep_model: bool = False) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (for tests and the load test). One server serves one
    model, so its ``model_name`` label is dropped from the keys unless ``keep_model``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if not keep_model:
                key = _MODEL_LABEL.sub("", key).replace("{}", "")
            out[key] = float(value)
    return out
