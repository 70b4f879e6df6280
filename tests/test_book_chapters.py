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


CLOSING = "15_putting_it_together"  # the main line ends with the scoreboard and a glossary, not exercises
APPENDICES = ("16_cpu_appendix",)  # after the main line: one machine's engineering, no exercises


def test_the_book_ends_with_the_closing_chapter():
    assert [p.stem for p in CHAPTERS if p.stem not in APPENDICES][-1] == CLOSING
    assert [p.stem for p in CHAPTERS][-len(APPENDICES):] == list(APPENDICES), "the appendices come after the main line"
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
    if path.stem not in (CLOSING, *APPENDICES):
        exercises = md.split("## Exercises", 1)
        assert len(exercises) == 2, f"{path.name}: no exercises"
        items = re.findall(r"^\d+\. |^:+\{admonition\} Exercise ", exercises[1], re.MULTILINE)
        assert 2 <= len(items) <= 4, f"{path.name}: {len(items)} exercises"
    code = [c for c in cells(path, "code") if "keep_on_drive()" not in c]  # chapter 00's optional Drive cell
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


def glossary_terms() -> set[str]:
    md = "\n".join(cells(ROOT / "chapters" / f"{CLOSING}.ipynb", "markdown"))
    body = re.search(r"```\{glossary\}\n(.*?)\n```", md, re.DOTALL).group(1)
    return {line.strip() for line in body.splitlines() if re.match(r"^\S", line)}


def term_links(text: str) -> list[str]:
    """The glossary terms a text links with MyST's term role, the displayed text dropped."""
    return [m.group(2) or m.group(1) for m in re.finditer(r"(?<!`)\{term\}`([^`<]*?)\s*(?:<([^>]+)>)?`", text)]


def test_the_glossary_is_linked_from_eight_chapters_and_every_link_lands():
    terms, linking = glossary_terms(), []
    for path in CHAPTERS:
        links = term_links("\n".join(cells(path, "markdown")))
        unknown = [t for t in links if t not in terms]
        assert not unknown, f"{path.stem} links terms the glossary does not define: {unknown}"
        if links and path.stem not in (CLOSING, *APPENDICES):
            linking.append(path.stem)
    assert len(linking) >= 8, f"only {linking} link to the glossary"


def test_term_links_are_read_with_and_without_a_display_text():
    assert term_links("a {term}`KV cache`, two {term}`Rungs <rung>` and {term}`the ridge <ridge point>`") == [
        "KV cache", "rung", "ridge point"]


# ---------------------------------------------------------------------- issue 51: the second edition
GLOSSARY_CELL = "```{glossary}"
MAX_CELL_WORDS, MAX_CHAPTER_10_WORDS = 450, 3500
# the main line names no instruction set: that engineering is the CPU appendix's
INSTRUCTION_SETS = re.compile(r"\b(?:AVX[-\w]*|VNNI|AMX|SSE\d?|NEON|vpmadd\w*|vpdp\w*)\b")


def words(text: str) -> int:
    return len(re.findall(r"\S+", text))


def test_no_markdown_cell_outside_the_glossary_runs_over_450_words():
    long = [(p.stem, words(c)) for p in CHAPTERS for c in cells(p, "markdown")
            if GLOSSARY_CELL not in c and words(c) > MAX_CELL_WORDS]
    assert not long, f"markdown cells over {MAX_CELL_WORDS} words: {long}"


def test_chapter_10_is_about_quantization_itself():
    md = "\n".join(cells(ROOT / "chapters" / "10_quantization.ipynb", "markdown"))
    assert words(md) <= MAX_CHAPTER_10_WORDS, f"chapter 10 has {words(md)} words"


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.stem not in APPENDICES], ids=lambda p: p.stem)
def test_the_main_line_names_no_instruction_set(path):
    found = sorted({m.group(0) for c in cells(path, "markdown") + cells(path, "code") for m in INSTRUCTION_SETS.finditer(c)})
    assert not found, f"{path.stem} names {found}: that belongs in the CPU appendix"


def test_the_rules_can_fail():
    assert INSTRUCTION_SETS.findall("int4 with AVX-512 VNNI, and AMX tiles; vpmaddubsw") == [
        "AVX-512", "VNNI", "AMX", "vpmaddubsw"]
    assert words("one two  three\nfour") == 4
