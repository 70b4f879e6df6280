"""The house is one-way: engine_lib's packages stand in layers, each importing only the layers below it.

From the ground up (``LAYERS``): the errors and the tracking hook; the CPU kernels, the Triton kernels
and sampling; the quantized formats and the caches; the model; the decode step and the ladder's stages;
speculative decoding; the token loop; the Engine; the server; the bench; the book's helpers; the
exercises and the command line. An arrow the other way would make, say, the engine depend on a page,
a benchmark or a server. Every import counts, including the ones inside functions: a lazy import hides
a dependency from a reader, not from the program. Read with ``ast`` alone, nothing is run.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "engine_lib"
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)
module_files, imports, node_of, node_graph, levels = (architecture.module_files, architecture.imports,
                                                      architecture.node_of, architecture.node_graph, architecture.levels)
TOOLING = ("engine_lib.book", "engine_lib.bench", "engine_lib.exercises", "engine_lib.cli", "engine_lib.__main__")
# bottom to top: a node may import its own layer and the ones below (``node_of``: a top-level package or module)
LAYERS = [("errors", "tracking"), ("cpu", "kernels", "sampling"), ("quant", "cache"), ("model",), ("step", "stages"),
          ("speculative",), ("loop",), ("engine",), ("serve",), ("bench",), ("book",),
          ("exercises", "cli", "__main__")]
MAX_NODES, MAX_LEVELS, MAX_LOOSE = 25, 12, 8


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
    assert "engine_lib.loop.local" in graph["engine_lib.engine"]  # a top-level import
    assert "engine_lib.bench.run" in graph["engine_lib.cli"]  # one inside a function
    assert "engine_lib.book" in graph["engine_lib.book.memory_budget"]  # ``from . import WIDTH``


def test_no_modules_of_engine_lib_import_each_other_in_a_loop():
    found = cycles(imports(PACKAGE))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_import_runs_down_the_layers():
    """Nothing below the loop imports the loop or the server; the server is the loop's client, the bench the
    server's; nothing of the engine imports the bench or the book."""
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    nodes = node_graph(imports(PACKAGE))
    assert set(nodes) <= set(layer), f"nodes in no layer: {sorted(set(nodes) - set(layer))}"
    upward = sorted(f"{n} -> {t}" for n, targets in nodes.items() for t in targets if layer[t] > layer[n])
    assert not upward, "imports that run back up the layers: " + ", ".join(upward)


def test_the_engine_core_imports_nothing_from_the_book_the_bench_or_the_cli():
    upward = sorted(f"{m} -> {t}" for m, targets in imports(PACKAGE).items() if not is_tooling(m)
                    for t in targets if is_tooling(t))
    assert not upward, "the engine core imports its tooling: " + ", ".join(upward)


def test_the_house_is_small_enough_to_read():
    """At most 25 nodes (every package and loose module, scripts/ and the book's own folder counted) on at most
    12 floors, and at most 8 loose modules at engine_lib's top level."""
    nodes = architecture.house()
    floors = levels(nodes)
    loose = [p.name for p in PACKAGE.glob("*.py")]
    assert len(loose) <= MAX_LOOSE, f"{len(loose)} loose modules: {sorted(loose)}"
    assert len(nodes) + 1 <= MAX_NODES, f"{len(nodes) + 1} nodes: {sorted(nodes)} and book/"
    assert max(floors.values()) <= MAX_LEVELS, f"{max(floors.values())} floors: {floors}"


def test_the_readme_draws_the_house_as_it_stands():
    """The README's architecture section (its picture, chapters and line counts) is what the code says now."""
    assert architecture.main(["--check"]) == 0, "run: python scripts/architecture.py"


def test_every_cached_generation_reaches_tokens_through_the_loop():
    """``Engine`` makes tokens in two places only: the naive rung's short loop, and the token loop (its
    scheduler, runner and output processor); no second runner, decode loop or speculative loop beside it."""
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    banned = {"CachedRunner", "cached_tokens", "speculative_tokens", "decode_step", "DecodeState", "ModelRunner",
              "contiguous_forward", "paged_forward", "verify_tokens", "ServingLoop", "EngineCore"}
    assert not names & banned, f"engine.py names {sorted(names & banned)}"
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    calls: dict[str, set[str]] = {}
    for fn in [n for n in engine.body if isinstance(n, ast.FunctionDef)]:
        for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
            f = call.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr in ("loop", "model"):
                calls.setdefault(fn.name, set()).add(f"{f.value.attr}.{f.attr}")
            elif isinstance(f, ast.Attribute) and f.attr == "model":
                calls.setdefault(fn.name, set()).add("model()")
            elif isinstance(f, ast.Name) and f.id == "naive_tokens":
                calls.setdefault(fn.name, set()).add("naive_tokens")
    assert calls == {"logits": {"model()"}, "generate_batch": {"loop.run"}, "stream": {"loop.run"},
                     "_naive_steps": {"naive_tokens"}}, calls


def test_a_loop_and_an_upward_import_are_caught(tmp_path):
    pkg = tmp_path / "engine_lib"
    (pkg / "book").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "book" / "__init__.py").write_text("WIDTH = 76\n")
    (pkg / "cache.py").write_text("def f():\n    from .book import WIDTH\n")  # core -> book, lazily
    (pkg / "loader.py").write_text("from . import model\n")
    (pkg / "model.py").write_text("from .loader import load\n")
    graph = imports(pkg)
    assert cycles(graph) == [["engine_lib.loader", "engine_lib.model"]]
    assert graph["engine_lib.cache"] == {"engine_lib.book"} and is_tooling("engine_lib.book")
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert layer[node_of("engine_lib.book")] > layer[node_of("engine_lib.cache")]  # the upward arrow's layers


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


def test_the_loop_and_the_server_have_no_forward_of_their_own():
    """One engine: the token loop (``loop/``: scheduler, engine core, runner, output) schedules, samples and
    formats, and the server (``serve/``) speaks HTTP to it; every forward either runs is the step package's.
    Decode batches run ``decode_step`` (through the cache's driver, ``step.drivers``), prompt chunks and drafts
    the cache's forward (``step.forward``). No module of ``loop/`` or ``serve/`` calls a model, and none imports
    the model or its layers."""
    assert model_callers(PACKAGE) == {}
    assert model_callers(PACKAGE, "engine_lib.loop") == {}
    assert model_callers(PACKAGE, "engine_lib.step.forward") == {
        "engine_lib.step.forward": {"paged_forward", "contiguous_forward"}}
    graph = imports(PACKAGE)
    forward = {m for m in graph if m == "engine_lib.model.qwen2" or m.startswith("engine_lib.model.layers")}
    for package in ("engine_lib.serve", "engine_lib.loop"):
        used = {t for m, targets in graph.items() if m.startswith(package) for t in targets}
        assert not used & forward, f"{package} imports forward code: {sorted(used & forward)}"
    assert "engine_lib.step.drivers" in graph["engine_lib.loop.model_runner"]
    assert {"engine_lib.step.decode", "engine_lib.step.compiled", "engine_lib.step.forward"} <= \
        graph["engine_lib.step.drivers"]


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


def test_test_files_mirror_the_packages():
    """A reader looks for a module's tests by its path: ``engine_lib/cache/prefix.py`` is tested in
    ``tests/test_cache_prefix.py``. Each test file names a package or loose module of engine_lib (or a
    script, or the GPU run), so a test named for a module that moved fails here."""
    loose = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    scripts = {p.stem for p in (PACKAGE.parent / "scripts").glob("*.py")}
    stray = []
    for path in sorted((PACKAGE.parent / "tests").glob("test_*.py")):
        name = path.stem.removeprefix("test_")
        head = name.split("_")[0]
        if name in loose | packages | {"architecture", "gpu"} or head in packages:
            continue
        if name.startswith("scripts_") and name.removeprefix("scripts_") in scripts:
            continue
        stray.append(path.name)
    assert not stray, f"test files that name no package, module or script: {stray}"


def test_no_function_runs_over_eighty_lines():
    """A reader takes in a function in one screen: none in engine_lib or scripts/ runs over 80 lines (its
    decorators and docstring included); a longer one splits into named steps."""
    long = []
    for root in (PACKAGE, PACKAGE.parent / "scripts"):
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text())
            long += [f"{path.relative_to(PACKAGE.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
                     for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long
