"""The tests of one xdist group run on one worker (tests/infra/groups.py): what keeps
each session engine to one start a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INNER_CONFTEST = '''
import pytest

from tests.infra.groups import GroupSuffixes


def pytest_configure(config):
    config.pluginmanager.register(GroupSuffixes(), "irisfed-group-suffixes")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name.startswith("test_engine_"):
            item.add_marker(pytest.mark.xdist_group("engine"))
'''

INNER_TESTS = '''
import os
import time

import pytest

from tests.infra.groups import worker_of


@pytest.mark.parametrize("i", range(6))
def test_engine_(i):
    time.sleep(0.05)  # long enough that a second worker would take some of them
    with open(os.path.join(os.environ["SEEN"], f"engine-{i}"), "w") as out:
        out.write(worker_of())


@pytest.mark.parametrize("i", range(6))
def test_free_(i):
    time.sleep(0.05)
    with open(os.path.join(os.environ["SEEN"], f"free-{i}"), "w") as out:
        out.write(worker_of())
'''


def test_a_groups_tests_all_run_on_one_worker_and_the_others_spread(tmp_path):
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {**os.environ, "SEEN": str(seen),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "-c", os.devnull, "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner-tmp"), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert "12 passed" in done.stdout, done.stdout + done.stderr
    workers = {path.name: path.read_text() for path in seen.iterdir()}
    engine = {workers[f"engine-{i}"] for i in range(6)}
    assert len(engine) == 1 and engine <= {"gw0", "gw1"}, workers
    assert "@engine" in done.stdout  # the scheduler saw the group in the node ids


FAILING_TESTS = """
import pytest


@pytest.mark.parametrize("i", range(3))
def test_engine_(i):
    assert i != 1, "the one failure"


def test_free():
    pass
"""


def test_last_failed_reruns_a_grouped_test_it_recorded(tmp_path):
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(FAILING_TESTS)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTEST_XDIST_WORKER", None)

    def run(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-c", os.devnull,
             "--rootdir", str(tmp_path), "-o", f"cache_dir={tmp_path / 'cache'}",
             "--basetemp", str(tmp_path / "inner-tmp"), *options, str(tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    first = run()
    assert "1 failed, 3 passed" in first.stdout, first.stdout + first.stderr
    again = run("--lf")  # only the recorded failure runs: not the whole file again
    assert again.stdout.splitlines()[-1].startswith("1 failed in"), again.stdout
    assert "test_engine_[1]@engine" in again.stdout, again.stdout

