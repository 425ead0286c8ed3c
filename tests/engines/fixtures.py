"""Real cluster engines for backend and end-to-end tests (docs/design.md §7), made
visible to every test folder by tests/conftest.py.

An existing cluster when the environment names one (``SLURM_CONF`` for Slurm,
``IRISFED_TEST_RAY_ADDRESS`` = a Ray dashboard address such as
``http://127.0.0.1:8265`` for Ray); otherwise one started for the session in a
temporary folder by ``tooling.engines`` and stopped by PID at the end. When the
engine is not installed the tests are skipped, except in CI (``CI=true``), where
that is a failure: CI must install them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tooling.engines.chromium import Chromium, chromium_available, start_chromium
from tooling.engines.ray import RayHead, connect_ray, ray_available, start_ray
from tooling.engines.slurm import SlurmCluster, connect_slurm, slurm_available, start_slurm

RAY_ADDRESS_ENV = "IRISFED_TEST_RAY_ADDRESS"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must provide it)", pytrace=False)
    pytest.skip(reason)


def _engine(given: str | None, connect, available, start, folder: Path):
    """An engine for the session: the one named in the environment, else one of our own."""
    if given:
        yield connect(given)
        return
    if not available:
        _unavailable(available.reason)
    engine = start(folder)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> SlurmCluster:
    given = os.environ.get("SLURM_CONF")
    yield from _engine(given and Path(given), connect_slurm, slurm_available(), start_slurm,
                       tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> RayHead:
    yield from _engine(os.environ.get(RAY_ADDRESS_ENV), connect_ray, ray_available(), start_ray,
                       tmp_path_factory.mktemp("ray"))


@pytest.fixture(scope="session")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Chromium:
    """A headless Chromium for the session (browser tests connect to it over CDP)."""
    yield from _engine(None, None, chromium_available(), start_chromium, tmp_path_factory.mktemp("chromium"))
