"""engine_lib's house, read from its code: the import graph of its packages, their floors and line counts.

``python scripts/architecture.py`` rewrites the README's architecture section (between the ``ARCHITECTURE``
markers): a picture of the packages on their floors (a Mermaid graph, drawn by GitHub and the book's site),
the chapters that build each (the first line of its ``__init__.py``, or of a loose module's docstring) and
its line count. ``--check`` fails when the README differs from what the code says now (the tests run it).
Imports are read with ``ast`` alone, the ones inside functions included; nothing is run.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from engine_lib.book.house import source_lines

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "engine_lib"
README = ROOT / "README.md"
BEGIN, END = "<!-- ARCHITECTURE: written by scripts/architecture.py -->", "<!-- /ARCHITECTURE -->"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package's ``__init__.py`` is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package that it imports (at the top or inside a function)."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                # ``from pkg import name``: the submodule pkg.name if there is one, else pkg itself
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in files and t != name)
        graph[name] = found
    return graph


def node_of(module: str) -> str:
    """engine_lib.loop.scheduler -> loop; engine_lib.engine -> engine: one node per top-level package or module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def node_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph of the top-level nodes (a node's arrows to itself left out; the package's face, which only
    hands the public names on, left out)."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(node_of(m), set()).update(node_of(t) for t in targets if node_of(t) != node_of(m))
    out.pop("__init__", None)
    for targets in out.values():
        targets.discard("__init__")
    return out


def scripts_imports() -> set[str]:
    """The engine_lib nodes that scripts/ imports (scripts/ is one more node, above them)."""
    found = set()
    for path in (ROOT / "scripts").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found |= {node_of(n) for n in names if n.startswith("engine_lib.")}
    return found


def house() -> dict[str, set[str]]:
    """Every node of the house (engine_lib's packages and loose modules, and scripts/) -> the nodes it imports."""
    nodes = node_graph(imports(PACKAGE))
    nodes["scripts"] = scripts_imports()
    return nodes


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 1 for a node that imports none of the others, else 1 + the highest it imports."""
    memo: dict[str, int] = {}

    def floor(n: str) -> int:
        if n not in memo:
            memo[n] = 1 + max((floor(t) for t in graph.get(n, ())), default=0)
        return memo[n]
    return {n: floor(n) for n in graph}


def direct(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows no longer path implies (a transitive reduction): what the picture draws."""
    def reach(n: str, seen: set[str]) -> set[str]:
        for t in graph.get(n, ()):
            if t not in seen:
                seen.add(t)
                reach(t, seen)
        return seen
    return {n: {t for t in ts if not any(t in reach(o, set()) for o in ts - {t})} for n, ts in graph.items()}


def node_path(node: str) -> Path:
    return ROOT / "scripts" if node == "scripts" else PACKAGE / node if (PACKAGE / node).is_dir() \
        else PACKAGE / f"{node}.py"


def lines(node: str) -> str:
    """Lines of the node's source: its .py files (and the C++ of cpu/)."""
    count = source_lines(node_path(node))
    # rounded, so that the README's picture goes stale only when a package really grows or shrinks
    return f"~{round(count, -2):,}" if count >= 1000 else f"~{max(10, round(count, -1)):,}"


def chapters(node: str) -> str:
    """What the node's docstring says of the chapters that build it (its first line, up to the first colon)."""
    path = node_path(node)
    path = path / "__init__.py" if path.is_dir() else path
    if not path.is_file():
        return "the project's scripts"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.splitlines()[0] if doc else ""
    found = re.search(r"\b(Chapters? [^:;(]+|Every chapter|Defined in chapters? [0-9, and]+|chapters? [0-9, and]+)",
                      first + " " + doc)
    return found.group(1).rstrip(" .,").removeprefix("Defined in ").capitalize() if found else "-"


def section() -> str:
    """The README's architecture section, from the code as it stands."""
    nodes = house()
    floors = levels(nodes)
    order = sorted(nodes, key=lambda n: (-floors[n], n))
    label = {n: f"{n}{'/' if node_path(n).is_dir() else '.py'}" for n in nodes}  # engine_lib/ but scripts/
    out = [BEGIN, "", "```mermaid", "flowchart TB"]
    for floor in sorted(set(floors.values()), reverse=True):
        members = [n for n in order if floors[n] == floor]
        out.append(f"  subgraph F{floor}[\" \"]")
        out += [f"    {n}[\"{label[n]}<br/>{lines(n)} lines\"]" for n in members]
        out.append("  end")
    for n in order:
        out += [f"  {n} --> {t}" for t in sorted(direct(nodes)[n], key=lambda t: (-floors[t], t))]
    out += ["```", "", f"{len(nodes) + 1} nodes on {max(floors.values())} floors: every package and loose module of "
            "`engine_lib/`, `scripts/`, and the repository's own `book/` folder (the site's pages and records, which "
            "imports nothing, not drawn). An arrow is an import; only those no longer path implies are drawn. Written "
            "by `python scripts/architecture.py` from the code's own imports.", "",
            "| floor | package | built in | lines |", "|---:|---|---|---:|"]
    out += [f"| {floors[n]} | `{label[n]}` | {chapters(n)} | {lines(n)} |" for n in order]
    return "\n".join(out + ["", END])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the README's section is not what the code says")
    args = p.parse_args(argv)
    text = README.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    new = text[:text.index(BEGIN)] + section() + text[text.index(END) + len(END):]
    if args.check:
        if new != text:
            print("README.md's architecture section is out of date: run python scripts/architecture.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
