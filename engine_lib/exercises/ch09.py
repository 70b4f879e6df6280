"""Exercises of chapter 09 (beyond greedy): top-p, the repetition penalty, left padding, and what a
bigger batch holds in KV cache, measured."""

from __future__ import annotations

import torch

from ..sampling import apply_repetition_penalty, filter_top_k_top_p
from ..step.forward import Ragged
from ._grading import Mismatch, expect_equal, expect_tensor, grade, rand, tiny_engine

SOLUTIONS = "09_beyond_greedy"
EXERCISES = [
    ("Top-p (nucleus) filtering (core)", """\
Write `top_p_filter(logits, top_p)` for logits (batch, vocab) that keeps, in each row, the
smallest set of most likely tokens whose probabilities add up to at least `top_p`, and sets every
other logit to `-inf`. The most likely token always survives. Careful with the token that
crosses the threshold: it stays.

```python
check.ex09_1(top_p_filter)
```"""),
    ("The repetition penalty (warm-up)", """\
Write `repetition_penalty(logits, seen, penalty)` for logits (batch, vocab) and `seen`, one list
of token ids per row (ids may repeat), that applies `transformers`' rule to every seen token:
divide a positive logit by the penalty, multiply a negative one. Why would "divide every seen
logit" be wrong for negative ones?

```python
check.ex09_2(repetition_penalty)
```"""),
    ("Left padding (core)", """\
Write `pad_left(prompts, pad)` that turns a list of token-id lists into `(ids, valid)`, both
(batch, longest prompt): prompts right-aligned, `pad` before the shorter ones, `valid` False on
the padding. Why left and not right, for a batch that decodes one token per step?

```python
check.ex09_3(pad_left)
```"""),
    ("What a bigger batch holds (core)", """\
Batching buys throughput with memory. Change the batch and the request length, and measure what
the engine holds: write `kv_bytes(engine, batch, prompt_len, new_tokens)` that runs
`engine.generate_batch` on `batch` prompts of `prompt_len` tokens each (any ids, say
`[1000] * prompt_len`) with `max_new_tokens=new_tokens`, `do_sample=False` and
`stop_token_ids=[]`, and returns the bytes of KV cache the engine then holds
(`engine.kv_cache_bytes`). Then predict them from the config (chapter 05's formula): the engine's
contiguous cache holds, for every row, its prompt and new tokens rounded up to a multiple of
`CACHE_BUCKET` slots, plus the row's one scratch slot. Why does one more token sometimes change
nothing and sometimes add a whole bucket of slots to every row, and what does a batch of 8 cost on
the real model at 1,024 tokens in 16 bits?

```python
check.ex09_4(kv_bytes)
```"""),
]


def ex09_1(top_p_filter) -> bool:
    peaked = torch.tensor([[8.0, 1.0, 0.5, 0.0, -1.0]])
    runs = [("two rows of 50, top_p 0.9", rand(2, 50, seed=1, scale=2.0), 0.9),
            ("top_p 1.0 keeps everything", rand(1, 20, seed=2), 1.0),
            ("a tiny top_p keeps only the best token", rand(3, 30, seed=3), 1e-6),
            ("a peaked row where the top token alone passes 0.5", peaked, 0.5),
            ("the token that crosses top_p stays", torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log(), 0.75)]

    def check(logits, p):
        want = filter_top_k_top_p(logits, 0, p)
        got = top_p_filter(logits.clone(), p)
        if isinstance(got, torch.Tensor) and got.shape == want.shape:
            kept, should = got.isfinite(), want.isfinite()
            if (kept != should).any():
                row, col = (kept != should).nonzero()[0].tolist()
                what = "dropped" if should[row, col] else "kept"
                raise Mismatch(f"row {row}: you {what} token {col} (logit {logits[row, col].item():.3g}); you keep "
                               f"{int(kept[row].sum())} tokens, the engine {int(should[row].sum())}")
        expect_tensor(got, want, "your filtered logits")
    cases = [(label, lambda x=x, p=p: check(x, p)) for label, x, p in runs]
    return grade("Exercise 09.1", cases, hint="sort descending; drop a token when the probability mass *before* "
                                              "it already reaches top_p.")


def ex09_2(repetition_penalty) -> bool:
    runs = [("positive and negative logits", torch.tensor([[2.0, -2.0, 0.5, -0.5, 3.0]]), [[0, 1, 3]], 1.5),
            ("repeated ids", rand(1, 10, seed=1), [[4, 4, 4, 7]], 1.2),
            ("two rows, different histories", rand(2, 12, seed=2), [[0, 11], [5]], 1.1),
            ("penalty 1.0 changes nothing", rand(1, 6, seed=3), [[1, 2]], 1.0),
            ("nothing seen", rand(1, 6, seed=4), [[]], 1.3)]

    def check(logits, seen, penalty):
        mask = torch.zeros_like(logits, dtype=torch.bool)
        for row, ids in enumerate(seen):
            mask[row, ids] = True
        want = apply_repetition_penalty(logits, mask, penalty)
        expect_tensor(repetition_penalty(logits.clone(), [list(s) for s in seen], penalty), want, "your logits")
    cases = [(label, lambda x=x, s=s, p=p: check(x, s, p)) for label, x, s, p in runs]
    return grade("Exercise 09.2", cases, hint="torch.where(logits > 0, logits / penalty, logits * penalty), only on "
                                              "seen tokens, each once however often it was seen.")


def ex09_3(pad_left) -> bool:
    runs = [("three prompts", [[1, 2, 3], [4], [5, 6]], 0), ("equal lengths (no padding)", [[1, 2], [3, 4]], 9),
            ("one prompt", [[7, 8, 9]], 0), ("a pad id that is also a real token", [[0, 0, 1], [2]], 0)]

    def check(prompts, pad):
        lay = Ragged.of([(p, 0) for p in prompts])  # the token loop's own left padding (step/forward.py)
        want_ids, want_valid = torch.where(lay.valid, lay.ids, pad), lay.valid
        got = pad_left([list(p) for p in prompts], pad)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (ids, valid), got {type(got).__name__}")
        expect_tensor(got[0], want_ids, "your ids")
        expect_tensor(got[1], want_valid, "your valid mask")
    cases = [(label, lambda p=p, d=d: check(p, d)) for label, p, d in runs]
    return grade("Exercise 09.3", cases, hint="row r gets prompt r in its last len(prompt) columns; ids are "
                                              "torch.long, valid is torch.bool.")


def ex09_4(kv_bytes) -> bool:
    from ..engine import Engine

    engine = tiny_engine()
    reference = Engine(engine.model, engine.tokenizer, engine.model_dir, "kv_cache", engine.device)  # its own loop

    def measured(batch, prompt_len, new_tokens):
        reference.generate_batch([[1000] * prompt_len] * batch, max_new_tokens=new_tokens, do_sample=False,
                                 stop_token_ids=[])
        return reference.kv_cache_bytes
    runs = [("batch 1, 20 + 4 tokens", 1, 20, 4), ("batch 4, 20 + 4 tokens", 4, 20, 4),
            ("batch 2, 252 + 4 tokens (a bucket's last slot)", 2, 252, 4),
            ("batch 2, 253 + 4 tokens (one more)", 2, 253, 4)]
    cases = [(label, lambda b=b, t=t, n=n: expect_equal(kv_bytes(engine, b, t, n), measured(b, t, n),
                                                        "your KV cache bytes")) for label, b, t, n in runs]
    return grade("Exercise 09.4", cases, hint="after generate_batch, the engine keeps its cache: read "
                                              "engine.kv_cache_bytes. Each row gets loop.local.CACHE_BUCKET "
                                              "slots at a time, and its scratch slot on top.")
