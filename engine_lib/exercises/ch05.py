"""Exercises of chapter 05 (the KV cache): its size, a cached decoder, the verify step."""

from __future__ import annotations

import dataclasses

import torch

from ..checkpoints import REAL_CONFIG, preset_config
from ..config import Qwen2Config
from ..kv_cache import kv_bytes_per_token
from ..tokenizer import seed_prompts
from ._grading import Mismatch, expect_close, expect_tensor, expect_tokens, grade, tiny_model
from .ch04 import _naive

SOLUTIONS = "05_kv_cache"
EXERCISES = [
    ("The size of the cache", """\
Write `kv_bytes(cfg, bytes_per_element, tokens)` that returns the bytes the KV cache needs to
hold `tokens` tokens of a `Qwen2Config`: keys and values, every layer, every KV head. How many
tokens of the real model fit in one GiB in bfloat16, and how many would without grouped-query
attention (12 KV heads instead of 2)?

```python
check.ex05_1(kv_bytes)
```"""),
    ("A cached decoder", """\
Write `cached_greedy(model, ids, n)`: the greedy decoder of exercise 04.2, but with a
`KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, max_len, model.dtype,
model.device)` (`from engine_lib.kv_cache import KVCache`). Prefill the prompt in one call,
`model(x, positions, cache.layers(), cache_pos, kv_len=t)`, then feed **one** token per call.
The check counts how many tokens each call feeds, so a loop without a cache does not pass.

```python
check.ex05_2(cached_greedy)
```"""),
    ("Several new tokens at once", """\
Write `verify_logits(model, prompt, tokens)` that prefills `prompt` into a cache and then feeds
all of `tokens` in *one* forward (`cache_pos = arange(t, t + len(tokens))`, `kv_len = t +
len(tokens)`), returning that forward's logits, shape (len(tokens), vocab). They must equal the
logits of one pass over `prompt + tokens` at those positions. This is the verify step of
speculative decoding (chapter 11).

```python
check.ex05_3(verify_logits)
```"""),
]


def ex05_1(kv_bytes) -> bool:
    real = Qwen2Config.from_json(REAL_CONFIG)
    runs = [("Qwen2.5-1.5B, bfloat16, 32,768 tokens", real, 2, 32768),
            ("Qwen2.5-1.5B, float32, one token", real, 4, 1),
            ("the tiny checkpoint, float32, 100 tokens", preset_config("tiny"), 4, 100),
            ("no grouped-query attention (12 KV heads), bfloat16, 4,096 tokens",
             dataclasses.replace(real, num_key_value_heads=12), 2, 4096)]
    cases = [(label, lambda c=c, b=b, t=t: expect_close(kv_bytes(c, b, t), kv_bytes_per_token(c, b) * t,
                                                        "your byte count", rel=1e-9))
             for label, c, b, t in runs]
    return grade("Exercise 05.1", cases, hint="2 (K and V) x layers x KV heads x head_dim x bytes x tokens.")


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
