"""What keeps the code easy to carry on, checked on the tree itself (read as text):
modules a reader can hold, test helpers in tests/infra, and no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# Each top-level folder installs as a subpackage of `irisfed` (setup.py).
PACKAGES = {"irisfed": "irisfed", "shared": "irisfed.shared", "services": "irisfed.services",
            "tooling": "irisfed.tooling", "bench": "irisfed.bench"}
MOST_LINES = 700


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules whose code must have run for ``path``'s module-level imports: a module
    imported, or the package whose names ``from P import name`` reads (a submodule named
    so is that submodule). A package already running its ``__init__`` lets its
    submodules import each other; reading a name it has not defined yet is the circle."""
    used = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                used.add(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Import):
            used.update(alias.name for alias in node.names)
    return used & set(modules)


def test_no_module_of_the_product_outgrows_one_reading():
    long = {str(path.relative_to(ROOT)): n for folder in ("shared", "services", "irisfed")
            for path in (ROOT / folder).rglob("*.py") if (n := len(path.read_text().splitlines())) > MOST_LINES}
    assert long == {}


def test_no_test_module_imports_another():
    importing = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and ".test_" in f".{node.module}":
                importing[str(path.relative_to(ROOT))] = node.module
    assert importing == {}


def test_no_import_circle_between_modules():
    modules = _modules()
    edges = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        stack.append(name)
        for other in sorted(edges[name]):
            if state.get(other) == 1:
                circles.append(" -> ".join(stack[stack.index(other):] + [other]))
            elif other not in state:
                visit(other, stack)
        stack.pop()
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert circles == []
