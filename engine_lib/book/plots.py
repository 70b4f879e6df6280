"""Labelled matplotlib charts the chapters share, so a plotting cell stays a few lines long.

Used by chapters 00 and 04 to 08. Each helper draws on an ``Axes`` the caller made, so
figures keep the page width the chapter chose (at most 8 inches).
"""

from __future__ import annotations


def grouped_bars(ax, labels: list[str], series: dict[str, list[float]], title: str = "", xlabel: str = "",
                 ylabel: str = "", annotate: str | None = None) -> None:
    """One group of bars per label, one bar per series; ``annotate`` a format like '{:.1f}'."""
    n = len(series)
    width = 0.8 / max(n, 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width=width, label=name)
        if annotate:
            for bar, v in zip(bars, values):
                ax.annotate(annotate.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    if n > 1:
        ax.legend(fontsize=7)


def lines(ax, x: list[float], series: dict[str, list[float]], title: str = "", xlabel: str = "", ylabel: str = "",
          logx: bool = False, logy: bool = False) -> None:
    """One line with markers per series over the same x values."""
    for (name, values), marker in zip(series.items(), "os^vD*"):
        ax.plot(x[:len(values)], values, marker + "-", label=name, ms=4)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
