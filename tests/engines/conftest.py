"""Real cluster engines for backend tests (docs/design.md §7).

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

from tooling.engines.ray import RayHead, connect_ray, ray_available, start_ray
from tooling.engines.slurm import SlurmCluster, connect_slurm, slurm_available, start_slurm

RAY_ADDRESS_ENV = "IRISFED_TEST_RAY_ADDRESS"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must provide it)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> SlurmCluster:
    given = os.environ.get("SLURM_CONF")
    if given:
        yield connect_slurm(Path(given))
        return
    available = slurm_available()
    if not available:
        _unavailable(available.reason)
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> RayHead:
    given = os.environ.get(RAY_ADDRESS_ENV)
    if given:
        yield connect_ray(given)
        return
    available = ray_available()
    if not available:
        _unavailable(available.reason)
    head = start_ray(tmp_path_factory.mktemp("ray"))
    try:
        yield head
    finally:
        head.stop()
