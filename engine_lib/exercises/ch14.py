"""Exercises of chapter 14 (writing our own kernels): an RMSNorm kernel in Triton, merging split-KV
partials by their log-sum-exps, the bytes a decode-attention call must move."""

from __future__ import annotations

import torch

from ..model.layers.rmsnorm import RMSNorm
from ._grading import Mismatch, expect_equal, expect_tensor, grade, rand

SOLUTIONS = "14_writing_kernels"
EXERCISES = [
    ("An RMSNorm kernel", """\
Write a Triton kernel and its launcher `my_rmsnorm(x, weight, eps)` for `x` of shape
(rows, hidden): one program per row, a block of `triton.next_power_of_2(hidden)` offsets with a
mask, the mean of squares accumulated in float32, and the output in `weight`'s dtype, as
`RMSNorm.forward` computes it. The check runs it on the GPU, or on the CPU under Triton's
interpreter (`TRITON_INTERPRET=1`, set before Triton is first imported), on a hidden size that
is not a power of two, in half precision, and on a row of zeros. What would go wrong if you
divided the sum of squares by the block size instead of by `hidden`?

```python
check.ex14_1(my_rmsnorm)
```"""),
    ("Merge the chunks", """\
A split-KV kernel cuts the keys into chunks. For chunk *c* it returns the chunk's attention
output `outs[c]` (softmax over the chunk's keys only) and the chunk's log-sum-exp of the scores
`lses[c]` (natural log). Write `merge_partials(outs, lses)` for `outs` (chunks, heads, head_dim)
and `lses` (chunks, heads) that returns the full attention output (heads, head_dim). A chunk with
no visible key has `lse = -inf` and must count for nothing, and scores near 1,000 must not
overflow.

```python
check.ex14_2(merge_partials)
```"""),
    ("Count the bytes", """\
Write `decode_attention_bytes(batch, heads, kv_heads, q_len, head_dim, kv_len, dtype_bytes)`:
the least traffic one decode-attention call can make, reading every key and value of the span
once, reading the queries and writing the outputs once (no partials, no mask). With grouped-query
attention, how many times is each key read? Then compute, for the real model at 4,096 tokens of
context, how the attention of all 28 layers compares with the weights' bytes.

```python
check.ex14_3(decode_attention_bytes)
```"""),
]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _half() -> torch.dtype:
    """bf16 where the GPU does it natively (and on the CPU interpreter), else fp16 (a T4)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return torch.float16
    return torch.bfloat16


def ex14_1(my_rmsnorm) -> bool:
    from ..kernels import unavailable_reason

    device, half = _device(), _half()

    def can_run():
        reason = unavailable_reason(device, half)
        if reason:
            raise Mismatch(f"Triton cannot run here: {reason}")

    def check(rows, hidden, dtype, zero_row=False):
        x = rand(rows, hidden, seed=hidden, scale=3.0).to(device, dtype)
        if zero_row:
            x[0] = 0
        weight = (rand(hidden, seed=hidden + 1) + 1).to(device, dtype)
        norm = RMSNorm(hidden, 1e-6).to(device)
        norm.weight.data = weight.clone()
        with torch.no_grad():
            want = norm(x)
        got = my_rmsnorm(x.clone(), weight.clone(), 1e-6)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        expect_tensor(got, want, "your normed output", atol=tol, rtol=tol)

    cases = [("this machine", can_run),
             ("3 rows of hidden 96 (not a power of two), float32", lambda: check(3, 96, torch.float32)),
             (f"2 rows of hidden 1536, {str(half).removeprefix('torch.')}", lambda: check(2, 1536, half)),
             ("a row of zeros (eps keeps it finite), hidden 100", lambda: check(2, 100, torch.float32, True))]
    return grade("Exercise 14.1", cases, hint="mask the loads (other=0.0) so padded lanes add nothing, and divide "
                                              "the sum of squares by hidden, not by the block size.")


def _partials(heads: int, head_dim: int, keys: int, chunks: int, seed: int, scale: float = 1.0, empty: int | None = None):
    """Full attention of one query per head over ``keys`` keys, and its per-chunk partials."""
    q = rand(heads, head_dim, seed=seed, scale=scale)
    k = rand(heads, keys, head_dim, seed=seed + 1)
    v = rand(heads, keys, head_dim, seed=seed + 2)
    scores = torch.einsum("hd,hnd->hn", q, k).double()
    visible = torch.ones(heads, keys, dtype=torch.bool)
    size = keys // chunks
    if empty is not None:  # this chunk lies past every key the query sees
        visible[:, empty * size:(empty + 1) * size] = False
    scores = scores.masked_fill(~visible, float("-inf"))
    full = torch.einsum("hn,hnd->hd", scores.softmax(-1), v.double()).float()
    outs, lses = [], []
    for c in range(chunks):
        s = scores[:, c * size:(c + 1) * size]
        lse = torch.logsumexp(s, -1)  # -inf for a chunk that saw nothing
        p = torch.where(lse[:, None].isfinite(), (s - lse[:, None]).exp(), torch.zeros_like(s))
        outs.append(torch.einsum("hn,hnd->hd", p, v[:, c * size:(c + 1) * size].double()).float())
        lses.append(lse.float())
    return torch.stack(outs), torch.stack(lses), full


def ex14_2(merge_partials) -> bool:
    def check(*args, **kw):
        outs, lses, full = _partials(*args, **kw)
        got = merge_partials(outs.clone(), lses.clone())
        expect_tensor(got, full, "your merged output", atol=1e-4, rtol=1e-4)

    cases = [("4 chunks of 16 keys, 6 heads", lambda: check(6, 32, 64, 4, seed=1)),
             ("one chunk (nothing to merge)", lambda: check(2, 16, 32, 1, seed=2)),
             ("a chunk with no visible key (lse -inf)", lambda: check(4, 16, 64, 4, seed=3, empty=3)),
             ("scores near 1,000 (exp overflows without the max)", lambda: check(3, 64, 48, 3, seed=4, scale=40.0))]
    return grade("Exercise 14.2", cases, hint="weight each chunk by exp(lse_c - L) with L = logsumexp over the "
                                              "chunks' lses (torch.softmax(lses, 0) is exactly these weights).")


def ex14_3(decode_attention_bytes) -> bool:
    from ..kernels.decode_attention import bytes_moved

    runs = [("the real model, batch 1, 4,096 keys, bf16", (1, 12, 2, 1, 128, 4096, 2)),
            ("batch 8, 1,000 keys, fp32", (8, 12, 2, 1, 128, 1000, 4)),
            ("a speculative verify: 4 query tokens, 8 heads on 8 KV heads (no grouping)", (2, 8, 8, 4, 64, 300, 2))]

    def check(args):
        expect_equal(decode_attention_bytes(*args), bytes_moved(*args), "your byte count")
    cases = [(label, lambda a=a: check(a)) for label, a in runs]
    return grade("Exercise 14.3", cases, hint="keys and values are stored per KV head, not per query head: "
                                              "2 x batch x kv_heads x kv_len x head_dim elements, plus q and the output.")
