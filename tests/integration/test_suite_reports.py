"""A failing test whose traceback the parser cannot read is still one failed test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INNER_CONFTEST = '''
import _pytest._code.code as code

from tests.infra.reports import pytest_runtest_makereport  # noqa: F401


def _trips(*args, **kwargs):
    raise SystemError("AST constructor recursion depth mismatch (before=120, after=171)")


code.getstatementrange_ast = _trips
'''

INNER_TESTS = '''
import pytest


@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
    assert 1 == 2


def test_fails():
    assert 1 == 2, "the failure itself"


def test_passes():
    assert True
'''


def _run_inner(tmp_path: Path, conftest: str, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--basetemp", str(tmp_path / "inner-tmp"), *options,
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_a_parser_trip_while_reporting_leaves_one_failed_test(tmp_path):
    done = _run_inner(tmp_path, INNER_CONFTEST)
    assert "INTERNALERROR" not in done.stdout + done.stderr
    assert "1 failed, 1 passed, 1 xfailed" in done.stdout
    assert "the failure itself" in done.stdout
    assert done.returncode == 1


def test_with_fulltrace_too(tmp_path):
    done = _run_inner(tmp_path, INNER_CONFTEST, "--fulltrace")
    assert "INTERNALERROR" not in done.stdout + done.stderr
    assert "1 failed, 1 passed, 1 xfailed" in done.stdout and "the failure itself" in done.stdout


def test_without_the_hook_the_same_trip_ends_the_run(tmp_path):
    """The inner run trips for real: without the hook pytest stops with INTERNALERROR."""
    done = _run_inner(tmp_path, INNER_CONFTEST.replace(
        "from tests.infra.reports import pytest_runtest_makereport  # noqa: F401\n", ""))
    assert "INTERNALERROR" in done.stdout + done.stderr
    assert done.returncode == 3
