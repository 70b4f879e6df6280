"""Each chapter's first code cell says what the chapter downloads and compiles (book/chapter_plan.py),
and what it says matches the notebook: the rungs its code names, whether it loads a model, whether it
serves."""

import json
import re
from pathlib import Path

import pytest

from engine_lib.book.chapter_plan import CHAPTERS, ChapterNeeds, compile_line, plan_lines
from engine_lib.stages import STAGES

CHAPTER_DIR = Path(__file__).resolve().parents[1] / "chapters"
NOTEBOOKS = sorted(CHAPTER_DIR.glob("[0-9][0-9]_*.ipynb"))


def code_cells(path: Path) -> list[str]:
    """The code cells, without chapter 00's optional Drive cell (Colab only, skipped elsewhere)."""
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"
            and "keep_on_drive()" not in "".join(c["source"])]


def test_every_chapter_has_a_plan_and_every_plan_a_chapter():
    assert sorted(p.name[:2] for p in NOTEBOOKS) == sorted(CHAPTERS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_the_first_code_cell_announces_its_own_chapter(path):
    """After the Colab install cell (hidden on the site, skipped in CI), the first cell that runs
    everywhere says what the chapter fetches and builds, before any other cell can."""
    install, first = code_cells(path)[:2]
    assert "%pip install" in install and "announce" not in install
    imports = re.findall(r"^(?:from|import) engine_lib\S*", first, re.M)
    assert imports[:1] == ["from engine_lib.book.chapter_plan"] and \
        f'announce("{path.name[:2]}")' in first, f"{path.name}: the first code cell must call announce"


BOOK_NOTEBOOKS = NOTEBOOKS + sorted((CHAPTER_DIR.parent / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", BOOK_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name[:2]}")
def test_the_triton_interpreter_switch_comes_before_triton_loads(path):
    """Triton reads TRITON_INTERPRET when triton.language is first imported (its own library
    functions, tl.sum among them, are kernels), and every engine_lib import loads it. Set later,
    a notebook's kernels run in the interpreter but tl.sum does not, and the first reduction fails
    ("Cannot call @triton.jit'd outside of the scope of a kernel"): chapter 14 in CI, stop 31."""
    code = "\n".join(code_cells(path)[1:])  # the Colab install cell never runs off Colab
    switch = code.find("TRITON_INTERPRET\", \"1\")")
    if switch < 0:
        return
    loads = [m.start() for m in re.finditer(r"^(?:from|import) (?:engine_lib|triton)\b", code, re.M)]
    assert loads and switch < min(loads), f"{path.name}: TRITON_INTERPRET is set after triton or engine_lib is imported"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_the_plan_names_every_rung_the_code_names(path):
    """A rung's name in quotes in the chapter's code means the chapter builds it (or names it
    to build it): it must be in the plan, so a compile is never a surprise."""
    needs = CHAPTERS[path.name[:2]]
    code = "\n".join(code_cells(path)[2:])
    named = {s for s in STAGES if re.search(rf"[\"']{s}[\"']", code)}
    planned = set(needs.rungs + needs.gpu_rungs + needs.cpu_rungs)
    assert named <= planned, f"{path.name}: rungs named in the code but not in the plan: {named - planned}"
    loads = bool(re.search(r"pick_model\(|pick_speed_model\(|ensure_checkpoint\(", code))
    assert loads == needs.model, f"{path.name}: loads a model = {loads}, the plan says {needs.model}"
    serves = bool(re.search(r"BackgroundServer|build_state|live_records|loadtest", code))
    assert serves <= needs.serve, f"{path.name}: it serves, the plan does not name the serving extra"


def test_the_lines_say_what_happens_on_each_device(monkeypatch):
    monkeypatch.delenv("ENGINE_BOOK_MODEL", raising=False)
    tokens = plan_lines("01", "cpu", colab=False)
    assert tokens == ["Downloads: nothing (the tokenizer files ship with the package).",
                      "Compiles: nothing: every rung here runs eagerly."]
    fused = plan_lines("07", "cpu", colab=True)
    assert "the engine_lib package from GitHub" in fused[0] and "no model: its checkpoints are made on this machine" in fused[0]
    assert "fused rung (torch.compile, C++ on this CPU)" in fused[1]
    assert "fused, int8 and int4 rungs (torch.compile, then captured as CUDA graphs)" in compile_line(CHAPTERS["08"], True)
    assert "int4" not in compile_line(CHAPTERS["08"], on_gpu=False)
    assert "half" not in compile_line(CHAPTERS["09"], on_gpu=False)  # eager on a CPU: nothing compiles
    assert compile_line(CHAPTERS["09"], on_gpu=False).startswith("nothing")
    assert "fused rung" in compile_line(CHAPTERS["09"], on_gpu=True)
    assert "interpreter" in compile_line(ChapterNeeds(("triton",)), on_gpu=False)
    with pytest.raises(KeyError, match="no plan for chapter '99'"):
        plan_lines("99")


def test_on_colab_a_download_points_to_the_drive_cache(monkeypatch):
    from pathlib import Path

    from engine_lib.model import hub

    monkeypatch.delenv("ENGINE_BOOK_MODEL", raising=False)
    monkeypatch.setattr(hub, "plan_download", lambda repo: hub.DownloadPlan(repo, None, int(3.1e9), "the hub's sizes"))
    colab = plan_lines("05", "cuda", colab=True)[0]
    assert "3.10 GB" in colab and "keep_on_drive()" in colab
    assert "keep_on_drive" not in plan_lines("05", "cuda", colab=False)[0]
    monkeypatch.setattr(hub, "plan_download", lambda repo: hub.DownloadPlan(repo, Path("/cache/x"), 0, "cached"))
    assert "is reused" in plan_lines("05", "cuda", colab=True)[0]
