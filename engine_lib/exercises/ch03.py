"""Exercises of chapter 03 (attention): RoPE, the causal mask of new queries over a cache,
grouped-query attention."""

from __future__ import annotations

import torch

from ..cache.contiguous import visible_slots
from ..model.layers.attention import explicit_attention
from ..model.layers.rope import RotaryEmbedding, apply_rope
from ._grading import expect_tensor, grade, rand

SOLUTIONS = "03_attention"
EXERCISES = [
    ("RoPE from scratch (core)", """\
Write `rope(x, positions, theta)` for `x` of shape (batch, heads, seq, head_dim) and `positions`
(seq,) that rotates the pair (x[i], x[i + head_dim/2]) by the angle `p * theta**(-2i/head_dim)`:
the "rotate half" pairing of Qwen2. Compute the angles in float32. What does position 0 do to a
vector? Try the interleaved pairing (2j, 2j+1) too and read the verdict.

```python
check.ex03_1(rope)
```"""),
    ("Which keys may a query see? (warm-up)", """\
Write `causal_mask(q_len, kv_len)` that returns a bool tensor (q_len, kv_len), True where a query
may attend to a key, when the `q_len` queries are the *last* `q_len` positions of the `kv_len`
keys (a prefill has `q_len == kv_len`, a decode step `q_len == 1`, a verify step a few). Compare
with `torch.ones(q_len, kv_len, dtype=torch.bool).tril()`, which is what
`scaled_dot_product_attention(..., is_causal=True)` uses: which one does a decode step need?

```python
check.ex03_2(causal_mask)
```"""),
    ("Grouped-query attention (stretch)", """\
Write `gqa_attention(q, k, v)` for q (batch, heads, q_len, head_dim) and k, v (batch, kv_heads,
kv_len, head_dim), where each group of `heads // kv_heads` consecutive query heads shares one
key/value head, with the causal mask of the previous exercise and the softmax in float32.

```python
check.ex03_3(gqa_attention)
```"""),
]


def ex03_1(rope) -> bool:
    runs = [("head_dim 8, positions 0..5", rand(1, 2, 6, 8, seed=1), torch.arange(6), 1e6),
            ("position 0 only (no rotation)", rand(2, 1, 1, 16, seed=2), torch.tensor([0]), 1e6),
            ("head_dim 64, positions far apart", rand(1, 3, 4, 64, seed=3), torch.tensor([7, 100, 2048, 30000]), 1e6),
            ("theta 10,000", rand(1, 1, 5, 32, seed=4), torch.arange(10, 15), 1e4)]

    def check(x, pos, theta):
        table = RotaryEmbedding(x.shape[-1], int(pos.max()) + 1, theta)
        cos, sin = table(pos[None], torch.float32)  # (1, 1, seq, head_dim)
        expect_tensor(rope(x.clone(), pos.clone(), theta), apply_rope(x, cos, sin), "your rotated x",
                      atol=1e-4, rtol=1e-4)
    cases = [(label, lambda x=x, p=p, t=t: check(x, p, t)) for label, x, p, t in runs]
    return grade("Exercise 03.1", cases, hint="angles = outer(positions, inv_freq), repeated for both halves; "
                                              "x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).")


def _mask(q_len: int, kv_len: int) -> torch.Tensor:
    cache_pos = torch.arange(kv_len - q_len, kv_len)[None]  # the new tokens are the last slots
    return visible_slots(cache_pos, None, kv_len)[0, 0]


def ex03_2(causal_mask) -> bool:
    sizes = [("a prefill of 5", 5, 5), ("4 new queries over 10 keys", 4, 10), ("a decode step over 7 keys", 1, 7),
             ("one token alone", 1, 1)]
    cases = [(label, lambda q=q, s=s: expect_tensor(causal_mask(q, s), _mask(q, s), f"causal_mask({q}, {s})"))
             for label, q, s in sizes]
    return grade("Exercise 03.2", cases, hint="query i sits at position kv_len - q_len + i and sees keys up to "
                                              "and including that position: tril(diagonal=kv_len - q_len).")


def ex03_3(gqa_attention) -> bool:
    runs = [("4 heads, 4 KV heads, a prefill of 6", (1, 4, 6, 8), (1, 4, 6, 8)),
            ("6 query heads sharing 2 KV heads, a prefill of 9", (2, 6, 9, 16), (2, 2, 9, 16)),
            ("a decode step: 1 query over 12 keys", (1, 6, 1, 16), (1, 2, 12, 16)),
            ("a verify step: 4 queries over 10 keys", (1, 4, 4, 8), (1, 2, 10, 8))]

    def check(qs, ks):
        q, k, v = rand(*qs, seed=1), rand(*ks, seed=2), rand(*ks, seed=3)
        expect_tensor(gqa_attention(q.clone(), k.clone(), v.clone()), explicit_attention(q, k, v, None, True),
                      "your output", atol=1e-5, rtol=1e-4)
    cases = [(label, lambda q=q, k=k: check(q, k)) for label, q, k in runs]
    return grade("Exercise 03.3", cases, hint="query head h uses KV head h // (heads // kv_heads) "
                                              "(k.repeat_interleave(groups, dim=1)); scale by head_dim ** -0.5.")
