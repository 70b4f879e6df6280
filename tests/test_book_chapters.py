"""The chapters as a reader sees them: no measured number typed into prose, one source for the
repository URL, the helpers from engine_lib, a summary and exercises, and a T4 memory check.

Static checks on the committed notebooks; ``pytest --nbmake`` executes them separately.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
# a number followed by a unit of time, speed, memory or a speed-up: such a figure is measured, so it
# must come from code output or a named record, never from typed prose
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,.]*\s*(?:tok/s|tokens/s|tokens per second|ms\b|µs\b|us\b|seconds?\b|s\b|GiB\b|MiB\b|KiB\b|"
    r"GB\b|MB\b|GB/s|TB/s|x faster|x slower|× faster|times faster)", re.IGNORECASE)


def cells(path: Path, kind: str) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def repo_url() -> str:
    text = (ROOT / "_config.yml").read_text()
    return re.search(r"^repository:\s*\n\s+url:\s*(\S+)", text, re.MULTILINE).group(1)


def test_there_are_chapters():
    assert len(CHAPTERS) >= 10


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_prose_states_no_measured_figure(path):
    found = []
    for text in cells(path, "markdown"):
        prose = re.sub(r"\$\$.*?\$\$|\$[^$\n]*\$|`[^`\n]*`", "", text, flags=re.DOTALL)  # math and code are not prose
        found += [m.group(0) for m in MEASURED.finditer(prose)]
    assert not found, f"{path.name}: measured figures typed into markdown: {found}"


def test_the_rule_catches_typed_figures():
    for typed in ("decodes at 12.5 tok/s", "a step takes 3 ms", "peak 1.9 GiB", "it is 2.4x faster", "took 50 s"):
        assert MEASURED.search(typed), typed
    for fine in ("28 layers", "12 query heads", "float16 tops out at 65,504", "chapter 05"):
        assert not MEASURED.search(fine), fine


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_badge_and_install_cell_use_the_one_repository_url(path):
    url = repo_url()
    first = cells(path, "markdown")[0]
    badge = re.search(r"colab\.research\.google\.com/github/([^)\s]+)/blob/main/chapters/" + re.escape(path.name), first)
    assert badge and "https://github.com/" + badge.group(1) == url, f"{path.name}: badge does not point at {url}"
    install = next(c for c in cells(path, "code") if "google.colab" in c)
    assert f"git+{url}" in install, f"{path.name}: install cell does not use {url}"


CLOSING = "15_putting_it_together"  # the last chapter ends with the scoreboard and a glossary, not exercises


def test_the_book_ends_with_the_closing_chapter():
    assert CHAPTERS[-1].stem == CLOSING
    listed = re.findall(r"file: chapters/(\S+)", (ROOT / "_toc.yml").read_text())
    assert listed == [p.stem for p in CHAPTERS], "_toc.yml lists the chapters out of order or misses one"


def test_the_closing_chapter_has_a_glossary_the_scoreboard_and_no_exercises():
    path = ROOT / "chapters" / f"{CLOSING}.ipynb"
    md, code = "\n".join(cells(path, "markdown")), "\n".join(cells(path, "code"))
    assert "## Exercises" not in md
    glossary = re.search(r"```\{glossary\}\n(.*?)\n```", md, re.DOTALL)
    assert glossary, "no MyST glossary"
    lines = glossary.group(1).splitlines()
    terms = {line.strip() for line in lines if re.match(r"^\S", line)}
    for term in ("rung", "kernel", "arithmetic intensity", "roofline", "ridge point", "TTFT", "TPOT", "KV cache",
                 "GQA", "CUDA graph", "continuous batching", "paged attention", "quantization",
                 "speculative decoding", "warp", "SM", "tensor core", "Ampere", "Turing"):
        assert term in terms, f"the glossary does not define {term!r}"
    assert all(re.match(r"^(  \S|$)", line) for line in lines if not re.match(r"^\S", line)), \
        "a glossary definition is not indented by two spaces"
    assert "live_records(" in code and "committed_boards()" in code, "the scoreboard is not built from engine_lib"
    for stem in [p.stem for p in CHAPTERS if p.stem != CLOSING]:
        assert f"{{doc}}`{stem}`" in md, f"'What you built' does not link chapter {stem}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_ends_with_a_summary_exercises_and_the_t4_check(path):
    md = "\n".join(cells(path, "markdown"))
    assert "## Summary" in md, f"{path.name}: no summary"
    if path.stem != CLOSING:
        exercises = md.split("## Exercises", 1)
        assert len(exercises) == 2, f"{path.name}: no exercises"
        items = re.findall(r"^\d+\. |^:+\{admonition\} Exercise ", exercises[1], re.MULTILINE)
        assert 2 <= len(items) <= 4, f"{path.name}: {len(items)} exercises"
    code = cells(path, "code")
    assert any("MemoryBudget.start()" in c for c in code[:3]), f"{path.name}: no memory budget at the top"
    assert "budget.check()" in code[-1] and "peak_memory_line()" in code[-1], f"{path.name}: no T4 check at the end"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_helpers_come_from_engine_lib(path):
    code = "\n".join(cells(path, "code"))
    for helper in ("sync", "time_it", "median_time", "kv_bytes_per_token", "naive_step", "timed"):
        assert not re.search(rf"^def {helper}\b", code, re.MULTILINE), f"{path.name} re-implements {helper}()"
    assert "plt.show()" not in code, f"{path.name}: figures go through book.show_figure (captioned, sized)"
    for w in re.findall(r"figsize=\(([\d.]+)", code):
        assert float(w) <= 8, f"{path.name}: a figure {w} inches wide (the page fits 8)"


def test_no_reference_to_files_readers_do_not_have():
    pages = [*CHAPTERS, *(ROOT / "book").glob("*.md")]
    for page in pages:
        text = page.read_text()
        for name in ("FACTS.md", "WRITE-UP", "../shared", "ECOSYSTEM.md"):
            assert name not in text, f"{page.name} points readers to {name}"


# ---------------------------------------------------------------------- issue 19: true on every build
NUMBER = {w: i for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight"))}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_printed_strings_carry_no_raw_backticks(path):
    """Output is plain text: a backtick printed by say()/print() reaches the page as a backtick."""
    found = []
    for text in cells(path, "code"):
        for line in text.splitlines():
            code = re.sub(r"\s#.*$", "", line)
            if line.lstrip().startswith("#") or '"""' in line:
                continue
            if "`" in code:
                found.append(line.strip())
    assert not found, f"{path.name}: backticks in printed strings: {found}"


def test_number_words_count_what_they_name():
    """'The engine keeps N of them': N is the numbered list that follows, and no other sentence of
    chapter 06 gives those places another number."""
    text = "\n".join(cells(ROOT / "chapters" / "06_half_precision.ipynb", "markdown"))
    m = re.search(r"keeps (\w+) of them in higher precision:\n\n((?:\d\. .*\n(?: {3}.*\n)*)+)", text)
    assert m, "chapter 06 no longer lists the places it keeps in fp32"
    listed = len(re.findall(r"^\d\. ", m.group(2), re.MULTILINE))
    assert NUMBER[m.group(1)] == listed, f"says {m.group(1)}, lists {listed}"
    others = re.findall(r"\b(\w+) places where the engine keeps fp32", text)
    assert all(w not in NUMBER or NUMBER[w] == listed for w in others), others


FIXED_DIRECTIONS = [  # sentences that stated what only a measurement can decide (issue 19)
    "int4 buys the most speed", "so the ratio grows more slowly", "D took the blocks B freed",
    "gets B's blocks", "remove what is left between the GPU", "the left panel",
    "chapter 08 collects the records measured on GPUs", "The GPU records in chapter 08 show",
    "chapter 08 shows the committed GPU records",
]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_fixed_sentence_states_a_measured_direction(path):
    text = "\n".join(cells(path, "markdown") + cells(path, "code"))
    found = [s for s in FIXED_DIRECTIONS if s in text]
    assert not found, f"{path.name}: {found}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_code_cell_parses(path):
    import ast

    for i, text in enumerate(cells(path, "code")):
        if "%pip" in text:  # the Colab install cell: an IPython magic
            continue
        try:
            ast.parse(text)
        except SyntaxError as exc:
            pytest.fail(f"{path.name}, code cell {i}: {exc}")
