"""How big each part of engine_lib is, counted from its files (chapter 15; the README's house counts the same way)."""

from __future__ import annotations

from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1]
# the packages one generated token passes through, from Engine.generate down to the model and back
TOKEN_PATH = ("engine.py", "model/", "cache/", "step/", "sampling/", "loop/")


def source_lines(path: Path) -> int:
    """Lines of a module, or of a package's .py files (and the C++ and shell of cpu/)."""
    files = [path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.cpp"), *path.glob("*.sh")]
    return sum(len(f.read_text().splitlines()) for f in files)


def part_lines() -> dict[str, int]:
    """Every package (``name/``) and loose module (``name.py``) of engine_lib -> its lines, largest first."""
    parts = [p for p in ENGINE.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"]
    counts = {p.name + ("/" if p.is_dir() else ""): source_lines(p) for p in parts}
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
