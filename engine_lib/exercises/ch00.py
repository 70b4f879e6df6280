"""Exercises of chapter 00 (introduction): comparing token lists, TTFT and decode rate, where a
prefill crosses the roofline's ridge."""

from __future__ import annotations

import dataclasses
import math

from ..model.checkpoints import REAL_CONFIG, preset_config
from ..model.config import Qwen2Config
from ._grading import Mismatch, expect_close, expect_equal, grade

SOLUTIONS = "00_introduction"
EXERCISES = [
    ("Where do two generations part? (warm-up)", """\
Write `first_difference(a, b)` that returns the first position where two token lists differ, or
`None` when they are equal. When one list is a prefix of the other, they part where the shorter
one ends. This is how every chapter compares its tokens with the ground truth.

```python
check.ex00_1(first_difference)
```"""),
    ("TTFT and decode rate (core)", """\
Write `ttft_and_rate(start, arrivals)`: given the time a request started and the times at which
its tokens arrived on the host, return `(ttft_s, decode_tokens_per_s)` as the engine reports
them. TTFT is the wait for the first token; the decode rate counts the tokens *after* the first,
per second after the first. With a single token there is no decode rate: return `float("nan")`.
Why does the first token not count towards the decode rate?

```python
check.ex00_2(ttft_and_rate)
```"""),
    ("When does a prefill become compute-bound? (stretch)", """\
Section 1 found the book's prompts below a T4's ridge. Write `compute_bound_from(cfg, ridge,
bytes_per_param)`: the shortest prompt (in tokens) whose prefill reaches `ridge` FLOP per byte
for a `Qwen2Config` with weights of `bytes_per_param` bytes, or `None` when no prompt up to
`cfg.max_position_embeddings` does. Count 2 FLOPs per weight per token, attention's own
4 x `hidden_size` FLOPs per layer for each (query, key it may see) pair, and every weight read
once per forward; remember that the engine applies the LM head to the last prompt position only.
(`forward_cost` in `engine_lib.book.roofline` counts all of this, and the keys and values read;
a count within 5% of its answer passes.) Where does the crossover move for int8
weights (1 byte), and why does a model whose parameters are mostly its LM head need thousands of
tokens? On a GPU, time `engine.logits(ids)` for prompts around your answer at the `half` rung:
where does the time per token stop falling?

```python
check.ex00_3(compute_bound_from)
```"""),
]


def _configs() -> list[tuple[str, Qwen2Config]]:
    real = Qwen2Config.from_json(REAL_CONFIG)
    return [("Qwen2.5-1.5B", real), ("the tiny checkpoint", preset_config("tiny")),
            ("an untied model", dataclasses.replace(real, tie_word_embeddings=False))]


def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ex00_1(first_difference) -> bool:
    pairs = [("equal lists", [5, 6, 7], [5, 6, 7]), ("a change in the middle", [5, 6, 7, 8], [5, 6, 9, 8]),
             ("a change at position 0", [1, 2], [3, 2]), ("a prefix", [5, 6, 7], [5, 6]),
             ("two empty lists", [], []), ("an empty list against one token", [], [4])]
    cases = [(label, lambda a=a, b=b: expect_equal(first_difference(list(a), list(b)), _first_difference(a, b),
                                                   f"first_difference({a}, {b})")) for label, a, b in pairs]
    return grade("Exercise 00.1", cases, hint="equal lists give None; a prefix parts where the shorter list ends.")


def _ttft_and_rate(start: float, arrivals: list[float]) -> tuple[float, float]:
    ttft = arrivals[0] - start
    n = len(arrivals)
    return ttft, (n - 1) / (arrivals[-1] - arrivals[0]) if n > 1 else float("nan")


def ex00_2(ttft_and_rate) -> bool:
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
    return grade("Exercise 00.2", cases, hint="n tokens give n - 1 decode steps, timed from the first token.")


def ex00_3(compute_bound_from) -> bool:
    from ..book.figures import H200, T4
    from ..book.roofline import compute_bound_from as engine_answer

    (real_name, real), (tiny_name, tiny), _ = _configs()
    short = dataclasses.replace(tiny, max_position_embeddings=512)
    runs = [(f"{real_name}, fp16 on a T4 (ridge {T4.ridge:.0f})", real, T4.ridge, 2),
            (f"{real_name}, bf16 on an H200 (ridge {H200.ridge:.0f})", real, H200.ridge, 2),
            (f"{real_name}, int8 weights on a T4", real, T4.ridge, 1),
            (f"{tiny_name} (mostly LM head), fp32, ridge 50", tiny, 50.0, 4),
            ("a device whose ridge is below 1 FLOP/B (edge: the first token already)", real, 0.5, 2),
            ("a 512-token model that never reaches a T4's ridge (edge)", short, T4.ridge, 2)]

    def check(cfg, ridge, nbytes):
        got, want = compute_bound_from(cfg, ridge, nbytes), engine_answer(cfg, ridge, nbytes)
        if want is None or want == 1:
            expect_equal(got, want, "your shortest compute-bound prompt")
        else:
            expect_close(got, want, "your shortest compute-bound prompt", rel=0.05)
    cases = [(label, lambda c=c, r=r, b=b: check(c, r, b)) for label, c, r, b in runs]
    return grade("Exercise 00.3", cases, hint="intensity(t) = FLOPs / bytes grows with t: FLOPs ~ 2 x layer weights x t "
                                              "+ 2 x LM head (one position), bytes ~ all weights once; find the first "
                                              "t at or over the ridge (None if not even at max_position_embeddings).")
