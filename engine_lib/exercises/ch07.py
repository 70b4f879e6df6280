"""Exercises of chapter 07 (fusion and CUDA graphs): fused add + RMSNorm, packed q/k/v, RoPE in place,
and what the fused rung removes from a decode step, counted."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..model.layers.attention import Attention
from ..model.layers.rmsnorm import RMSNorm
from ..model.layers.rope import RotaryEmbedding, apply_rope
from ._grading import Mismatch, expect_equal, expect_tensor, grade, rand, tiny_model, tiny_path

SOLUTIONS = "07_fusion_and_cuda_graphs"
EXERCISES = [
    ("Add and normalise in one pass (warm-up)", """\
Write `add_rms_norm(x, residual, weight, eps)` that returns `(normed, new_residual)`: the sum
`x + residual` becomes the new residual stream, and `normed` is its RMSNorm (in float32 inside,
the weights' dtype out), as `RMSNorm.add_forward` computes for every layer of the fused rung.
Why does the fused form read the residual stream once instead of three times?

```python
check.ex07_1(add_rms_norm)
```"""),
    ("Pack q, k and v (core)", """\
Write `pack_qkv(q_w, k_w, v_w)` that builds the one (q_out + 2 kv_out, hidden) weight the fused
rung multiplies by, from the three checkpoint tensors. The check compares it with layer 0 of the
tiny model loaded with `ModelOptions(fused=True)`. Why is one matmul with the packed weight
cheaper than three at batch 1?

```python
check.ex07_2(pack_qkv)
```"""),
    ("RoPE in place (core)", """\
Write `rope_(x, cos, sin)` that rotates `x` (batch, heads, seq, head_dim) by RoPE *in place*
and returns `x` itself (no new q/k tensor: a CUDA graph replays fixed addresses), with `cos` and
`sin` of shape (batch, 1, seq, head_dim) as `RotaryEmbedding` returns them.

```python
check.ex07_3(rope_)
```"""),
    ("What fusion removes, counted (stretch)", """\
Change the rung and measure the host's work. Write `decode_ops(stage)` that loads the tiny
checkpoint (`ensure_checkpoint("tiny")`) at `stage` in float32 on the CPU
(`Engine.from_pretrained(path, device="cpu", stage=stage, dtype=torch.float32)`), runs its
decode step *eagerly* through a token loop of its own that never compiles
(`LocalLoop(engine.model, engine.tokenizer, engine.max_model_len)`, from `engine_lib.loop.local`:
you count the fused model's own calls, before `torch.compile` fuses them), stops it after any
prompt's prefill (`paused = loop.paused([ids], SamplingParams(max_tokens=8))`) and returns the
operator calls of one `paused.decode()` after one warm-up step (`top_level_ops`, section 1). The
check calls it for
`kv_cache`, `half` and `fused`. Is the fused model, run eagerly, any cheaper for the host? Then
time one step of each with `measure`: where does fusion pay, and what would a CUDA graph remove?

```python
check.ex07_4(decode_ops)
```"""),
]


def ex07_1(add_rms_norm) -> bool:
    runs = [("float32", rand(2, 3, 32, seed=1), rand(2, 3, 32, seed=2), rand(32, seed=3) + 1, torch.float32),
            ("bfloat16", rand(1, 4, 64, seed=4), rand(1, 4, 64, seed=5), rand(64, seed=6), torch.bfloat16),
            ("a zero residual (the first layer)", rand(1, 2, 16, seed=7), torch.zeros(1, 2, 16), torch.ones(16),
             torch.float32)]

    def check(x, r, w, dtype):
        x, r, w = x.to(dtype), r.to(dtype), w.to(dtype)
        norm = RMSNorm(w.shape[0], 1e-6)
        norm.weight.data = w.clone()
        with torch.no_grad():
            want_n, want_r = norm.add_forward(x, r)
        got = add_rms_norm(x.clone(), r.clone(), w.clone(), 1e-6)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (normed, new_residual), got {type(got).__name__}")
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        expect_tensor(got[1], want_r, "your new residual", atol=tol, rtol=tol)
        expect_tensor(got[0], want_n, "your normed output", atol=tol, rtol=tol)
    cases = [(label, lambda x=x, r=r, w=w, d=d: check(x, r, w, d)) for label, x, r, w, d in runs]
    return grade("Exercise 07.1", cases, hint="the new residual is x + residual, and the norm is taken of that sum.")


def ex07_2(pack_qkv) -> bool:
    plain, fused = tiny_model(), tiny_model(fused=True)

    def check_model(layer):
        a = plain.model.layers[layer].self_attn
        got = pack_qkv(a.q_proj.weight.detach().clone(), a.k_proj.weight.detach().clone(),
                       a.v_proj.weight.detach().clone())
        expect_tensor(got, fused.model.layers[layer].self_attn.qkv_proj.weight.detach(), "your packed weight")

    def check_random(hidden, heads, kv_heads):
        attn = Attention(hidden, heads, kv_heads, packed=True)
        d = hidden // heads
        parts = {"q_proj.weight": rand(heads * d, hidden, seed=1), "k_proj.weight": rand(kv_heads * d, hidden, seed=2),
                 "v_proj.weight": rand(kv_heads * d, hidden, seed=3)}
        want = torch.cat([parts[name] for name, _ in attn.packed_sources()["qkv_proj.weight"]])
        expect_tensor(pack_qkv(*(parts[n].clone() for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight"))),
                      want, "your packed weight")
    cases = [("layer 0 of the tiny model", lambda: check_model(0)), ("layer 3 of the tiny model", lambda: check_model(3)),
             ("12 query heads, 2 KV heads (the real model's ratio)", lambda: check_random(96, 12, 2))]
    return grade("Exercise 07.2", cases, hint="stack the output rows (dim 0), in the order q, k, v.")


def ex07_3(rope_) -> bool:
    runs = [("head_dim 8, 3 positions", (1, 2, 3, 8), torch.arange(3)), ("position 0", (1, 1, 1, 16), torch.tensor([0])),
            ("head_dim 64, a decode position", (2, 4, 1, 64), torch.tensor([4095]))]

    def check(shape, pos):
        x = rand(*shape, seed=shape[-1])
        cos, sin = RotaryEmbedding(shape[-1], int(pos.max()) + 1, 1e6)(pos[None].expand(shape[0], -1), torch.float32)
        want = apply_rope(x, cos, sin)
        mine = x.clone()
        ptr = mine.data_ptr()
        got = rope_(mine, cos, sin)
        if got is not mine or mine.data_ptr() != ptr:
            raise Mismatch("rope_ returned a new tensor: write the result into x (x1.copy_(...)) and return x")
        expect_tensor(mine, want, "x after your rope_", atol=1e-5, rtol=1e-5)
    cases = [(label, lambda s=s, p=p: check(s, p)) for label, s, p in runs]
    return grade("Exercise 07.3", cases, hint="compute both rotated halves first, then copy_ them into x's halves "
                                              "(writing x1 first would change what x2's rotation reads).")


@lru_cache(maxsize=8)
def eager_decode_ops(stage: str) -> int:
    """The operator calls of one eager decode step of the tiny checkpoint at ``stage``, float32, CPU."""
    from ..bench.measure import top_level_ops
    from ..engine import Engine
    from ..loop.local import LocalLoop
    from ..sampling import SamplingParams

    engine = Engine.from_pretrained(tiny_path(), device="cpu", stage=stage, dtype=torch.float32)
    loop = LocalLoop(engine.model, engine.tokenizer, engine.max_model_len)  # eager, whatever the rung: no compile
    paused = loop.paused([list(range(1000, 1012))], SamplingParams(max_tokens=8))  # a 12-token prompt
    paused.decode()  # warm up
    return top_level_ops(paused.decode)


def ex07_4(decode_ops) -> bool:
    def check(stage):
        want = eager_decode_ops(stage)
        got = decode_ops(stage)
        expect_equal(got, want, f"your count for {stage!r}")
    cases = [(f"the {stage} rung", lambda s=stage: check(s)) for stage in ("kv_cache", "half", "fused")]
    return grade("Exercise 07.4", cases, hint="count one paused.decode() after a prefill and one warm-up step, "
                                              "eagerly (a LocalLoop that does not compile), not the prefill or "
                                              "a whole generate().")
