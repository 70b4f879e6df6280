"""Write each chapter's "## Exercises" cell from its source of truth, engine_lib/exercises/chNN.py.

    python scripts/add_exercises.py          rewrite chapters/*.ipynb (idempotent)
    python scripts/add_exercises.py --check  exit 1 if a chapter is out of date

Per chapter it touches two cells and nothing else: the markdown cell that starts with
"## Exercises" (split off the end of the summary cell the first time, if it was part of it) and
the one code cell right after it, ``from engine_lib.exercises import check``. Run it again after
a merge that changed a chapter: it finds the cells by their heading, not by position.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_lib.exercises import CHAPTERS  # noqa: E402

HEADING = "## Exercises"
IMPORT_CELL = "from engine_lib.exercises import check"
INTRO = """\
Each exercise asks for something the engine can check. Run the next cell once, write your answer
in a new cell, then call the exercise's check: it runs your answer next to the engine's own code
on a few cases, one of them an edge case, and names the first thing that differs. Try each
exercise before you open the [worked solutions]({link})."""


def chapter_path(ch: str) -> Path:
    return ROOT / "chapters" / f"{CHAPTERS[ch].SOLUTIONS}.ipynb"


def exercises_markdown(ch: str) -> str:
    mod = CHAPTERS[ch]
    parts = [HEADING, INTRO.format(link=f"../solutions/{mod.SOLUTIONS}.ipynb")]
    for i, (title, body) in enumerate(mod.EXERCISES, 1):
        parts.append(f"::::{{admonition}} Exercise {ch}.{i} · {title}\n:class: exercise\n\n{body}\n::::")
    return "\n\n".join(parts)


def _source(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _markdown(text: str, cell_id: str) -> dict:
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": _source(text)}


def _code(text: str, cell_id: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": cell_id, "metadata": {}, "outputs": [],
            "source": _source(text)}


def apply(ch: str, path: Path | None = None) -> bool:
    """Bring one chapter up to date; True if it changed.

    Robust to a merge: exercises left at the end of another cell (the summary) are cut off it,
    and of several cells that start with the heading only the first is kept.
    """
    path = path or chapter_path(ch)
    before = path.read_text()
    nb = json.loads(before)
    cells = nb["cells"]
    text = lambda c: "".join(c["source"])  # noqa: E731
    at = None  # index of the one exercises cell
    i = 0
    while i < len(cells):
        c = cells[i]
        if c["cell_type"] != "markdown" or HEADING not in text(c):
            i += 1
            continue
        head = text(c).partition(HEADING)[0]
        if head.strip():  # exercises at the end of another cell: keep that cell's text, cut them off
            c["source"] = _source(head.rstrip("\n"))
            if at is None:
                cells.insert(i + 1, _markdown("", f"exercises-{ch}"))
                at = i + 1
            i += 2 if at == i + 1 else 1
        elif at is None:
            at = i
            i += 1
        else:  # a second exercises cell (a merge kept both): drop it and its import cell
            del cells[i]
            if i < len(cells) and cells[i]["cell_type"] == "code" and text(cells[i]).strip() == IMPORT_CELL:
                del cells[i]
    if at is None:
        raise SystemExit(f"{path.name}: no markdown cell with {HEADING!r}")
    cells[at] = _markdown(exercises_markdown(ch), cells[at].get("id", f"exercises-{ch}")) | {
        "metadata": cells[at].get("metadata", {})}
    nxt = cells[at + 1] if at + 1 < len(cells) else None
    if nxt is not None and nxt["cell_type"] == "code" and text(nxt).strip() == IMPORT_CELL:
        nxt["source"] = _source(IMPORT_CELL)
    else:
        cells.insert(at + 1, _code(IMPORT_CELL, f"exercises-check-{ch}"))
    after = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if after != before:
        path.write_text(after)
    return after != before


def main(argv: list[str]) -> int:
    check_only = "--check" in argv
    stale = []
    for ch in sorted(CHAPTERS):
        if check_only:
            original = chapter_path(ch).read_text()
            if apply(ch):
                stale.append(chapter_path(ch).name)
                chapter_path(ch).write_text(original)
        elif apply(ch):
            print(f"updated {chapter_path(ch).name}")
    if stale:
        print("out of date (run python scripts/add_exercises.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
