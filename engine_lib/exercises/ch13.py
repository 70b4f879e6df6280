"""Exercises of chapter 13 (an API for agents and evaluators): how many prompt tokens a prefix cache
skips, and scoring a continuation from logprobs the way an evaluation harness does."""

from __future__ import annotations

from ..cache.blocks import blocks_for
from ..cache.paged import RESERVED
from ..cache.prefix import PrefixCachingAllocator
from ..loop.logprobs import token_logprobs
from ._grading import Mismatch, expect_equal, grade, rand

SOLUTIONS = "13_api_for_agents"
EXERCISES = [
    ("What a prefix cache skips", """\
Request A's prompt has been computed, and its full blocks are in the prefix cache. Write
`cached_tokens(a, b, block_size)` for two lists of token ids that returns how many of request
B's prompt tokens B finds in the cache, so its prefill skips them: whole blocks of the prefix
B shares with A, and never the block that holds B's last token (that token's logits are needed,
so it is computed again).

```python
check.ex13_1(cached_tokens)
```"""),
    ("Score a continuation", """\
An evaluation harness asks how likely the model finds a continuation after a context. Write
`score(logits, ids, ctxlen)` for the logits of one forward pass over `ids` (shape
(len(ids), vocab), row *i* predicting token *i* + 1) that returns `(loglikelihood, is_greedy)`
for the tokens `ids[ctxlen:]`: the sum of their log-probabilities (natural log, the raw
distribution), and whether each of them is its position's most likely token. The check also
passes logits in float16 with large values.

```python
check.ex13_2(score)
```"""),
]


def ex13_1(cached_tokens) -> bool:
    def reference(a, b, bs):
        alloc = PrefixCachingAllocator(RESERVED + blocks_for(len(a), bs), bs)
        blocks = alloc.allocate(blocks_for(len(a), bs))
        alloc.seal(blocks, a, len(a))  # A's prompt is computed: its full blocks are keyed
        return len(alloc.lookup(b)) * bs

    system = list(range(100, 140))  # a 40-token system prompt
    runs = [("a 40-token system prompt, then different questions", system + [1, 2, 3], system + [7, 8], 16),
            ("the same 32-token prompt twice (edge: the last token's block)", system[:32], system[:32], 16),
            ("the same 33-token prompt twice", system[:33], system[:33], 16),
            ("B differs at its first token", system, [99] + system[1:], 16),
            ("B is longer than A, blocks of 4", system[:10], system[:10] + list(range(20)), 4),
            ("A shorter than one block", system[:7], system[:7] + [5, 6], 16)]

    def check(a, b, bs):
        expect_equal(cached_tokens(list(a), list(b), bs), reference(a, b, bs), "your cached tokens")
    cases = [(label, lambda a=a, b=b, bs=bs: check(a, b, bs)) for label, a, b, bs in runs]
    return grade("Exercise 13.1", cases, hint="count the common prefix, then stop before the block of B's "
                                              "last token: min(common, len(b) - 1) // block_size * block_size.")


def ex13_2(score) -> bool:
    import torch

    def reference(logits, ids, ctxlen):
        """Through the server's own logprobs: row i - 1 scores token i, with its top entry."""
        rows = token_logprobs(logits[ctxlen - 1:-1], ids[ctxlen:], [1] * (len(ids) - ctxlen))
        return sum(r.logprob for r in rows), all(r.top[0][0] == r.token for r in rows)

    def greedy_ids(logits, first):
        return [first] + logits.float().argmax(-1).tolist()[:-1]  # every token is the one its row liked most

    mixed = rand(12, 50, seed=1, scale=3.0)
    peaked = rand(9, 40, seed=2, scale=2.0)
    half = rand(10, 1000, seed=3, scale=30.0, dtype=torch.float16)
    some = (rand(12, seed=4).abs() * 10).long().remainder(50).tolist()
    runs = [("12 tokens, a 7-token context, a vocabulary of 50", mixed, some, 7),
            ("a continuation of one token (edge)", mixed, list(range(12)), 11),
            ("a greedy continuation", peaked, greedy_ids(peaked, 3), 4),
            ("float16 logits near 30, a vocabulary of 1,000", half, greedy_ids(half, 5)[:6] + [1, 2, 3, 4], 3)]

    def check(logits, ids, ctxlen):
        want_ll, want_greedy = reference(logits, ids, ctxlen)
        got = score(logits.clone(), list(ids), ctxlen)
        if not isinstance(got, tuple) or len(got) != 2:
            raise Mismatch(f"you returned {got!r}, expected a pair (loglikelihood, is_greedy)")
        ll, greedy = float(got[0]), bool(got[1])
        if abs(ll - want_ll) > 1e-3:  # float32 sums agree far closer; float16 log-probs are 0.03 apart near -50
            raise Mismatch(f"your log-likelihood is {ll:.4f}, expected {want_ll:.4f} (for "
                           f"{len(ids) - ctxlen} continuation token(s))")
        expect_equal(greedy, want_greedy, "your is_greedy")
    cases = [(label, lambda lg=lg, ids=ids, c=c: check(lg, ids, c)) for label, lg, ids, c in runs]
    return grade("Exercise 13.2", cases, hint="row i - 1 predicts token i: logits.float().log_softmax(-1)"
                                              "[ctxlen - 1:-1] gathered at ids[ctxlen:], summed; greedy when each "
                                              "token is its row's argmax.")
