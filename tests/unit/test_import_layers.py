"""Imports run one way, and every one names the installed package ``irisfed``.

Read from the source (no import is executed): the CLI is the top floor and nothing
imports it; services import neither tooling nor bench; the producers' client imports
only ``irisfed.shared``; ``shared`` imports no other folder. A bare ``import shared``
would work from a checkout (pytest puts the repository on ``sys.path``) and break in
an installed copy, so it is refused here rather than found by users.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "services", "tooling", "bench", "migrations", "irisfed", "tests")
BARE = {"shared", "services", "tooling", "bench", "migrations", "cli"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _offending(folders: tuple[str, ...], forbidden, exclude=lambda path: False) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {name}" for folder in folders for path in _sources(folder)
            if not exclude(path) for name in _imports(path) if forbidden(name)]


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_every_import_names_the_installed_package():
    assert _offending(FOLDERS, lambda name: name.split(".")[0] in BARE) == []


def test_services_import_neither_tooling_nor_bench_nor_the_cli():
    assert _offending(("services",), lambda n: _under(n, "irisfed.tooling", "irisfed.bench", "irisfed.cli")) == []


def test_shared_imports_no_other_folder():
    others = ("irisfed.services", "irisfed.tooling", "irisfed.bench", "irisfed.cli", "irisfed.client",
              "irisfed.reads", "irisfed.jobs", "irisfed.errors", "irisfed.settings", "irisfed.migrations")
    assert _offending(("shared",), lambda n: _under(n, *others)) == []


@pytest.mark.parametrize("module", ["client", "reads", "jobs", "errors", "settings", "__init__"])
def test_the_producers_client_stands_on_shared_alone(module):
    path = ROOT / "irisfed" / f"{module}.py"
    assert [n for n in _imports(path)
            if _under(n, "irisfed.services", "irisfed.tooling", "irisfed.bench", "irisfed.cli")] == []


def test_nothing_imports_the_command_line():
    inside_cli = ROOT / "irisfed" / "cli"
    assert _offending(("shared", "services", "tooling", "bench", "migrations", "irisfed"),
                      lambda n: _under(n, "irisfed.cli"), exclude=lambda p: inside_cli in p.parents) == []
