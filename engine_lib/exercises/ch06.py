"""Exercises of chapter 06 (half precision): bfloat16 rounding by hand, choosing the half dtype,
attention scores that stay finite in float16, the measured error of each half-precision setting."""

from __future__ import annotations

from functools import lru_cache
from unittest import mock

import torch

from ..stages import half_dtype
from ._grading import Mismatch, expect_close, expect_equal, expect_tensor, grade, rand

SOLUTIONS = "06_half_precision"
EXERCISES = [
    ("bfloat16 by hand (stretch)", """\
bfloat16 is float32 with the low 16 bits of the mantissa dropped, rounded to nearest, ties to
even. Write `round_to_bf16(x)` for a float32 tensor that returns the float32 value
`x.to(torch.bfloat16)` would give, using only integer operations on `x.view(torch.int32)`. Plain
truncation (`& 0xFFFF0000`) is close; the check says where it is not.

```python
check.ex06_1(round_to_bf16)
```"""),
    ("Choose the half dtype (warm-up)", """\
Write `pick_half_dtype(capability)` that returns `torch.bfloat16` or `torch.float16` for a CUDA
GPU of compute capability `capability` (a pair such as `(7, 5)` for a T4), as the engine chooses.
Why does the engine not ask `torch.cuda.is_bf16_supported()`?

```python
check.ex06_2(pick_half_dtype)
```"""),
    ("Scores that stay finite in float16 (core)", """\
Write `scores_fp16(q, k)` that returns the attention scores $q k^\\top / \\sqrt{d}$ for float16
q (…, q_len, d) and k (…, kv_len, d), computed in float16, as a float16 tensor. With large
activations, $q k^\\top$ alone passes 65,504: arrange the computation so that no intermediate
overflows.

```python
check.ex06_3(scores_fp16)
```"""),
    ("Change the dtype, measure the error (core)", """\
Build the engine's model yourself in each half-precision setting and measure what it does to the
logits. Write `half_error(model_dir, dtype, residual_fp32, prompts)` that loads the checkpoint in
`model_dir` twice with `engine_lib.model.loader.load_model` on the CPU, once in float32 and once in
`dtype` with `ModelOptions(sdpa=True, residual_dtype=torch.float32 if residual_fp32 else None)`,
and returns the largest |logit - fp32 logit| of the first new token over `prompts` (lists of
token ids), as a float. The check runs it on the trained `qwen2-stdlib-small`. Then tabulate
fp16 and bf16, with and without the fp32 residual stream, on the ten seed prompts: which setting
moves the logits most, what does the fp32 residual buy in each format, and does any setting flip
a greedy token?

```python
check.ex06_4(half_error)
```"""),
]


def ex06_1(round_to_bf16) -> bool:
    base = torch.tensor([1.0, 1.5, -2.25, 3.0e-3], dtype=torch.float32)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, -0x40808000], dtype=torch.int32)
    runs = [("simple values", base), ("random normals", rand(1000, seed=1)),
            ("exact ties (round half to even)", bits.view(torch.float32)),
            ("values near the top of the range (they round to inf)",
             torch.tensor([3.3895e38, 3.4e38, -3.4e38, 1e30], dtype=torch.float32)),
            ("tiny subnormal values", torch.tensor([1e-39, -3e-41, 0.0], dtype=torch.float32))]

    def check(x):
        got = round_to_bf16(x.clone())
        expect_tensor(got, x.to(torch.bfloat16).float(), "your rounded values", atol=0, rtol=0)
    cases = [(label, lambda x=x: check(x)) for label, x in runs]
    return grade("Exercise 06.1", cases, hint="add 0x7FFF plus the lowest kept bit ((i >> 16) & 1) before "
                                              "clearing the low 16 bits.")


def ex06_2(pick_half_dtype) -> bool:
    caps = [("a T4 (7.5)", (7, 5)), ("an A100 (8.0)", (8, 0)), ("an H100 (9.0)", (9, 0)), ("a V100 (7.0)", (7, 0)),
            ("an RTX 3090 (8.6)", (8, 6)), ("a P100 (6.0)", (6, 0))]

    def check(cap):
        with mock.patch("torch.cuda.get_device_capability", return_value=cap):
            want = half_dtype(torch.device("cuda"))
        expect_equal(pick_half_dtype(cap), want, f"pick_half_dtype({cap})")
    cases = [(label, lambda c=c: check(c)) for label, c in caps]
    return grade("Exercise 06.2", cases, hint="bfloat16 is native from Ampere (compute capability 8.0) on.")


def ex06_3(scores_fp16) -> bool:
    runs = [("ordinary activations", 1.0, (1, 2, 5, 64), (1, 2, 7, 64)),
            ("large activations (q.k reaches about 200,000)", 40.0, (1, 1, 4, 128), (1, 1, 4, 128)),
            ("one decode query over 9 keys", 3.0, (2, 1, 1, 32), (2, 1, 9, 32))]

    def check(scale, qs, ks):
        q = rand(*qs, seed=1).abs().mul(scale).half()
        k = rand(*ks, seed=2).abs().mul(scale).half()
        want = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        got = scores_fp16(q.clone(), k.clone())
        if isinstance(got, torch.Tensor) and got.dtype != torch.float16:
            raise Mismatch(f"your scores are {got.dtype}; compute them in float16")
        if isinstance(got, torch.Tensor) and not got.isfinite().all():
            raise Mismatch(f"{int((~got.isfinite()).sum())} of your scores are inf or NaN: an intermediate overflowed")
        expect_tensor(got, want.half(), "your scores", atol=1e-2, rtol=1e-2)
    cases = [(label, lambda s=s, q=q, k=k: check(s, q, k)) for label, s, q, k in runs]
    return grade("Exercise 06.3", cases, hint="scale q by d ** -0.5 before the matmul, as explicit_attention does.")


@lru_cache(maxsize=8)
def _half_error(model_dir, dtype: torch.dtype, residual_fp32: bool, prompts: tuple[tuple[int, ...], ...]) -> float:
    """The engine's answer, computed once per setting: the checks of a session share it."""
    from ..model.loader import load_model
    from ..model.qwen2 import ModelOptions

    def first_logits(dt, residual):
        model = load_model(model_dir, dt, torch.device("cpu"), ModelOptions(sdpa=True, residual_dtype=residual))
        with torch.inference_mode():
            return [model(torch.tensor([ids]), last_only=True)[0, -1].float() for ids in prompts]  # (vocab,) each

    ref = first_logits(torch.float32, None)
    ours = first_logits(dtype, torch.float32 if residual_fp32 else None)
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


def ex06_4(half_error) -> bool:
    from ..model.checkpoints import STDLIB_SMALL, ensure_checkpoint
    from ..model.tokenizer import seed_prompts

    path = ensure_checkpoint(STDLIB_SMALL)
    prompts = (tuple(seed_prompts()[3]["input_ids"]),)  # one prompt keeps the check to seconds
    runs = [("float16 with the fp32 residual stream (the half rung)", torch.float16, True),
            ("float16 with a float16 residual stream", torch.float16, False),
            ("bfloat16 (its own residual stream)", torch.bfloat16, False)]

    def check(dtype, residual):
        got = half_error(path, dtype, residual, [list(p) for p in prompts])
        expect_close(got, _half_error(path, dtype, residual, prompts), "your largest logit error", rel=0.01)
    cases = [(label, lambda d=d, r=r: check(d, r)) for label, d, r in runs]
    return grade("Exercise 06.4", cases, hint="load_model(model_dir, dtype, torch.device('cpu'), ModelOptions(...)); "
                                              "compare model(ids)[0, -1].float() with the float32 model's.")
