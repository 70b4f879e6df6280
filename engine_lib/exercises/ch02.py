"""Exercises of chapter 02 (tokens to vectors): RMSNorm, nearest tokens in an embedding table, a safetensors
header."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.layers.rmsnorm import RMSNorm
from ._grading import Mismatch, expect_equal, expect_tensor, grade, rand, tiny_path
from .in_engine import rms_norm_in_engine

SOLUTIONS = "02_tokens_to_vectors"
EXERCISES = [
    ("RMSNorm from scratch (warm-up)", """\
Write `rms_norm(x, weight, eps)` that normalises the last axis of `x` to unit root-mean-square and
scales it by `weight`, returning the weights' dtype, as `engine_lib.model.layers.rmsnorm.RMSNorm` does.
The check includes a float16 input whose squares overflow float16: compute inside in float32.
Then it puts your function inside the engine: every RMSNorm of the tiny model calls it during a
greedy generation, and the reply and the logits at every position must be the engine's own.

```python
check.ex02_1(rms_norm)
```"""),
    ("Which tokens are neighbours? (core)", """\
Write `nearest(table, token_id, k)` that returns the ids of the `k` rows of an embedding `table`
(vocab, hidden) closest to row `token_id` by **cosine similarity** (the angle between the rows,
not their dot product), most similar first, without `token_id` itself. The check runs it on the
trained `qwen2-stdlib-small` table and on a small table with a zero row and a row that is long
but points elsewhere. Which tokens sit next to `" None"` and to `"1"`, and why would the dot
product rank the long row first? Try the same on the real model's table if you have it.

```python
check.ex02_2(nearest)
```"""),
    ("Read a safetensors header (core)", """\
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
    cases.append(("the engine, every RMSNorm yours, 8 greedy tokens", lambda: rms_norm_in_engine(rms_norm)))
    return grade("Exercise 02.1", cases, hint="x.float(), multiply by rsqrt(mean of squares + eps), cast to "
                                              "weight.dtype, then multiply by weight.")


def _trained_table() -> tuple[torch.Tensor, object]:
    """The trained preset's embedding table (vocab, 64), fp32, and its tokenizer."""
    from ..model.checkpoints import STDLIB_SMALL, ensure_checkpoint
    from ..model.tokenizer import load_tokenizer

    path = ensure_checkpoint(STDLIB_SMALL)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float(), load_tokenizer(path)


def ex02_2(nearest) -> bool:
    from ..book.embedding_figures import nearest_tokens

    table, tok = _trained_table()
    toy = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.0, 0.0, 0.0], [10.0, 10.0, 0.0], [0.7, -0.7, 0.1],
                        [-1.0, 0.0, 0.0]])
    runs = [("the trained table, ' None', 3 neighbours", table, tok.encode(" None")[0], 3),
            ("the trained table, '1', 5 neighbours", table, tok.encode("1")[0], 5),
            ("a toy table: a zero row, and a long row pointing elsewhere (edge)", toy, 0, 4)]

    def check(t, i, k):
        got = nearest(t.clone(), i, k)
        got = got.tolist() if isinstance(got, torch.Tensor) else [int(x) for x in got]
        want = [j for j, _ in nearest_tokens(t, i, k)]
        if i in got:
            raise Mismatch(f"your neighbours of {i} include {i} itself")
        expect_equal(got, want, f"your {k} nearest rows to row {i}")
    cases = [(label, lambda t=t, i=i, k=k: check(t, i, k)) for label, t, i, k in runs]
    return grade("Exercise 02.2", cases, hint="divide every row by its norm (clamped away from 0), take the dot "
                                              "products with the query's unit row, set the query's own entry to -inf, "
                                              "then topk.")


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
