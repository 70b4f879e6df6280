"""Exercises of chapter 05 (the KV cache): what the cache bucket costs and buys, a cached decoder, the verify step."""

from __future__ import annotations

import torch

from ..model.tokenizer import seed_prompts
from ._grading import Mismatch, expect_equal, expect_tensor, expect_tokens, grade, tiny_model, tiny_path
from .ch04 import _naive

SOLUTIONS = "05_kv_cache"
EXERCISES = [
    ("Change the cache bucket, measure what it costs (core)", """\
The engine's loop sizes its contiguous cache to each call: every row holds the call's prompt and new
tokens rounded up to a multiple of `engine_lib.loop.local.CACHE_BUCKET` positions (and one scratch
slot), so that requests of similar length reuse one cache (and, in chapter 07, one captured CUDA
graph). Change the bucket and measure. Write `bucket_cost(engine, prompts, max_new_tokens, bucket)`
that sets `engine_lib.loop.local.CACHE_BUCKET = bucket` (and puts the old value back, even on an
error), runs each prompt of `prompts` (lists of token ids) in turn,
`engine.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, stop_token_ids=[])`, and
returns `(allocations, unused)`: how many times the loop allocated a new cache
(`engine.loop.cache` is a new object), and the positions a row holds beyond prompt +
`max_new_tokens` (`engine.loop.cache.block_size` is what a row holds), summed over the requests.
Read them from the engine, do not derive them: one case builds the engine with a fixed context
(`max_model_len`), whose rows always hold all of it. Then, on a GPU, time the ten seed prompts with
a bucket of 1 and of 256 at the `fused` rung (chapter 07): which pays, memory or recompiling?

```python
check.ex05_1(bucket_cost)
```"""),
    ("A cached decoder (core)", """\
Write `cached_greedy(model, ids, n)`: the greedy decoder of exercise 04.2, but with a
`KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, max_len, model.dtype,
model.device)` (`from engine_lib.cache.contiguous import KVCache`). Prefill the prompt in one call,
`model(x, positions, cache.layers(), cache_pos, kv_len=t)`, then feed **one** token per call.
The check counts how many tokens each call feeds, so a loop without a cache does not pass.

```python
check.ex05_2(cached_greedy)
```"""),
    ("Several new tokens at once (stretch)", """\
Write `verify_logits(model, prompt, tokens)` that prefills `prompt` into a cache and then feeds
all of `tokens` in *one* forward (`cache_pos = arange(t, t + len(tokens))`, `kv_len = t +
len(tokens)`), returning that forward's logits, shape (len(tokens), vocab). They must equal the
logits of one pass over `prompt + tokens` at those positions. This is the verify step of
speculative decoding (chapter 11).

```python
check.ex05_3(verify_logits)
```"""),
]


def _bucket_cost(max_model_len: int | None, prompts: list[list[int]], n: int, bucket: int) -> tuple[int, int]:
    """What the loop's sizing rule implies: one allocation per change of cache length."""
    allocations, unused, length = 0, 0, None
    for ids in prompts:
        need = len(ids) + n
        new = max_model_len or -(-need // bucket) * bucket  # a fixed context: every row holds all of it
        allocations += new != length
        length = new
        unused += new - need
    return allocations, unused


def ex05_1(bucket_cost) -> bool:
    from ..engine import Engine
    from ..loop import local
    from ..model.tokenizer import load_tokenizer

    model, tok = tiny_model(), load_tokenizer(tiny_path())
    seeds = [p["input_ids"] for p in seed_prompts()]
    runs = [("three seed prompts, bucket 256", seeds[:3], 2, 256, None),
            ("the same, bucket 1 (every new length allocates)", seeds[:3], 2, 1, None),
            ("bucket 16, two prompts that share a bucket", [seeds[0], seeds[9], seeds[2]], 2, 16, None),
            ("an engine with a fixed cache length of 128 (the bucket does not apply)", seeds[:2], 2, 1, 128)]

    def check(prompts, n, bucket, fixed):
        before = local.CACHE_BUCKET
        engine = Engine(model, tok, tiny_path(), "kv_cache", torch.device("cpu"), fixed)  # a fresh loop
        try:
            got = bucket_cost(engine, [list(p) for p in prompts], n, bucket)
        finally:
            left, local.CACHE_BUCKET = local.CACHE_BUCKET, before
        if left != before:
            raise Mismatch(f"CACHE_BUCKET is still {left} after your function: put {before} back")
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (allocations, unused), got {got!r}")
        want = _bucket_cost(fixed, prompts, n, bucket)
        expect_equal(tuple(int(x) for x in got), want, "your (allocations, unused slots)")
    cases = [(label, lambda p=p, n=n, b=b, f=f: check(p, n, b, f)) for label, p, n, b, f in runs]
    return grade("Exercise 05.1", cases, hint="count a new allocation when engine.loop.cache is not the object of "
                                              "the previous request; unused = cache.block_size - (prompt + "
                                              "max_new_tokens); restore CACHE_BUCKET in a finally block.")


class CountingModel:
    """Wraps the model and records how many new tokens each forward call feeds."""

    def __init__(self, model):
        self._model, self.fed = model, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, *args, **kwargs):
        self.fed.append(int(input_ids.shape[1]))
        return self._model(input_ids, *args, **kwargs)


def ex05_2(cached_greedy) -> bool:
    model = tiny_model()
    runs = [("seed prompt 0, 5 tokens", seed_prompts()[0]["input_ids"], 5),
            ("a one-token prompt (edge)", [9707], 4), ("seed prompt 5, 1 token", seed_prompts()[5]["input_ids"], 1)]

    def check(ids, n):
        counted = CountingModel(model)
        with torch.inference_mode():
            got = cached_greedy(counted, list(ids), n)
        expect_tokens(got, _naive(model, ids, n), len(ids))
        if not counted.fed or counted.fed[0] != len(ids):
            raise Mismatch(f"the first call should prefill all {len(ids)} prompt tokens; your calls fed {counted.fed}")
        if any(f != 1 for f in counted.fed[1:]):
            raise Mismatch(f"after the prefill each call should feed one token; your calls fed {counted.fed}")
        if len(counted.fed) > n:
            raise Mismatch(f"{n} tokens need {n} calls (a prefill and {n - 1} steps); yours made {len(counted.fed)}")
    cases = [(label, lambda ids=ids, n=n: check(ids, n)) for label, ids, n in runs]
    return grade("Exercise 05.2", cases, hint="the token at position p goes to cache slot p: positions = cache_pos "
                                              "= [[p]], kv_len = p + 1.")


def ex05_3(verify_logits) -> bool:
    model = tiny_model()
    p0, p2 = seed_prompts()[0]["input_ids"], seed_prompts()[2]["input_ids"]
    runs = [("seed prompt 0 and 4 known tokens", p0, [11, 22, 33, 44]), ("one token (a decode step)", p2, [1000]),
            ("a one-token prompt and 3 tokens", [9707], [5, 6, 7])]

    def check(prompt, tokens):
        counted = CountingModel(model)
        with torch.inference_mode():
            got = verify_logits(counted, list(prompt), list(tokens))
            want = model(torch.tensor([prompt + tokens]))[0, len(prompt):].float()
        expect_tensor(got.float() if isinstance(got, torch.Tensor) else got, want, "your logits", atol=1e-4, rtol=1e-4)
        if counted.fed[-1:] != [len(tokens)] or len(counted.fed) > 2:
            raise Mismatch(f"feed the prompt, then all {len(tokens)} tokens in one call; your calls fed {counted.fed}")
    cases = [(label, lambda p=p, t=t: check(p, t)) for label, p, t in runs]
    return grade("Exercise 05.3", cases, hint="the new tokens sit at positions t .. t + k - 1, written to the same "
                                              "cache slots; kv_len = t + k.")
