"""Exercises of chapter 00 (introduction): the decode ceiling, comparing token lists, TTFT and
decode rate."""

from __future__ import annotations

import dataclasses
import math

from ..checkpoints import REAL_CONFIG, preset_config
from ..config import Qwen2Config
from ._grading import Mismatch, expect_close, expect_equal, grade

SOLUTIONS = "00_introduction"
EXERCISES = [
    ("The decode ceiling", """\
At batch size 1 every decode step reads every weight once, so memory bandwidth divided by the
bytes of the weights bounds the tokens per second. Write `decode_ceiling(cfg, bytes_per_param,
bandwidth)` that returns that bound in tokens per second for a `Qwen2Config` (use
`cfg.num_parameters()`), a number of bytes per parameter and a bandwidth in bytes per second.
Then print it for the real model in bfloat16 on a T4 (`bandwidth=320e9`): how far is the
baseline of this chapter from it?

```python
check.ex00_1(decode_ceiling)
```"""),
    ("Where do two generations part?", """\
Write `first_difference(a, b)` that returns the first position where two token lists differ, or
`None` when they are equal. When one list is a prefix of the other, they part where the shorter
one ends. This is how every chapter compares its tokens with the ground truth.

```python
check.ex00_2(first_difference)
```"""),
    ("TTFT and decode rate", """\
Write `ttft_and_rate(start, arrivals)`: given the time a request started and the times at which
its tokens arrived on the host, return `(ttft_s, decode_tokens_per_s)` as the engine reports
them. TTFT is the wait for the first token; the decode rate counts the tokens *after* the first,
per second after the first. With a single token there is no decode rate: return `float("nan")`.
Why does the first token not count towards the decode rate?

```python
check.ex00_3(ttft_and_rate)
```"""),
]


def _configs() -> list[tuple[str, Qwen2Config]]:
    real = Qwen2Config.from_json(REAL_CONFIG)
    return [("Qwen2.5-1.5B", real), ("the tiny checkpoint", preset_config("tiny")),
            ("an untied model", dataclasses.replace(real, tie_word_embeddings=False))]


def ex00_1(decode_ceiling) -> bool:
    (real_name, real), (tiny_name, tiny), (untied_name, untied) = _configs()
    runs = [(real_name, real, 2, 320e9), (real_name, real, 4, 320e9), (tiny_name, tiny, 4, 50e9),
            (untied_name, untied, 2, 4.8e12)]
    cases = []
    for name, cfg, nbytes, bw in runs:
        def case(cfg=cfg, nbytes=nbytes, bw=bw):
            want = bw / (cfg.num_parameters() * nbytes)
            expect_close(decode_ceiling(cfg, nbytes, bw), want, "your ceiling")
        cases.append((f"{name}, {nbytes} bytes per parameter, {bw:.3g} B/s", case))
    return grade("Exercise 00.1", cases, hint="bytes per token = parameters x bytes per parameter; "
                                              "tokens/s = bandwidth / bytes per token.")


def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ex00_2(first_difference) -> bool:
    pairs = [("equal lists", [5, 6, 7], [5, 6, 7]), ("a change in the middle", [5, 6, 7, 8], [5, 6, 9, 8]),
             ("a change at position 0", [1, 2], [3, 2]), ("a prefix", [5, 6, 7], [5, 6]),
             ("two empty lists", [], []), ("an empty list against one token", [], [4])]
    cases = [(label, lambda a=a, b=b: expect_equal(first_difference(list(a), list(b)), _first_difference(a, b),
                                                   f"first_difference({a}, {b})")) for label, a, b in pairs]
    return grade("Exercise 00.2", cases, hint="equal lists give None; a prefix parts where the shorter list ends.")


def _ttft_and_rate(start: float, arrivals: list[float]) -> tuple[float, float]:
    ttft = arrivals[0] - start
    n = len(arrivals)
    return ttft, (n - 1) / (arrivals[-1] - arrivals[0]) if n > 1 else float("nan")


def ex00_3(ttft_and_rate) -> bool:
    runs = [("steady tokens", 10.0, [10.5, 10.6, 10.7, 10.8, 10.9]),
            ("a slow first token", 0.0, [2.0, 2.01, 2.02]),
            ("two tokens", 1.0, [1.25, 1.75]),
            ("a single token", 3.0, [3.5])]

    def check(start, arrivals):
        got = ttft_and_rate(start, list(arrivals))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (ttft_s, decode_tokens_per_s), got {got!r}")
        want = _ttft_and_rate(start, arrivals)
        expect_close(got[0], want[0], "your TTFT")
        if math.isnan(want[1]):
            if not (isinstance(got[1], float) and math.isnan(got[1])):
                raise Mismatch(f"with one token the decode rate is undefined (nan), yours is {got[1]!r}")
        else:
            expect_close(got[1], want[1], "your decode rate")
    cases = [(label, lambda s=s, a=a: check(s, a)) for label, s, a in runs]
    return grade("Exercise 00.3", cases, hint="n tokens give n - 1 decode steps, timed from the first token.")
