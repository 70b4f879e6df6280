"""What each chapter downloads and compiles, said in its first code cell before it does either.

A reader on a free Colab runtime otherwise meets a multi-gigabyte download or a minutes-long
compile without warning. Each chapter's first code cell calls ``announce("NN")``, which reads the
chapter's entry in ``CHAPTERS`` (the rungs it builds engines at, whether it loads a model, whether
it needs the serving extra) and says, for the machine it runs on:

- **downloads**: on a GPU with hub access, the real model and its size (``hub.plan_download``: the
  hub's own file sizes, or "already cached"); on a CPU, nothing, since its checkpoints are made on
  the machine (random weights) or copied from the package (the trained preset);
- **compiles**: the decode step of every rung that runs through ``torch.compile`` (on a GPU also
  captured as CUDA graphs), and Triton's kernels where the ``triton`` rung runs; each compile prints
  its own measured time when it happens (``compiled_step``).

``tests/test_book_chapter_plan.py`` checks each entry against its notebook's code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..stages import STAGES


@dataclass(frozen=True)
class ChapterNeeds:
    rungs: tuple[str, ...]  # the ladder's rungs the chapter builds an Engine at, on any device
    gpu_rungs: tuple[str, ...] = ()  # ... only on a GPU
    cpu_rungs: tuple[str, ...] = ()  # ... only on a CPU
    model: bool = True  # loads a model (book.pick_model / pick_speed_model)
    serve: bool = False  # needs the [serve] extra (FastAPI, the OpenAI client)
    every_rung_on_gpu: bool = False  # on a GPU it measures every rung that can run there


CHAPTERS: dict[str, ChapterNeeds] = {
    "00": ChapterNeeds(("naive", "kv_cache")),
    "01": ChapterNeeds((), model=False),
    "02": ChapterNeeds(("naive",)),
    "03": ChapterNeeds(("naive", "kv_cache")),
    "04": ChapterNeeds(("naive",)),
    "05": ChapterNeeds(("naive", "kv_cache", "half")),
    "06": ChapterNeeds(("kv_cache", "half")),
    "07": ChapterNeeds(("kv_cache", "half", "fused")),
    "08": ChapterNeeds(("naive", "kv_cache", "half", "fused"), every_rung_on_gpu=True),
    "09": ChapterNeeds(("kv_cache",), gpu_rungs=("fused",), cpu_rungs=("half",)),
    "10": ChapterNeeds(("half", "fused", "int8", "int4")),
    "11": ChapterNeeds(("kv_cache",)),
    "12": ChapterNeeds(("kv_cache",), gpu_rungs=("fused",), cpu_rungs=("half",), serve=True),
    "13": ChapterNeeds(("kv_cache",), serve=True),
    "14": ChapterNeeds(("kv_cache", "fused", "triton")),
    "15": ChapterNeeds(("kv_cache", "half", "fused", "int4"), serve=True, every_rung_on_gpu=True),
    "16": ChapterNeeds((), model=False),  # the CPU appendix: kernels and records, no engine
}


def download_line(needs: ChapterNeeds, on_gpu: bool, colab: bool) -> str:
    parts = []
    if colab:
        parts.append("the engine_lib package from GitHub (the cell above, pip)"
                     + (" with its serving extra (FastAPI, the OpenAI client)" if needs.serve else ""))
    override = os.environ.get("ENGINE_BOOK_MODEL")
    if needs.model and (on_gpu or override):
        from ..model.hub import REAL_MODEL_ID, plan_download

        repo = override or REAL_MODEL_ID
        if os.path.isdir(os.path.expanduser(repo)):
            parts.append(f"nothing for the model (the local folder {repo})")
        else:
            plan = plan_download(repo)
            if plan.cached is not None:
                parts.append(f"nothing for {repo}: the copy in the Hugging Face cache is reused")
            else:
                size = f"{plan.nbytes / 1e9:.2f} GB" if plan.nbytes is not None else "size unknown"
                later = ("; each chapter's fresh Colab runtime starts without it, unless keep_on_drive() (chapter 00) "
                         "keeps it on Google Drive" if colab else "; later chapters reuse the copy")
                parts.append(f"{repo} ({size}, {plan.source}){later}")
    elif needs.model:
        parts.append("no model: its checkpoints are made on this machine (random weights) or copied from the "
                     "package (the small trained model)")
    return "; ".join(parts) if parts else "nothing (the tokenizer files ship with the package)"


def compile_line(needs: ChapterNeeds, on_gpu: bool) -> str:
    here = needs.rungs + (needs.gpu_rungs if on_gpu else needs.cpu_rungs)
    rungs = [r for r in STAGES if r in here or (on_gpu and needs.every_rung_on_gpu)]
    steps = [r for r in rungs if STAGES[r].compiles_step]
    parts = []
    if steps:
        how = "torch.compile, then captured as CUDA graphs" if on_gpu else "torch.compile, C++ on this CPU"
        names = steps[0] if len(steps) == 1 else f"{', '.join(steps[:-1])} and {steps[-1]}"
        parts.append(f"the decode step of the {names} rung{'s' if len(steps) > 1 else ''} ({how}), each compile "
                     "printing its measured time")
    if "triton" in rungs:
        parts.append("our Triton kernels, by Triton on their first launch at each shape, without a line of their "
                     "own" if on_gpu else "nothing for the triton rung: without a GPU, Triton's interpreter runs "
                     "its kernels")
    if not parts:
        return "nothing: every rung here runs eagerly"
    return "; ".join(parts)


def plan_lines(chapter: str, device: str | None = None, colab: bool | None = None) -> list[str]:
    """The chapter's two sentences for this machine (``device``: "cuda" or "cpu", default: what is here)."""
    import sys

    if chapter not in CHAPTERS:
        raise KeyError(f"no plan for chapter {chapter!r}; chapters: {', '.join(CHAPTERS)}")
    needs = CHAPTERS[chapter]
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    colab = "google.colab" in sys.modules if colab is None else colab
    return [f"Downloads: {download_line(needs, on_gpu, colab)}.", f"Compiles: {compile_line(needs, on_gpu)}."]


def announce(chapter: str) -> None:
    """Print what chapter ``chapter`` ("00" to "16") downloads and compiles here, before it does either."""
    from . import say

    for line in plan_lines(chapter):
        say(line)
