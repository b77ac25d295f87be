"""The package's import graph, read from the source (every import, at the top or inside a function): no module
imports one that imports it back, directly or through others, and engine/ imports nothing above it."""

import ast
import graphlib
from pathlib import Path

import st_fastbackend

PACKAGE = Path(st_fastbackend.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports (a name imported from a package counts as the package, unless it is
    one of its modules)."""
    name, found = module_name(path), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{name}: a relative import (the package imports by absolute names)"
            base = node.module
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def test_no_import_circles():
    graph = import_graph()
    assert "st_fastbackend.corpus.read" in graph["st_fastbackend.cli.embed_corpus"]  # the reading sees imports
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"modules that import each other: {' -> '.join(error.args[1])}") from None


def test_the_engine_imports_nothing_above_it():
    above = {name: sorted(m for m in deps if not m.startswith("st_fastbackend.engine"))
             for name, deps in import_graph().items() if name.startswith("st_fastbackend.engine")}  # fmt: skip
    assert not any(above.values()), above
