"""The house is one-way: no import cycles in engine_lib, and the engine imports nothing from its tooling.

The engine core (config, loader, layers, model, caches, runner, engine, ...) is imported by the
tooling around it: ``book/`` (the chapters' helpers), ``bench/`` (measurements), ``serve/`` (the
HTTP server) and ``cli.py``. An arrow the other way would make the engine depend on a page, a
benchmark or a server. Every import counts, including the ones inside functions: a lazy import
hides a dependency from a reader, not from the program. Read with ``ast`` alone, nothing is run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "engine_lib"
TOOLING = ("engine_lib.book", "engine_lib.bench", "engine_lib.serve", "engine_lib.exercises", "engine_lib.cli",
           "engine_lib.__main__")


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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_tooling(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLING)


def test_the_import_reader_sees_the_engine_s_own_arrows():
    graph = imports(PACKAGE)
    assert "engine_lib.step.runner" in graph["engine_lib.engine"]  # a top-level import
    assert "engine_lib.bench.run" in graph["engine_lib.cli"]  # one inside a function
    assert "engine_lib.book" in graph["engine_lib.book.memory_budget"]  # ``from . import WIDTH``


def test_no_modules_of_engine_lib_import_each_other_in_a_loop():
    found = cycles(imports(PACKAGE))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_engine_core_imports_nothing_from_the_book_the_bench_the_server_or_the_cli():
    upward = sorted(f"{m} -> {t}" for m, targets in imports(PACKAGE).items() if not is_tooling(m)
                    for t in targets if is_tooling(t))
    assert not upward, "the engine core imports its tooling: " + ", ".join(upward)


def test_a_loop_and_an_upward_import_are_caught(tmp_path):
    pkg = tmp_path / "engine_lib"
    (pkg / "book").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "book" / "__init__.py").write_text("WIDTH = 76\n")
    (pkg / "kv_cache.py").write_text("def f():\n    from .book import WIDTH\n")  # core -> book, lazily
    (pkg / "loader.py").write_text("from . import model\n")
    (pkg / "model.py").write_text("from .loader import load\n")
    graph = imports(pkg)
    assert cycles(graph) == [["engine_lib.model.loader", "engine_lib.model.qwen2"]]
    assert graph["engine_lib.cache.contiguous"] == {"engine_lib.book"} and is_tooling("engine_lib.book")


def model_callers(root: Path, package: str = "engine_lib.serve") -> dict[str, set[str]]:
    """Module -> the functions in it that call a model (``model(...)`` or ``self.model(...)``)."""
    out: dict[str, set[str]] = {}
    for name, path in module_files(root).items():
        if not name.startswith(package):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
                f = call.func
                if (isinstance(f, ast.Name) and f.id == "model") or (isinstance(f, ast.Attribute) and f.attr == "model"):
                    out.setdefault(name, set()).add(fn.name)
    return out


def test_the_server_has_no_forward_of_its_own():
    """One engine: the token loop (``loop/``: scheduler, runner, output) schedules, samples and formats,
    and the server (``serve/``) speaks HTTP to it; every forward either runs is the engine core's. Decode
    batches run the core's ``decode_step`` (through ``CompiledStep``) over the core's ``PagedDecodeState``,
    prompt chunks the core's ``paged_forward``. No module of ``loop/`` or ``serve/`` calls a model, and none
    imports the model or its layers."""
    assert model_callers(PACKAGE) == {}
    assert model_callers(PACKAGE, "engine_lib.loop") == {}
    assert model_callers(PACKAGE, "engine_lib.step.paged_forward") == {"engine_lib.step.paged_forward": {"paged_forward"}}
    graph = imports(PACKAGE)
    forward = {m for m in graph if m == "engine_lib.model.qwen2" or m.startswith("engine_lib.model.layers")}
    for package in ("engine_lib.serve", "engine_lib.loop"):
        used = {t for m, targets in graph.items() if m.startswith(package) for t in targets}
        assert not used & forward, f"{package} imports forward code: {sorted(used & forward)}"
    assert {"engine_lib.step.compiled", "engine_lib.step.paged_forward", "engine_lib.step.paged"} <= \
        graph["engine_lib.loop.model_runner"]
    assert "engine_lib.step.decode" in graph["engine_lib.step.paged"]


def test_the_model_caller_reader_sees_a_second_forward(tmp_path):
    pkg = tmp_path / "engine_lib"
    (pkg / "serve").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "serve" / "__init__.py").write_text("")
    (pkg / "serve" / "fast.py").write_text("class R:\n    def step(self, x):\n        return self.model(x)\n")
    assert model_callers(pkg) == {"engine_lib.serve.fast": {"step"}}


def test_every_package_of_engine_lib_ships_in_the_wheel():
    """Colab installs engine_lib with pip, and setuptools ships only the packages pyproject.toml lists: a new
    folder of modules left off that list imports from a checkout and fails from the wheel."""
    import re  # not tomllib: the tests run on Python 3.10 too

    text = (PACKAGE.parent / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)))
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
