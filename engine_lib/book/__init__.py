"""Small helpers the chapters share: the environment printout, the model choice, showing source,
sentences and tables built from measured numbers, figures with captions, committed records.

Used by every chapter in ``chapters/``; engine code itself never lives in a notebook.
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
from ..checkpoints import REAL_MODEL_ID, ensure_checkpoint
from ..errors import ModelNotFoundError
from ..loader import resolve_model_dir

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
    def note(self) -> str:
        return "real Qwen2.5-1.5B-Instruct weights" if self.is_real else RANDOM_NOTE.format(device=self.device.upper())


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
        path = resolve_model_dir(override)
        from ..checkpoints import is_random_checkpoint
        return ModelChoice(path, path.name, not is_random_checkpoint(path), device)
    if device == "cuda":
        try:
            return ModelChoice(resolve_model_dir(REAL_MODEL_ID), REAL_MODEL_ID, True, device)
        except ModelNotFoundError as exc:
            print(f"real model unavailable ({exc}); falling back to the offline checkpoint")
    preset = preset or os.environ.get("ENGINE_BOOK_PRESET", "tiny")
    path = ensure_checkpoint(preset, layers)
    return ModelChoice(path, f"{path.name} (random weights)", False, device)


def pick_speed_model() -> ModelChoice:
    """The model a chapter times. On a GPU (or with ``ENGINE_BOOK_MODEL``), the same as
    ``pick_model()``. On a CPU, a random checkpoint of the real width and vocabulary cut to
    ``SPEED_LAYERS`` layers: the tiny checkpoint's timings are ruled by its 152k-row LM head
    and would teach the wrong lesson, and the full 28 layers would take CI too long."""
    if torch.cuda.is_available() or os.environ.get("ENGINE_BOOK_MODEL"):
        return pick_model()
    path = ensure_checkpoint("qwen2.5-1.5b-random", SPEED_LAYERS)
    return ModelChoice(path, f"{path.name} (random, {SPEED_LAYERS} of 28 layers)", False, "cpu")


def show_source(obj) -> None:
    """Display the source of an engine_lib function or class, highlighted, in a notebook."""
    source = inspect.getsource(obj)
    try:
        from IPython.display import Code, display

        display(Code(source, language="python"))
    except ImportError:
        print(source)


# ------------------------------------------------------------------------- words from numbers
def say(*parts: str) -> None:
    """Print a sentence wrapped at ``WIDTH`` columns."""
    print(textwrap.fill(" ".join(parts), WIDTH))


def relation(a: float, b: float, more: str = "faster", less: str = "slower", same: str = "about as fast as",
             tolerance: float = 0.05) -> str:
    """How ``a`` compares with ``b`` (higher is better), as words picked from the data:
    '2.4x faster than', '12% slower than' or 'about as fast as' (within ``tolerance``)."""
    r = a / b
    if abs(r - 1) <= tolerance:
        return same
    if r > 1:
        return f"{r:.1f}x {more} than" if r >= 1.5 else f"{100 * (r - 1):.0f}% {more} than"
    return f"{1 / r:.1f}x {less} than" if r <= 1 / 1.5 else f"{100 * (1 - r):.0f}% {less} than"


def time_relation(t_a: float, t_b: float, tolerance: float = 0.05) -> str:
    """``relation`` for durations, where lower is better."""
    return relation(1 / t_a, 1 / t_b, tolerance=tolerance)


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


def show_figure(fig, name: str, caption: str) -> None:
    """Display a matplotlib figure as a captioned ``<figure id="fig-NAME">`` (then close it)."""
    import matplotlib.pyplot as plt
    from IPython.display import HTML, display

    width_in = fig.get_size_inches()[0]
    if width_in > 8.01:
        raise ValueError(f"figure {name!r} is {width_in:.1f} in wide: at most 8 in fits the page")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    display(HTML(f'<figure id="fig-{html.escape(name)}" class="engine-figure">'
                 f'<img src="data:image/png;base64,{data}" alt="{html.escape(caption)}" style="max-width:100%">'
                 f"<figcaption>{html.escape(caption)}</figcaption></figure>"))


# ---------------------------------------------------------------------------- committed records
def committed_records(kind: str = "bench") -> list[dict]:
    """The records committed under ``book/results`` (shipped as ``engine_lib.results``), by file
    name: ``bench`` (``<name>.json``) or ``serve`` (the load tests, ``<name>.serve.json``)."""
    from importlib.resources import files

    def wanted(name: str) -> bool:
        if kind == "serve":
            return name.endswith(".serve.json")
        return name.endswith(".json") and not name.endswith((".check.json", ".serve.json"))

    out = []
    for entry in sorted(files("engine_lib.results").iterdir(), key=lambda p: p.name):
        if wanted(entry.name):
            record = json.loads(entry.read_text())
            record["file"] = entry.name
            out.append(record)
    return out
