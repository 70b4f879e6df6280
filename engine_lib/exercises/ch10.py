"""Exercises of chapter 10 (quantization): an int8 quantizer, int4's bytes per weight, int4
dequantization, and the int4 group size changed in the engine's layer and measured."""

from __future__ import annotations

import torch

from ..quant import formats as engine_quant
from ..quant.formats import quantize_int4
from ..quant.linear import QuantLinear
from ._grading import Mismatch, expect_close, expect_tensor, grade, rand

SOLUTIONS = "10_quantization"
EXERCISES = [
    ("An int8 quantizer (core)", """\
Write `quantize_int8(w)` for a weight (out, in) that returns `(q, scales)`: `q` int8 (out, in)
and one float32 scale per output row, `scale = max|w| of the row / 127` and `q = round(w /
scale)`. Every weight must come back within half a step, `|q * scale - w| <= scale / 2`, and
every row must use the full range. The check includes a row of zeros: what scale keeps it finite?

```python
check.ex10_1(quantize_int8)
```"""),
    ("What int4 really costs (warm-up)", """\
Four bits is half a byte, but int4 also stores a bfloat16 scale and a bfloat16 zero point per
group of `group_size` weights. Write `int4_bytes_per_weight(group_size)` that returns the
average bytes per weight, everything included. The check measures it on the engine's
`quantize_int4` output. Which group size would you choose, and what does a smaller one buy?

```python
check.ex10_2(int4_bytes_per_weight)
```"""),
    ("Back from int4 (core)", """\
Write `dequantize_int4(q, scales, zeros)` for `q` (out, in) holding levels 0..15 and `scales`,
`zeros` (out, in // group_size): each group's weight is `(q - 8) * scale + zero`. Return float32.

```python
check.ex10_3(dequantize_int4)
```"""),
    ("Choose a group size by measuring (stretch)", """\
Change the engine's int4 group size and measure both sides of the trade. Write
`group_size_effect(weight, x, group_size)` that builds the engine's own layer,
`QuantLinear(in_features, out_features, mode="int4", group_size=group_size)`, fills it with
`layer.quantize_(weight, torch.bfloat16)`, and returns `(bytes_per_weight, error)`: the bytes the
layer stores (its `qweight` and `scales_and_zeros`) per weight, and the relative error of its
output on the inputs `x` (batch, in), `‖layer(x) − x Wᵀ‖ / ‖x Wᵀ‖` in float32, with `x` cast to
bfloat16 for the layer. The check uses a weight with outlier columns. Which group size would you
ship, and does the answer change for a model whose weights have no outliers?

```python
check.ex10_4(group_size_effect)
```"""),
]


def ex10_1(quantize_int8) -> bool:
    zero_row = rand(4, 32, seed=3)
    zero_row[2] = 0
    outlier = rand(6, 64, seed=4)
    outlier[1, 5] = 50.0
    runs = [("a random (8, 64) weight", rand(8, 64, seed=1)), ("rows of very different sizes",
                                                               rand(5, 16, seed=2) * torch.logspace(-3, 2, 5)[:, None]),
            ("a row of zeros (edge)", zero_row), ("one outlier in row 1", outlier)]

    def check(w):
        got = quantize_int8(w.clone())
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (q, scales), got {type(got).__name__}")
        q, s = got
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
            raise Mismatch(f"q should be an int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
        if tuple(q.shape) != tuple(w.shape):
            raise Mismatch(f"q has shape {tuple(q.shape)}, expected {tuple(w.shape)}")
        s = torch.as_tensor(s).float().flatten()
        if s.shape[0] != w.shape[0]:
            raise Mismatch(f"you have {s.shape[0]} scales for {w.shape[0]} rows: one per output row (axis 0)")
        back = q.float() * s[:, None]
        if not back.isfinite().all():
            raise Mismatch("q * scale has inf or NaN (a zero row divided by a zero scale?)")
        err = (back - w).abs()
        bound = s[:, None] / 2 * (1 + 1e-5) + 1e-12
        if (err > bound).any():
            r, c = (err > bound).nonzero()[0].tolist()
            raise Mismatch(f"weight [{r}, {c}] comes back {err[r, c].item():.3g} off, more than half a step "
                           f"({s[r].item() / 2:.3g})")
        _, es = engine_quant.quantize_int8(w)  # the engine's scales (bfloat16, rounded up)
        live = w.abs().amax(1) > 0
        full = q.abs().amax(1)
        if (full[live] != 127).any():
            r = int(live.nonzero()[(full[live] != 127).nonzero()[0]])
            raise Mismatch(f"row {r} reaches only {int(full[r])} of the 127 levels: its scale should be the row's "
                           f"max |w| / 127")
        expect_tensor(s[live], es.float()[live], "your scales", atol=0, rtol=1e-2)
    cases = [(label, lambda w=w: check(w)) for label, w in runs]
    return grade("Exercise 10.1", cases, hint="scale = w.abs().amax(dim=1) / 127 (clamped above 0), "
                                              "q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).")


def _measured(group_size: int) -> float:
    w = rand(8, 512, seed=group_size)
    q, s, z = quantize_int4(w, torch.bfloat16, group_size)
    return (q.numel() / 2 + s.numel() * s.element_size() + z.numel() * z.element_size()) / w.numel()


def ex10_2(int4_bytes_per_weight) -> bool:
    cases = [(f"group size {g}", lambda g=g: expect_close(int4_bytes_per_weight(g), _measured(g),
                                                          f"your bytes per weight (group {g})", rel=1e-6))
             for g in (32, 64, 128, 256, 512)]
    return grade("Exercise 10.2", cases, hint="half a byte per weight plus (2 + 2) bytes per group.")


def ex10_3(dequantize_int4) -> bool:
    runs = [("group 128", (4, 256), 128), ("group 32", (3, 96), 32), ("one group per row", (5, 64), 64)]

    def check(shape, g):
        q, s, z = quantize_int4(rand(*shape, seed=g), torch.bfloat16, g)
        expect_tensor(dequantize_int4(q.clone(), s.clone(), z.clone()), engine_quant.dequantize_int4(q, s, z),
                      "your weight", atol=1e-6, rtol=1e-6)
    cases = [(label, lambda s=s, g=g: check(s, g)) for label, s, g in runs]
    return grade("Exercise 10.3", cases, hint="view q as (out, groups, group_size); subtract 8 before scaling; "
                                              "broadcast scales[..., None] and zeros[..., None].")



def _group_effect(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> tuple[float, float]:
    from ..bench.measure import tensor_bytes

    layer = QuantLinear(weight.shape[1], weight.shape[0], mode="int4", group_size=group_size)
    layer.quantize_(weight, torch.bfloat16)
    stored = tensor_bytes(layer.qweight) + tensor_bytes(layer.scales_and_zeros)
    with torch.no_grad():
        want = x.float() @ weight.float().t()
        got = layer(x.to(torch.bfloat16)).float()
    return stored / weight.numel(), ((got - want).norm() / want.norm()).item()


def ex10_4(group_size_effect) -> bool:
    weight = rand(64, 512, seed=10, scale=0.02)
    weight[:, ::37] *= 25  # outlier input columns, as trained weights have
    x = rand(4, 512, seed=11)

    def check(g):
        got = group_size_effect(weight.clone(), x.clone(), g)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch(f"expected a pair (bytes_per_weight, error), got {type(got).__name__}")
        want = _group_effect(weight, x, g)
        expect_close(got[0], want[0], f"your bytes per weight (group {g})", rel=1e-6)
        expect_close(got[1], want[1], f"your relative error (group {g})", rel=0.02)
    cases = [(f"group size {g}", lambda g=g: check(g)) for g in (32, 128, 512)]
    return grade("Exercise 10.4", cases, hint="bytes: tensor_bytes(layer.qweight) + tensor_bytes("
                                              "layer.scales_and_zeros), over weight.numel(); error: the norm of the "
                                              "difference over the norm of x @ weight.T, both in float32.")
