"""How a batch's cost grows with its rows, per dtype: the matrix multiply behind every decode batch.

Defined for chapter 12 (serving many users) and the serving bench. A decode step of ``r`` rows
multiplies an (r, in) activation by each (out, in) weight. If the kernel reads each weight once for
all the rows, ``r`` rows cost about what one row costs until the arithmetic catches up with the
reads, and batching pays. If it reads the weight again for every row (or every few rows), a batch
costs nearly ``r`` times one row, and batching buys little. Which one happens depends on the
dtype's kernel on this machine: on a CPU without bfloat16 matrix instructions (AVX2 only), PyTorch's
float32 matrix multiply reuses the weight (MKL), its bfloat16 one much less.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def linear_ms(rows: int, w: torch.Tensor, repeats: int = 7) -> float:
    """Median milliseconds of ``F.linear`` for (rows, in) x ``w`` (out, in)^T in ``w``'s dtype, after a warm-up."""
    device = w.device.type
    x = torch.randn(rows, w.shape[1], generator=torch.Generator(device="cpu").manual_seed(1)).to(w.device, w.dtype)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.linear(x, w)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # two warm-ups
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_scaling(cfg, dtypes=(torch.float32, torch.bfloat16), rows: tuple[int, ...] = (1, 2, 4, 16),
                 device: str = "cpu") -> list[dict]:
    """For the model's MLP up-projection shape: each dtype's milliseconds per row count, and the cost of
    ``r`` rows over one row (``r`` x would mean no reuse of the weight at all)."""
    out_f, in_f = cfg.intermediate_size, cfg.hidden_size
    result = []
    w32 = torch.randn(out_f, in_f, generator=torch.Generator(device="cpu").manual_seed(0))  # one draw for all
    for dtype in dtypes:
        w = w32.to(device, dtype)
        ms = {r: linear_ms(r, w) for r in rows}
        result.append({"dtype": str(dtype).removeprefix("torch."), "shape": [out_f, in_f], "ms": ms,
                       "cost_vs_one_row": {r: ms[r] / ms[rows[0]] for r in rows}})
    return result


def gemm_lines(scaling: list[dict]) -> list[str]:
    """Markdown lines for a record."""
    if not scaling:
        return []
    out_f, in_f = scaling[0]["shape"]
    lines = [f"How a decode batch's matrix multiply grows with its rows here ((rows, {in_f}) x ({out_f}, {in_f})^T, "
             "the MLP's up-projection; median ms, and the cost over one row):", ""]
    for s in scaling:
        cells = ", ".join(f"{r} rows {ms:.1f} ms ({s['cost_vs_one_row'][r]:.1f}x)" for r, ms in s["ms"].items())
        lines.append(f"- {s['dtype']}: {cells}")
    return lines
