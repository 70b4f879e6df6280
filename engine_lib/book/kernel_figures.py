"""Figures of chapter 14 (writing our own kernels), drawn from code like those of ``figures.py``.

- ``split_kv_diagram``: the key axis of one (row, KV head) cut into chunks, one program per
  chunk, each writing a partial output and its log-sum-exp, merged by a second kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .figures import FONT, _arrow, _box, _figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CHUNK_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD")


def split_kv_diagram(kv_len: int, chunk: int, batch: int = 1, kv_heads: int = 2, groups: int = 6) -> Figure:
    """The split-KV ("flash-decoding") grid for ``kv_len`` keys in chunks of ``chunk`` keys.

    Top: the key axis of one (row, KV head), cut into chunks (the last one partly filled when
    ``kv_len`` is not a multiple). Middle: one program per chunk, all ``groups`` query heads of
    the KV head together, each writing (partial output, log-sum-exp). Bottom: the merge.
    """
    chunks = -(-kv_len // chunk)
    shown = min(chunks, 5)  # a long cache: the first chunks, a gap, the last one
    fig, ax = _figure(6.8, 3.6)
    width = 6.0 / shown
    x0 = 0.5
    ax.text(3.5, 3.6, f"the keys of one (row, KV head): {kv_len:,} positions,\n{chunks} chunks of {chunk}",
            ha="center", va="center", fontsize=FONT)
    for i in range(shown):
        c = i if (i < shown - 1 or shown == chunks) else chunks - 1
        left = x0 + i * width
        keys = min(chunk, kv_len - c * chunk)
        fill = keys / chunk
        color = CHUNK_COLORS[i % len(CHUNK_COLORS)]
        ax.add_patch(_rect(left + 0.05, 2.95, (width - 0.1) * fill, 0.35, color, 0.75))
        ax.add_patch(_rect(left + 0.05, 2.95, width - 0.1, 0.35, "none", 1.0, edge="0.3"))
        ax.text(left + width / 2, 3.12, f"{c * chunk}-{c * chunk + keys - 1}", ha="center", va="center",
                fontsize=FONT - 1)
        if shown < chunks and i == shown - 2:
            ax.text(left + width, 3.12, "...", ha="center", va="center", fontsize=FONT + 2)
        _arrow(ax, left + width / 2, 2.92, left + width / 2, 2.42)
        _box(ax, left + width / 2, 2.05, width - 0.15, 0.62, f"program\nchunk {c}", fill=color + "33", fontsize=FONT)
        _arrow(ax, left + width / 2, 1.72, left + width / 2, 1.32)
        ax.text(left + width / 2, 1.12, f"$o_{{{c}}}$, $\\mathrm{{lse}}_{{{c}}}$", ha="center", va="center",
                fontsize=FONT)
        _arrow(ax, left + width / 2, 0.95, 3.5, 0.6)
    _box(ax, 3.5, 0.3, 5.6, 0.5, r"merge: out $= \sum_c e^{\mathrm{lse}_c - L}\, o_c$,  $L = \log\sum_c e^{\mathrm{lse}_c}$",
         fill="#f2f2f2", fontsize=FONT)
    ax.text(3.5, -0.4, f"grid (batch x KV heads, chunks) = ({batch} x {kv_heads}, {chunks}): "
            f"{batch * kv_heads * chunks} programs,\neach reading its chunk's keys once for the {groups} "
            "query heads of its KV head", ha="center", va="center", fontsize=FONT - 1)
    ax.set_xlim(0.3, 6.7)
    ax.set_ylim(-0.8, 3.9)
    ax.axis("off")
    return fig


def _rect(x: float, y: float, w: float, h: float, color: str, alpha: float, edge: str | None = None):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=color, alpha=alpha, edgecolor=edge or "none")


def kernel_bandwidth_plot(record: dict) -> Figure:
    """GB/s of each kernel row and of its baseline (the same ideal bytes over the baseline's time),
    against the record's measured copy bandwidth. Only for GPU records: the interpreter's
    timings mean nothing."""
    import matplotlib.pyplot as plt

    from .plots import legend_below

    m, rows = record["meta"], record["rows"]
    roof = m["copy_bandwidth_bytes_s"] / 1e9
    labels = [f"{r['kernel']}\n{r['shape']}" + _against(r) for r in rows]
    ours = [r["gbps"] for r in rows]
    base = [r["bytes"] / (r["baseline_us"] * 1e-6) / 1e9 for r in rows]
    fig, ax = plt.subplots(figsize=(6.8, 0.55 * len(rows) + 1.8))
    y = list(range(len(rows)))[::-1]
    ax.barh([v + 0.2 for v in y], ours, height=0.4, color="tab:green", label="our kernel")
    ax.barh([v - 0.2 for v in y], base, height=0.4, color="tab:gray", label="what it replaces")
    ax.axvline(roof, color="tab:red", ls="--", label=f"copy roofline ({roof:.0f} GB/s)")
    ax.set_yticks(y, labels, fontsize=FONT - 2)
    ax.set_xlabel("GB/s (the kernel's ideal bytes / time)", fontsize=FONT)
    legend_below(ax)
    ax.set_title(f"{m['device_name']}, {m['dtype']}, median times", fontsize=FONT)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _against(row: dict) -> str:
    """Which baseline, when one kernel row appears with two (decode attention)."""
    if "fused rung" in row["baseline"]:
        return " (vs the fused step)"
    if "eager rungs" in row["baseline"]:
        return " (vs eager)"
    return ""


def kernel_targets(record: dict) -> list[str]:
    """The project's targets for the kernels, each with its verdict from ``record`` where the record
    holds the row (a GPU record), else as a target only."""
    gpu = not record["meta"].get("interpreter") and str(record["meta"]["device"]).startswith("cuda")
    rows = record["rows"] if gpu else []
    roof = record["meta"]["copy_bandwidth_bytes_s"] / 1e9
    attn = [r for r in rows if r["kernel"] == "decode_attention" and r["shape"] == "batch 1, context 4096"
            and "fused rung" in r["baseline"]]
    lines = ["decode attention, 4,096 tokens of context, batch 1: at least 2x faster than the SDPA call "
             "it replaces"
             + (f": {attn[0]['speedup']:.2f}x, {'met' if attn[0]['speedup'] >= 2 else 'NOT met'}" if attn else
                " (no record measured it)")]
    lines.append("the triton rung's decode step at 4,096 tokens of context within 10% of its step at 64 "
                 "(measured by the engine's benchmark, not by this table)")
    int8 = [r for r in rows if r["kernel"] == "int8_matvec" and r["shape"].endswith("rows 1")]
    share = min((r["gbps"] / roof for r in int8), default=None)
    lines.append("int8 matrix-vector kernel at batch 1: at least 80% of the copy roofline"
                 + (f": worst shape {share:.0%}, {'met' if share >= 0.8 else 'NOT met'}" if share is not None else
                    " (no record measured it)"))
    return lines
