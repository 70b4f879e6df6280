"""Every chapter: the helpers the chapters share.

The environment printout, the model choice, showing source, sentences and tables built from measured
numbers, figures with captions, committed records. Used by every chapter in ``chapters/``; engine code
itself never lives in a notebook.
"""

from __future__ import annotations

import base64
import html
import inspect
import io
import json
import os
import platform
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

# chapters import these from here, with the rest of the page helpers
from ..bench.measure import device_name  # noqa: F401
from ..bench.report import fmt  # noqa: F401
from ..errors import ModelNotFoundError
from ..model.checkpoints import REAL_MODEL_ID, ensure_checkpoint
from ..model.hub import fetch_model

RANDOM_NOTE = ("NOTE: offline RANDOM-weight checkpoint. Generated text is meaningless, and "
               "timings are {device} timings at a reduced model size, not GPU figures.")
WIDTH = 76  # output lines wrap here: a 1280-px window shows 77 columns of output, so nothing wraps twice
SPEED_LAYERS = 2  # CPU speed lessons: the real width (and vocabulary), 2 of the 28 layers


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    name: str  # what every figure and table names
    is_real: bool
    device: str

    @property
    def title(self) -> str:
        """The model as a figure title names it: '<folder>, random weights' for an offline random checkpoint."""
        from ..model.checkpoints import is_trained_checkpoint
        if self.is_real:
            return self.name
        return f"{self.path.name}, {'trained on the Python stdlib' if is_trained_checkpoint(self.path) else 'random weights'}"

    @property
    def note(self) -> str:
        from ..model.checkpoints import checkpoint_label, is_trained_checkpoint
        if self.is_real:
            return "real Qwen2.5-1.5B-Instruct weights"
        if is_trained_checkpoint(self.path):
            return f"{checkpoint_label(self.path)} ({self.device.upper()})"
        return RANDOM_NOTE.format(device=self.device.upper())


def environment_report() -> str:
    """Versions and device, printed at the top of every chapter."""
    import transformers

    lines = [f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__}",
             f"device: {device_name()}"]
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        lines.append(f"compute capability {cc[0]}.{cc[1]} | native bf16: {cc >= (8, 0)}")
    return "\n".join(lines)


def pick_model(preset: str | None = None, layers: int | None = None) -> ModelChoice:
    """The real model on a GPU with hub access; else the offline random checkpoint.

    ``ENGINE_BOOK_MODEL`` (a folder or repo id) overrides the choice; ``ENGINE_BOOK_PRESET``
    picks the offline preset (default ``tiny``, which keeps CI fast).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    override = os.environ.get("ENGINE_BOOK_MODEL")
    if override:
        path = fetch_model(override)  # a folder, or a repo id: its size said before any download
        from ..model.checkpoints import is_random_checkpoint
        return ModelChoice(path, path.name, not is_random_checkpoint(path), device)
    if device == "cuda":
        try:
            return ModelChoice(fetch_model(REAL_MODEL_ID), REAL_MODEL_ID, True, device)  # one copy, in the HF cache
        except ModelNotFoundError as exc:
            print(f"real model unavailable ({exc}); falling back to the offline checkpoint")
    preset = preset or os.environ.get("ENGINE_BOOK_PRESET", "tiny")
    path = ensure_checkpoint(preset, layers)
    from ..model.checkpoints import is_trained_checkpoint
    kind = "small model trained on the Python stdlib" if is_trained_checkpoint(path) else "random weights"
    return ModelChoice(path, f"{path.name} ({kind})", False, device)


def pick_speed_model() -> ModelChoice:
    """The model a chapter times. On a GPU (or with ``ENGINE_BOOK_MODEL``), the same as
    ``pick_model()``. On a CPU, a random checkpoint of the real width and vocabulary cut to
    ``SPEED_LAYERS`` layers: the tiny checkpoint's timings are ruled by its 152k-row LM head
    and would teach the wrong lesson, and the full 28 layers would take CI too long."""
    if torch.cuda.is_available() or os.environ.get("ENGINE_BOOK_MODEL"):
        return pick_model()
    path = ensure_checkpoint("qwen2.5-1.5b-random", SPEED_LAYERS)
    return ModelChoice(path, f"{path.name} (random weights, {SPEED_LAYERS} of 28 layers)", False, "cpu")


def show_source(obj) -> None:
    """Display the source of an engine_lib function or class, highlighted, in a notebook.
    A Triton kernel (``@triton.jit``, compiled or interpreted) shows the function it wraps."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)) and callable(getattr(obj, "fn", None)):
        obj = obj.fn
    source = inspect.getsource(obj)
    try:
        from IPython.display import Code, display

        display(Code(source, language="python"))
    except ImportError:
        print(source)


# ------------------------------------------------------------------------- words from numbers
def say(*parts: str) -> None:
    """Print a sentence wrapped at ``WIDTH`` columns."""
    print(textwrap.fill(" ".join(parts), WIDTH, break_on_hyphens=False, break_long_words=False))  # URLs intact


def say_here(*sentences: str) -> None:
    """Sentences shown as one block in place, where a cell interleaves them with tables: the site
    merges a cell's printed text into one block (``nb_merge_streams``), which would put the text
    under a second table above it, so these are displayed, not printed."""
    from IPython.display import Pretty, display

    display(Pretty("\n".join(textwrap.fill(s, WIDTH, break_on_hyphens=False, break_long_words=False)
                             for s in sentences)))


def relation(a, b, more: str = "faster", less: str = "slower", same: str = "about as fast as",
             tolerance: float = 0.05, paired: bool = False) -> str:
    """How ``a`` compares with ``b`` (higher is better), as words picked from the data:
    '2.4x faster than', '12% slower than' or 'about as fast as' (within ``tolerance``).

    Given ``timing.Samples`` (repeated readings), the verdict is ``timing.relation``'s instead:
    'within noise of' whenever the spreads overlap (``paired``: the per-round ratios straddle 1)."""
    from ..bench.timing import Samples
    from ..bench.timing import relation as noisy_relation

    if isinstance(a, Samples) or isinstance(b, Samples):
        return noisy_relation(a, b, more=more, less=less, paired=paired)
    r = a / b
    if abs(r - 1) <= tolerance:
        return same
    if r > 1:
        return f"{r:.1f}x {more} than" if r >= 1.5 else f"{100 * (r - 1):.0f}% {more} than"
    return f"{1 / r:.1f}x {less} than" if r <= 1 / 1.5 else f"{100 * (1 - r):.0f}% {less} than"


def time_relation(t_a: float, t_b: float, tolerance: float = 0.05) -> str:
    """``relation`` for durations, where lower is better."""
    return relation(1 / t_a, 1 / t_b, tolerance=tolerance)


GPU_CHECK_URL = "https://github.com/llm-inference-book/qwen-engine/blob/main/scripts/gpu_check.sh"


def gpu_record_note() -> str:
    """One sentence on the GPU records: the committed ones (device, commit), or, until one
    exists, that there is none and which script makes it."""
    gpu = [r["meta"] for r in committed_records() if r["meta"]["device"].startswith("cuda")]
    if gpu:
        named = ", ".join(f"{m['device_name']} at commit {m['git_commit']}" for m in gpu)
        return f"Chapter 08 shows the committed GPU records ({named})."
    return ("No GPU record has been committed yet, so this book shows no GPU numbers: "
            f"scripts/gpu_check.sh ({GPU_CHECK_URL}) makes one on a GPU machine.")


def peak_memory_line(device: str | torch.device | None = None) -> str:
    """The chapter's peak GPU memory since the last reset, or why there is none."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        return (f"peak GPU memory in this chapter: {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB "
                f"on {torch.cuda.get_device_name(dev)}")
    return "peak GPU memory: n/a (this run is on the CPU)"


# ------------------------------------------------------------------------------ tables, figures
def html_table(header: list[str], rows: list[list], caption: str | None = None, align_right_from: int = 1) -> str:
    """A small HTML table (renders the same in Jupyter, Colab and the built book)."""
    def cell(tag: str, value, i: int) -> str:
        style = ' style="text-align:right"' if i >= align_right_from else ""
        return f"<{tag}{style}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell("th", h, i) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", v, i) for i, v in enumerate(r)) + "</tr>" for r in rows)
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f'<table class="engine-table">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def show_table(header: list[str], rows: list[list], caption: str | None = None) -> None:
    from IPython.display import HTML, display

    display(HTML(html_table(header, rows, caption)))


COLUMN_IN = 6.8  # the text column at a 1280-px window: about 660 CSS px, 96 px per inch
MIN_PT = 10  # the smallest label on a figure, at the size it is shown


def fit_to_column(fig):
    """Draw ``fig`` at the column's width with no label under ``MIN_PT``: a wider figure gets a
    narrower canvas (same height), small text is raised, and the layout is redone. A wider
    diagram drawn by hand (axes switched off) is left as it is. -> fig"""
    import warnings

    from matplotlib.text import Text

    if any(not ax.axison for ax in fig.axes) and fig.get_size_inches()[0] > COLUMN_IN:
        return fig  # a diagram laid out by hand in its own coordinates: resizing would break it
    width, height = fig.get_size_inches()
    if width > COLUMN_IN:
        fig.set_size_inches(COLUMN_IN, height)
    for t in fig.findobj(Text):
        if t.get_text() and t.get_fontsize() < MIN_PT:
            t.set_fontsize(MIN_PT)
    titles = [(fig._suptitle, fig.get_size_inches()[0])] + [(ax.title, ax.get_position().width * fig.get_size_inches()[0])
                                                           for ax in fig.axes]
    for t, inches in titles:  # a title wider than its room wraps instead of running off the image
        if t is not None and t.get_text():
            chars = max(20, int(inches * 72 / (0.55 * t.get_fontsize())))
            t.set_text("\n".join(textwrap.fill(line, chars, break_on_hyphens=False) for line in t.get_text().split("\n")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fig.tight_layout()
        except Exception:  # a diagram without axes to lay out: savefig's tight bbox still trims it
            pass
    return fig


def show_figure(fig, name: str, caption: str) -> None:
    """Display a matplotlib figure as a captioned ``<figure id="fig-NAME">`` (then close it), drawn
    at the column's size (``fit_to_column``) and shown at that size (never shrunk)."""
    import matplotlib.pyplot as plt
    from IPython.display import HTML, display

    fit_to_column(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=192, bbox_inches="tight")  # 2 px per CSS px: sharp on any screen
    plt.close(fig)
    css_px = int.from_bytes(buf.getvalue()[16:20], "big") / 2  # the PNG header's width, in CSS px
    data = base64.b64encode(buf.getvalue()).decode()
    display(HTML(f'<figure id="fig-{html.escape(name)}" class="engine-figure">'
                 f'<img src="data:image/png;base64,{data}" alt="{html.escape(caption)}" '
                 f'style="width:{css_px:.0f}px;max-width:100%">'
                 f"<figcaption>{html.escape(caption)}</figcaption></figure>"))


# ---------------------------------------------------------------------------- committed records
def committed_records(kind: str = "bench") -> list[dict]:
    """The records committed under ``book/results`` (shipped as ``engine_lib.results``), by file
    name: ``bench`` (``<name>.json``), ``serve`` (the load tests, ``<name>.serve.json``) or
    ``kernels`` (chapter 14's kernel microbenchmarks, ``<device>.kernels.json``), ``quant``
    (chapter 10's perplexity record, ``<preset>.quant.json``), ``train`` (the small model's
    training record) or ``depth`` (the CPU at full depth, each system in its own process:
    ``bench/cpu_depth.py``, ``<name>.depth.json``) or ``kvcache`` (the int8 KV cache, ``bench/kv_int8.py``,
    ``<machine>.kvcache.json``) or ``suffix`` (suffix speculation, ``bench/suffix_spec.py``, ``<name>.suffix.json``)."""
    from importlib.resources import files

    kinds = ("check", "serve", "kernels", "quant", "train", "depth", "kvcache", "suffix")
    if kind != "bench" and kind not in kinds:
        raise ValueError(f"unknown record kind {kind!r}; choose from {('bench',) + kinds}")

    def wanted(name: str) -> bool:
        if kind != "bench":
            return name.endswith(f".{kind}.json")
        return name.endswith(".json") and not name.endswith(tuple(f".{k}.json" for k in kinds))

    out = []
    for entry in sorted(files("engine_lib.results").iterdir(), key=lambda p: p.name):
        if wanted(entry.name):
            record = json.loads(entry.read_text())
            record["file"] = entry.name
            out.append(record)
    return out
