"""Exercises of chapter 11 (speculative decoding): prompt lookup, greedy acceptance, the expected
tokens per round."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, SamplingState
from ..speculative import PromptLookup, verify_tokens
from ._grading import Mismatch, expect_close, expect_equal, grade, rand

SOLUTIONS = "11_speculative_decoding"
EXERCISES = [
    ("Prompt lookup", """\
Write `lookup(context, k, max_ngram=3)` that drafts up to `k` tokens from the context itself: find
the latest earlier occurrence of the context's last `n` tokens (try `n = max_ngram` first, then
shorter ones) and return the up-to-`k` tokens that followed it, or `[]` when nothing matches.
On which kinds of replies will this draft well?

```python
check.ex11_1(lookup)
```"""),
    ("Greedy acceptance", """\
Write `accept_greedy(logits, draft)` for the verify logits (k + 1, vocab) of `k` drafted tokens
`draft` (a list): return `(accepted, next_token)`, the number of drafts that equal the model's
greedy choice at their position, counted up to the first refusal, and the token the model chooses
right after them (its correction, or a bonus token when all `k` were accepted).

```python
check.ex11_2(accept_greedy)
```"""),
    ("Tokens per round", """\
If each draft is accepted with probability `alpha`, independently, a round of `k` drafts yields
the accepted prefix plus one token from the model. Write `expected_tokens(alpha, k)` that returns
the expected number of tokens per round. What does it give at `alpha = 0` and at `alpha = 1`,
and why is a large `k` wasted on a poor drafter?

```python
check.ex11_3(expected_tokens)
```"""),
]


def ex11_1(lookup) -> bool:
    runs = [("a repeated phrase", [1, 2, 3, 4, 5, 9, 2, 3, 4], 3, 3), ("no earlier match", [1, 2, 3, 4], 4, 3),
            ("the latest occurrence wins", [7, 8, 1, 7, 8, 2, 7, 8], 2, 3),
            ("fewer than k tokens follow", [5, 6, 5], 4, 3), ("one token of context (edge)", [42], 3, 3),
            ("a shorter n-gram when the longest fails", [1, 2, 9, 5, 2], 2, 3),
            ("max_ngram 1", [3, 1, 4, 1, 5, 9, 1], 2, 1)]
    cases = [(label, lambda c=c, k=k, n=n: expect_equal(list(lookup(list(c), k, n)), PromptLookup.lookup(c, k, n),
                                                        f"lookup({c}, k={k}, max_ngram={n})"))
             for label, c, k, n in runs]
    return grade("Exercise 11.1", cases, hint="for n from max_ngram down to 1, search start positions from the "
                                              "latest backwards, excluding the tail itself.")


def _engine_accept(logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    state = SamplingState(1, logits.shape[-1], logits.device)
    mode = state.load([SamplingParams()])
    accepted, nxt = verify_tokens(logits[None], torch.tensor([draft]), state, mode)
    return int(accepted[0]), int(nxt[0])


def ex11_2(accept_greedy) -> bool:
    logits = rand(5, 30, seed=1)
    best = logits.argmax(-1).tolist()
    other = [(t + 1) % 30 for t in best]
    runs = [("all 4 drafts accepted (a bonus token)", best[:4]), ("the first draft refused", [other[0]] + best[1:4]),
            ("refused at the third draft", best[:2] + [other[2], best[3]]),
            ("a later draft agrees after a refusal (it must not count)", [other[0], best[1], best[2], best[3]]),
            ("one draft, accepted", best[:1])]

    def check(draft):
        lg = logits[:len(draft) + 1]
        got = accept_greedy(lg.clone(), list(draft))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (accepted, next_token), got {got!r}")
        got = tuple(int(x) for x in got)
        expect_equal(got, _engine_accept(lg, list(draft)), f"(accepted, next_token) for draft {draft}")
    cases = [(label, lambda d=d: check(d)) for label, d in runs]
    return grade("Exercise 11.2", cases, hint="targets = logits.argmax(-1); count matches until the first miss; the "
                                              "next token is targets[accepted].")


def ex11_3(expected_tokens) -> bool:
    def want(a, k):
        return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)
    runs = [(0.8, 4), (0.5, 8), (0.0, 4), (1.0, 5), (0.95, 1)]
    cases = [(f"alpha {a}, k {k}", lambda a=a, k=k: expect_close(expected_tokens(a, k), want(a, k),
                                                                 "your expected tokens", rel=1e-6))
             for a, k in runs]
    return grade("Exercise 11.3", cases, hint="the i-th draft survives with probability alpha ** i; sum 1 + alpha "
                                              "+ ... + alpha ** k (and mind alpha == 1).")


