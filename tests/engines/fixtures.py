"""Real cluster engines for backend and end-to-end tests (docs/design.md §7), made
visible to every test folder by tests/conftest.py.

An existing cluster when the environment names one (``SLURM_CONF`` for Slurm,
``IRISFED_TEST_RAY_ADDRESS`` = a Ray dashboard address such as
``http://127.0.0.1:8265`` for Ray); otherwise one started for the session in a
temporary folder by ``irisfed.tooling.engines`` and stopped by PID at the end. When the
engine is not installed the tests are skipped, except in CI (``CI=true``), where
that is a failure: CI must install them.

Our own Slurm cluster has one node in its default partition (``debug``: what the
single-node tests measure) and ``SLURM_GANG_NODES`` more, each its own slurmd on this
host, in partition ``gang`` (``SlurmCluster.gang_partition``: gangs, one task a
node). A given cluster's gang partition is the first with two nodes or more.

``slurm_time_limited_run``: a run submitted with a one-minute time limit as soon as
a Slurm backend test first asks for the cluster (``slurm_env`` requests it), so the
minute or more Slurm takes to end it (it checks limits every 30 s, a hard-coded
period) passes while the other tests run, rather than in the one test that reads its
end. Our own cluster has a spare CPU for it, so the others still find the machine's
CPUs free.
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import RunSpec
from irisfed.services.peer_agent.backends.slurm import SlurmBackend
from irisfed.services.peer_agent.backends.slurm_script import output_path
from irisfed.services.peer_agent.backends.slurm_text import comment_for, job_name
from irisfed.tooling.engines.chromium import Chromium, chromium_available, start_chromium
from irisfed.tooling.engines.ray import (
    RayHead,
    RayWorkerSpec,
    connect_ray,
    ray_available,
    start_ray,
)
from irisfed.tooling.engines.slurm import SlurmCluster, connect_slurm, slurm_available, start_slurm

RAY_ADDRESS_ENV = "IRISFED_TEST_RAY_ADDRESS"
# A CPU the machine lacks, declared by our own test cluster: the time-limited run
# holds it for its minute, so no test waits behind it or finds the node fuller.
SLURM_SPARE_CPUS = 1
# Nodes of the gang partition: a 2-task gang has a choice, and `group_by rack` one
# rack of two nodes (gn1, gn2) and one of one (gn3).
SLURM_GANG_NODES = 3


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
    yield from _engine(given and Path(given), connect_slurm, slurm_available(),
                       functools.partial(start_slurm, spare_cpus=SLURM_SPARE_CPUS, gang_nodes=SLURM_GANG_NODES),
                       tmp_path_factory.mktemp("slurm"))


@dataclass(frozen=True)
class TimeLimitedRun:
    """A ``sleep 600`` run of (``job_id``, epoch 1) for ``peer_id``, its folder under
    ``work_root`` as a ``SlurmBackend`` lays it out, that Slurm ``slurm_id`` was told
    to end after one minute (``sbatch -t 1``): irisfed sets no time limit, a site's
    partition may."""

    work_root: Path
    peer_id: str
    job_id: str
    slurm_id: str


@pytest.fixture(scope="session")
def slurm_time_limited_run(slurm_cluster: SlurmCluster,
                           tmp_path_factory: pytest.TempPathFactory) -> TimeLimitedRun:
    work_root = tmp_path_factory.mktemp("slurm-time-limit") / "work"
    peer_id = f"peer-{uuid.uuid4().hex[:8]}"  # no other test's peer: never in their listings
    spec = RunSpec(f"job-{uuid.uuid4().hex[:8]}", 1, ["sleep", "600"])
    script = SlurmBackend(work_root, peer_id)._write_script(spec)  # the script a launch writes
    out = output_path(str(script.parent / "stdout"))
    slurm_id = slurm_cluster.run(
        "sbatch", "--parsable", "-J", job_name(spec.job_id, 1), f"--comment={comment_for(peer_id)}",
        "-D", str(script.parent), "-o", out, "-e", out, "-c", "1", "--mem=64", "-t", "1", str(script),
    ).strip().split(";")[0]
    yield TimeLimitedRun(work_root, peer_id, spec.job_id, slurm_id)
    slurm_cluster.run("scancel", slurm_id, check=False)  # ended already, unless its test did not run


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> RayHead:
    """The session's Ray cluster: our own is a head (2 CPUs, ``{"TPU": 4}``, no labels) and
    ``RAY_WORKERS``, started once (gangs need nodes: tests/engines/test_ray_gangs.py)."""
    yield from _engine(os.environ.get(RAY_ADDRESS_ENV), connect_ray, ray_available(),
                       functools.partial(start_ray, workers=RAY_WORKERS), tmp_path_factory.mktemp("ray"))


# Two alike worker raylets of one slice (label ``slice=a``), 1 CPU and 1 GiB each: a gang
# of 3 takes every node, one of 2 sharing a slice takes both workers.
RAY_WORKERS = (RayWorkerSpec("w1", labels={"slice": "a"}), RayWorkerSpec("w2", labels={"slice": "a"}))


@pytest.fixture(scope="session")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Chromium:
    """A headless Chromium for the session (browser tests connect to it over CDP)."""
    yield from _engine(None, None, chromium_available(), start_chromium, tmp_path_factory.mktemp("chromium"))
