"""Figures of chapter 13 (writing our own kernels), drawn from code like those of ``figures.py``.

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
