"""Labelled matplotlib charts the chapters share, so a plotting cell stays a few lines long.

Used by chapters 00 and 04 to 08. Each helper draws on an ``Axes`` the caller made, so
figures keep the width the chapter chose (``book.show_figure`` fits it to the column).
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
                            ha="center", va="bottom", fontsize=10)
    ax.set_xticks(range(len(labels)), labels, fontsize=10)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.tick_params(labelsize=10)
    if n > 1:  # inside, above the bars: headroom keeps it off the data
        top = max((v for values in series.values() for v in values), default=1)
        ax.set_ylim(0, 1.6 * top)
        ax.legend(fontsize=10, loc="upper center", frameon=False)


def lines(ax, x: list[float], series: dict[str, list[float]], title: str = "", xlabel: str = "", ylabel: str = "",
          logx: bool = False, logy: bool = False) -> None:
    """One line with markers per series over the same x values."""
    for (name, values), marker in zip(series.items(), "os^vD*"):
        ax.plot(x[:len(values)], values, marker + "-", label=name, ms=4)
    if logx:
        ax.set_xscale("log", base=2)
        plain_log_axis(ax.xaxis, base=2)
    if logy:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.tick_params(labelsize=10)
    ax.grid(alpha=0.3)
    legend_below(ax)


def plain_log_axis(axis, base: int = 10) -> None:
    """Plain numbers on a log axis ("3", "30", "0.5", "1024"), never "3x10^0" or "2^10"."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    def plain(v, _pos):
        return f"{v:g}"

    axis.set_major_locator(LogLocator(base=base, subs=(1.0, 2.0, 5.0) if base == 10 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(plain))
    axis.set_minor_formatter(FuncFormatter(lambda v, p: ""))


def legend_below(ax, gap_pt: float = 40) -> None:
    """The legend under the axes, clear of the tick labels and the x label: never over the data."""
    height_pt = ax.get_position().height * ax.figure.get_size_inches()[1] * 72
    ax.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -(gap_pt if not ax.get_xlabel() else gap_pt + 16)
                                                              / height_pt), frameon=False)


def plain_numbers(axis) -> None:
    """Plain tick labels ("100", "1") on any scale, symlog included; the ticks stay where they are."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
