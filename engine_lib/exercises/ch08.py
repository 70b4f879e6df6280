"""Exercises of chapter 08 (results): arithmetic intensity of decode, the roofline, a fair speed-up, and
the intensity of a real decode step measured at several batch sizes."""

from __future__ import annotations

import statistics
from functools import lru_cache

from ..model.checkpoints import REAL_CONFIG, preset_config
from ..model.config import Qwen2Config
from ._grading import expect_close, grade, tiny_path

SOLUTIONS = "08_results"
EXERCISES = [
    ("The arithmetic intensity of decode (warm-up)", """\
A decode step of a batch of `batch` sequences multiplies every weight once per sequence (2 FLOPs
per weight: a multiply and an add) and reads every weight once. Write
`decode_intensity(cfg, bytes_per_param, batch)` that returns FLOPs per byte of weights read
(ignore attention and the KV cache). Why does the model's size drop out, and why can no batch-1
decode sit right of a GPU's ridge point?

```python
check.ex08_1(decode_intensity)
```"""),
    ("The roofline (warm-up)", """\
Write `attainable(intensity, peak_flops, bandwidth)` that returns the FLOP/s a kernel of that
arithmetic intensity can reach on a device with that peak compute (FLOP/s) and memory bandwidth
(bytes/s). The check includes a kernel exactly at the ridge point.

```python
check.ex08_2(attainable)
```"""),
    ("A speed-up that survives a hiccup (core)", """\
Write `speedup(baseline_s, new_s)` that returns how many times faster the new system is, from two
lists of repeated timings of the same work. One of the check's runs contains a hiccup (a run
interrupted by something else on the machine): your statistic must not move with it.

```python
check.ex08_3(speedup)
```"""),
    ("Batching moves decode along the roofline (core)", """\
Change the batch size and measure where a real decode step sits. Write
`measured_intensity(stage, batch)` that loads the tiny checkpoint (`ensure_checkpoint("tiny")`)
on the CPU at `stage`, stops the engine's loop after the prefill of `batch` copies of a 16-token
prompt, `paused = engine.loop.paused([list(range(1000, 1016))] * batch,
engine.sampling(do_sample=False, max_tokens=2))`, which leaves a filled cache behind, then counts
the FLOPs of one `paused.decode()` (the next decode step of every row) with
`torch.utils.flop_counter.FlopCounterMode(display=False)` and divides them by the bytes of weights
that step reads (`engine_lib.bench.measure.weight_bytes(engine.model)`). The check tries the
float32 `kv_cache` rung and the 16-bit `half` rung at batch 1 and 8. How close is each to your
`decode_intensity` of 08.1, and at what batch would the half rung reach a T4's ridge
(`engine_lib.book.figures.T4.ridge`, its datasheet FLOP/s over its bandwidth)?

```python
check.ex08_4(measured_intensity)
```"""),
]


def ex08_1(decode_intensity) -> bool:
    real = Qwen2Config.from_json(REAL_CONFIG)
    runs = [("the real model, bfloat16, batch 1", real, 2, 1), ("the real model, float32, batch 1", real, 4, 1),
            ("the tiny checkpoint, bfloat16, batch 8", preset_config("tiny"), 2, 8),
            ("int8 weights, batch 64", real, 1, 64)]

    def want(cfg, b, batch):
        params = cfg.num_parameters()
        return 2 * params * batch / (params * b)
    cases = [(label, lambda c=c, b=b, n=n: expect_close(decode_intensity(c, b, n), want(c, b, n), "your intensity"))
             for label, c, b, n in runs]
    return grade("Exercise 08.1", cases, hint="FLOPs = 2 x parameters x batch; bytes = parameters x bytes per "
                                              "parameter.")


def ex08_2(attainable) -> bool:
    t4, h100 = (65e12, 320e9), (989e12, 3.35e12)
    runs = [("batch-1 decode on a T4", 1.0, *t4), ("a big prefill on a T4", 1000.0, *t4),
            ("exactly at the T4's ridge", t4[0] / t4[1], *t4), ("int8 decode on an H100", 2.0, *h100)]
    cases = [(label, lambda i=i, p=p, b=b: expect_close(attainable(i, p, b), min(p, i * b), "your FLOP/s"))
             for label, i, p, b in runs]
    return grade("Exercise 08.2", cases, hint="the lower of the compute roof and intensity x bandwidth.")


def ex08_3(speedup) -> bool:
    runs = [("steady runs", [1.0, 1.02, 0.99, 1.01, 1.0], [0.5, 0.51, 0.49, 0.5, 0.5]),
            ("one slow baseline run", [1.0, 1.01, 9.0, 0.99, 1.0], [0.25, 0.26, 0.24, 0.25, 0.25]),
            ("one slow new run", [2.0, 2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 6.0, 1.0]),
            ("equal systems", [0.3, 0.3, 0.3], [0.3, 0.3, 0.3])]
    cases = [(label, lambda a=a, b=b: expect_close(speedup(list(a), list(b)),
                                                   statistics.median(a) / statistics.median(b), "your speed-up"))
             for label, a, b in runs]
    return grade("Exercise 08.3", cases, hint="a mean moves with one outlier; the median does not.")


@lru_cache(maxsize=8)
def decode_step_intensity(stage: str, batch: int) -> float:
    """FLOPs of one decode step of the tiny checkpoint at ``stage`` and ``batch``, per byte of weights read."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..bench.measure import weight_bytes
    from ..engine import Engine

    engine = Engine.from_pretrained(tiny_path(), device="cpu", stage=stage)
    paused = engine.loop.paused([list(range(1000, 1016))] * batch, engine.sampling(do_sample=False, max_tokens=2))
    with FlopCounterMode(display=False) as flops:
        paused.decode()
    return flops.get_total_flops() / weight_bytes(engine.model)


def ex08_4(measured_intensity) -> bool:
    runs = [("kv_cache (float32), batch 1", "kv_cache", 1), ("half (16-bit), batch 1", "half", 1),
            ("half (16-bit), batch 8", "half", 8)]
    cases = [(label, lambda s=s, b=b: expect_close(measured_intensity(s, b), decode_step_intensity(s, b),
                                                   "your FLOPs per byte", rel=0.02)) for label, s, b in runs]
    return grade("Exercise 08.4", cases, hint="FLOPs of one paused.decode() (FlopCounterMode's get_total_flops()) "
                                              "over weight_bytes(engine.model): the weights are read once per "
                                              "step, whatever the batch.")
