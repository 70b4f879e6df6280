"""Exercises of chapter 11 (speculative decoding): prompt lookup, greedy acceptance, the expected
tokens per round, and the draft length changed and its target forwards counted."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, SamplingState
from ..speculative import PromptLookup, verify_tokens
from ._grading import Mismatch, expect_close, expect_equal, grade, rand, tiny_engine
from .in_engine import lookup_in_engine

SOLUTIONS = "11_speculative_decoding"
EXERCISES = [
    ("Prompt lookup (core)", """\
Write `lookup(context, k, max_ngram=3)` that drafts up to `k` tokens from the context itself: find
the latest earlier occurrence of the context's last `n` tokens (try `n = max_ngram` first, then
shorter ones) and return the up-to-`k` tokens that followed it, or `[]` when nothing matches.
The check then drafts a real greedy reply with it (the tiny model): the reply and its logits must
be plain greedy's, drafted and accepted as the engine's own lookup does. On which replies will
this draft well?

```python
check.ex11_1(lookup)
```"""),
    ("Greedy acceptance (core)", """\
Write `accept_greedy(logits, draft)` for the verify logits (k + 1, vocab) of `k` drafted tokens
`draft` (a list): return `(accepted, next_token)`, the number of drafts that equal the model's
greedy choice at their position, counted up to the first refusal, and the token the model chooses
right after them (its correction, or a bonus token when all `k` were accepted).

```python
check.ex11_2(accept_greedy)
```"""),
    ("Tokens per round (warm-up)", """\
If each draft is accepted with probability `alpha`, independently, a round of `k` drafts yields
the accepted prefix plus one token from the model. Write `expected_tokens(alpha, k)` that returns
the expected number of tokens per round. What does it give at `alpha = 0` and at `alpha = 1`,
and why is a large `k` wasted on a poor drafter?

```python
check.ex11_3(expected_tokens)
```"""),
    ("Cap the draft length (stretch)", """\
Speculation spends compute to read the weights fewer times per token: count the reads. Write
`target_forwards(engine, prompt_ids, drafter, max_k, new_tokens)` that builds an engine over
`engine`'s model with the drafter (`Engine(engine.model, engine.tokenizer, engine.model_dir,
engine.stage, engine.device, speculative=drafter)`), generates `new_tokens` greedily
(`do_sample=False, stop_token_ids=[]`) with every draft capped at `max_k` tokens (the request's
`speculative_tokens=max_k`), and returns how many forwards of the target model the reply took, the
prefill included (`result.extra["target_forwards"]`). The check uses the tiny model with a drafter
that replays plain greedy's tokens (every draft right) and one that proposes nonsense (every draft
wrong), at several caps. How does the count fall as `max_k` grows, and with chapter 11's measured
verify cost, which cap would you pick on a CPU and on a GPU?

```python
check.ex11_4(target_forwards)
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
    cases.append(("the engine, your lookup drafting a greedy reply", lambda: lookup_in_engine(lookup)))
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


def ex11_4(target_forwards) -> bool:
    from ..engine import Engine
    from ..speculative import Replay

    engine = tiny_engine()
    prompt, n = list(range(1000, 1012)), 12
    greedy = engine.generate(prompt, max_new_tokens=n, do_sample=False, stop_token_ids=[]).token_ids
    nonsense = [(t + 7) % engine.config.vocab_size for t in greedy]  # (almost surely) never the greedy choice

    def want(drafter, max_k):
        spec = Engine(engine.model, engine.tokenizer, engine.model_dir, engine.stage, engine.device,
                      speculative=drafter)
        got = spec.generate(prompt, max_new_tokens=n, do_sample=False, stop_token_ids=[], speculative_tokens=max_k)
        return got.extra["target_forwards"]

    def check(tokens, max_k):
        expected = want(Replay([tokens]), max_k)
        got = target_forwards(engine, list(prompt), Replay([tokens]), max_k, n)
        expect_equal(got, expected, f"your target forwards (max_k={max_k})")
    runs = [("every draft right, max_k=1", greedy, 1), ("every draft right, max_k=4", greedy, 4),
            ("every draft right, max_k=8", greedy, 8), ("every draft wrong, max_k=2", nonsense, 2)]
    cases = [(label, lambda t=t, k=k: check(t, k)) for label, t, k in runs]
    return grade("Exercise 11.4", cases, hint="count the prefill too: it is a forward of the target model "
                                              "(result.extra['target_forwards'] does).")
