"""Exercises of chapter 04 (the whole model): the SwiGLU MLP, naive greedy generation."""

from __future__ import annotations

import torch

from ..model.layers.mlp import MLP
from ..model.tokenizer import seed_prompts
from ..sampling import SamplingParams
from ..step.naive import naive_tokens
from ._grading import expect_tensor, expect_tokens, grade, rand, tiny_model

SOLUTIONS = "04_whole_model"
EXERCISES = [
    ("The SwiGLU MLP (warm-up)", """\
Write `swiglu(x, w_gate, w_up, w_down)` with weights in `nn.Linear`'s layout (out, in) that
computes $W_\\text{down}(\\operatorname{silu}(W_\\text{gate}x) \\odot W_\\text{up}x)$, as
`engine_lib.model.layers.mlp.MLP` does. Then replace `silu` with `relu` and read the verdict: which
element is the first to differ, and why is it one where the gate is negative?

```python
check.ex04_1(swiglu)
```"""),
    ("Greedy generation, the naive way (core)", """\
Write `greedy_generate(model, ids, n)` that returns the `n` token ids a greedy decoder appends to
the prompt `ids` (a list), calling `model(x)` on the whole sequence so far at every step:
`model(x)` takes ids (1, seq) and returns logits (1, seq, vocab). The check passes the tiny
random model, so the tokens mean nothing but must equal the engine's. Which position's logits
choose the next token?

```python
check.ex04_2(greedy_generate)
```"""),
    ("How close was the call? (core)", """\
Greedy decoding keeps the token with the largest logit, so an error in the logits can change a
token only where the two best logits are close. Write `top2_margin(logits)` that returns, for
logits (rows, vocab), the gap between the largest and the second-largest logit of each row, as
float32 (rows,). Print it for the tiny model's first-token logits of the ten seed prompts: which
prompt would flip first if the logits moved by a little?

```python
check.ex04_3(top2_margin)
```"""),
]


def ex04_1(swiglu) -> bool:
    runs = [("hidden 16, intermediate 48, one token", (1, 1, 16), 16, 48),
            ("a batch of 2 sequences of 5", (2, 5, 32), 32, 64),
            ("a flat (tokens, hidden) input", (7, 8), 8, 24)]

    def check(shape, h, i):
        mlp = MLP(h, i)
        g = torch.Generator().manual_seed(h + i)
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5
        x = rand(*shape, seed=i)
        with torch.no_grad():
            want = mlp(x)
            got = swiglu(x.clone(), mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone(),
                         mlp.down_proj.weight.clone())
        expect_tensor(got, want, "your output", atol=1e-5, rtol=1e-4)
    cases = [(label, lambda s=s, h=h, i=i: check(s, h, i)) for label, s, h, i in runs]
    return grade("Exercise 04.1", cases, hint="F.linear(x, w) is x @ w.T; the silu goes on the gate, "
                                              "not on the up projection.")


def _naive(model, ids: list[int], n: int) -> list[int]:
    return list(naive_tokens(model, torch.tensor([ids]), SamplingParams(), n))


def ex04_2(greedy_generate) -> bool:
    model = tiny_model()
    prompt = seed_prompts()[0]["input_ids"]
    runs = [("seed prompt 0, 4 tokens", prompt, 4), ("a one-token prompt (edge)", [9707], 3),
            ("seed prompt 3, 3 tokens", seed_prompts()[3]["input_ids"], 3)]

    def check(ids, n):
        with torch.inference_mode():
            got = greedy_generate(model, list(ids), n)
        expect_tokens(got, _naive(model, ids, n), len(ids))
    cases = [(label, lambda ids=ids, n=n: check(ids, n)) for label, ids, n in runs]
    return grade("Exercise 04.2", cases, hint="the next token is argmax of logits[0, -1], the last position; "
                                              "append it and run the model again.")


def ex04_3(top2_margin) -> bool:
    tie = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    runs = [("one row", rand(1, 50, seed=1)), ("a batch of 5 rows", rand(5, 1000, seed=2, scale=3.0)),
            ("a tie for first place (margin 0)", tie), ("bfloat16 logits", rand(3, 64, seed=3, dtype=torch.bfloat16)),
            ("the tiny model's first-token logits of two prompts", None)]

    def check(logits):
        if logits is None:
            with torch.inference_mode():
                logits = torch.cat([tiny_model()(torch.tensor([p["input_ids"]]))[:, -1] for p in seed_prompts()[:2]])
        top = logits.float().topk(2, dim=-1).values
        want = top[:, 0] - top[:, 1]
        expect_tensor(top2_margin(logits.clone()), want, "your margins", atol=1e-5, rtol=1e-5)
    cases = [(label, lambda x=x: check(x)) for label, x in runs]
    return grade("Exercise 04.3", cases, hint="logits.float().topk(2, dim=-1).values, then the first minus the "
                                              "second; a tie gives 0.")
