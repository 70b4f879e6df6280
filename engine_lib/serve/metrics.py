"""Server counters in the Prometheus text format (``GET /metrics``), without a client library.

Defined in chapter 12 (serving many users): requests by outcome, tokens in and out, a
time-to-first-token histogram, preemptions, and the scheduler's gauges (running and
waiting requests, free KV blocks), read at scrape time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)
OUTCOMES = ("completed", "cancelled", "error", "rejected", "invalid")
PREFIX = "engine"


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_n = 0
        self.prefix_hits = self.prefix_queries = 0
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

    def prefix_cache(self, hit_tokens: int, query_tokens: int) -> None:
        """Prompt tokens found in the prefix cache, of those looked up (the hit rate is their ratio)."""
        with self._lock:
            self.prefix_hits += hit_tokens
            self.prefix_queries += query_tokens

    def ttft(self, seconds: float) -> None:
        with self._lock:
            for i, edge in enumerate(TTFT_BUCKETS):
                if seconds <= edge:
                    self.ttft_counts[i] += 1
            self.ttft_sum += seconds
            self.ttft_n += 1

    def render(self) -> str:
        p = PREFIX
        with self._lock:
            lines = [f"# HELP {p}_requests_total Requests finished, by outcome.", f"# TYPE {p}_requests_total counter"]
            lines += [f'{p}_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            for name, value, what in (("prompt_tokens_total", self.prompt_tokens, "Prompt tokens admitted."),
                                      ("generation_tokens_total", self.generation_tokens, "Tokens generated."),
                                      ("preemptions_total", self.preemptions, "Sequences preempted (blocks freed, "
                                       "recomputed later)."),
                                      ("prefix_cache_hits_total", self.prefix_hits, "Prompt tokens found in the "
                                       "prefix cache."),
                                      ("prefix_cache_queries_total", self.prefix_queries, "Prompt tokens looked up "
                                       "in the prefix cache.")):
                lines += [f"# HELP {p}_{name} {what}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
            h = f"{p}_time_to_first_token_seconds"
            lines += [f"# HELP {h} Arrival to first generated token.", f"# TYPE {h} histogram"]
            for edge, count in zip(TTFT_BUCKETS, self.ttft_counts):
                le = "+Inf" if math.isinf(edge) else repr(edge)
                lines.append(f'{h}_bucket{{le="{le}"}} {count}')
            lines += [f"{h}_sum {self.ttft_sum}", f"{h}_count {self.ttft_n}"]
        for name, value in self.gauges().items():
            lines += [f"# TYPE {p}_{name} gauge", f"{p}_{name} {value}"]
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (for tests and the load test)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
