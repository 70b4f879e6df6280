"""Exercises of chapter 02 (tokens to vectors): RMSNorm, the parameter count, a safetensors header."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoints import REAL_CONFIG, preset_config
from ..config import Qwen2Config
from ..layers.rmsnorm import RMSNorm
from ._grading import Mismatch, expect_equal, expect_tensor, grade, rand, tiny_path

SOLUTIONS = "02_tokens_to_vectors"
EXERCISES = [
    ("RMSNorm from scratch", """\
Write `rms_norm(x, weight, eps)` that normalises the last axis of `x` to unit root-mean-square and
scales it by `weight`, returning the weights' dtype, as `engine_lib.layers.rmsnorm.RMSNorm` does.
The check includes a float16 input whose squares overflow float16: compute inside in float32.

```python
check.ex02_1(rms_norm)
```"""),
    ("Count the parameters", """\
Write `num_parameters(cfg)` that counts the parameters of a Qwen2 checkpoint from its
`Qwen2Config`: embedding, per layer the q/k/v/o projections (q, k and v have a bias), the three
MLP matrices and two norm weights, the final norm, and an LM head only when the embeddings are
not tied. How much of the real model is the embedding table?

```python
check.ex02_2(num_parameters)
```"""),
    ("Read a safetensors header", """\
A `.safetensors` file starts with 8 bytes, a little-endian unsigned length, then that many bytes
of JSON. Write `read_header(path)` that returns the JSON as a dict of tensor name ->
`{"dtype", "shape", "data_offsets"}`, without the optional `"__metadata__"` entry and without
reading any tensor data. Nothing in the file is executed: why does that matter for a checkpoint
downloaded from the internet?

```python
check.ex02_3(read_header)
```"""),
]


def _engine_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data = weight.clone()
    with torch.no_grad():
        return norm(x)


def ex02_1(rms_norm) -> bool:
    runs = [("float32, a batch of sequences", rand(2, 5, 64, seed=1), rand(64, seed=2) + 1, 1e-6),
            ("float16 with values near 1,000 (their squares overflow float16)",
             rand(3, 32, seed=3, scale=1000, dtype=torch.float16), torch.ones(32, dtype=torch.float16), 1e-6),
            ("bfloat16", rand(4, 48, seed=4, dtype=torch.bfloat16), rand(48, seed=5, dtype=torch.bfloat16), 1e-5),
            ("one vector of zeros (eps keeps it finite)", torch.zeros(16), torch.ones(16), 1e-6)]

    def check(x, w, eps):
        want = _engine_norm(x, w, eps)
        tol = 1e-5 if want.dtype == torch.float32 else 1e-2
        expect_tensor(rms_norm(x.clone(), w.clone(), eps), want, "your output", atol=tol, rtol=tol)
    cases = [(label, lambda x=x, w=w, e=e: check(x, w, e)) for label, x, w, e in runs]
    return grade("Exercise 02.1", cases, hint="x.float(), multiply by rsqrt(mean of squares + eps), cast to "
                                              "weight.dtype, then multiply by weight.")


def ex02_2(num_parameters) -> bool:
    real = Qwen2Config.from_json(REAL_CONFIG)
    cfgs = [("Qwen2.5-1.5B", real), ("the tiny checkpoint", preset_config("tiny")),
            ("an untied model", dataclasses.replace(real, tie_word_embeddings=False)),
            ("one layer", dataclasses.replace(real, num_hidden_layers=1))]
    cases = [(label, lambda c=c: expect_equal(num_parameters(c), c.num_parameters(), "your count"))
             for label, c in cfgs]
    return grade("Exercise 02.2", cases, hint="q/k/v have biases; a tied LM head is the embedding (count it once).")


def _header(path: Path) -> dict:
    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            out[name] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
    return out


def ex02_3(read_header) -> bool:
    tmp = Path(tempfile.mkdtemp(prefix="ex02_3-"))
    small = tmp / "small.safetensors"
    save_file({"a": torch.zeros(2, 3), "b.weight": torch.ones(5, dtype=torch.bfloat16),
               "scalar": torch.tensor(7, dtype=torch.int64)}, str(small), metadata={"format": "pt", "by": "ex02_3"})
    files = [("the tiny checkpoint", tiny_path() / "model.safetensors"),
             ("a small file with metadata and a 0-d tensor", small)]

    def check(path):
        got = read_header(path)
        if not isinstance(got, dict):
            raise Mismatch(f"read_header should return a dict, got {type(got).__name__}")
        if "__metadata__" in got:
            raise Mismatch("the result still holds '__metadata__', which is not a tensor")
        want = _header(path)
        with open(path, "rb") as f:
            raw = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        expect_equal(sorted(got), sorted(want), "your tensor names")
        for name, info in want.items():
            for key in ("dtype", "shape"):
                expect_equal(list(got[name][key]) if key == "shape" else got[name][key], info[key],
                             f"{key} of {name!r}")
            expect_equal(list(got[name].get("data_offsets", [])), raw[name]["data_offsets"], f"data_offsets of {name!r}")
    cases = [(label, lambda p=p: check(p)) for label, p in files]
    return grade("Exercise 02.3", cases, hint="n = int.from_bytes(f.read(8), 'little'); json.loads(f.read(n)).")
