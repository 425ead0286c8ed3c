"""Waiting on runs of the Slurm backend against the session's real Slurm
(tests/engines/test_slurm_backend.py, test_slurm_gangs.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends.slurm import SlurmBackend
from irisfed.tooling.engines.slurm import SlurmCluster
from tests.infra.waiting import wait_for

# A bound on a hang of a slow shared machine, not an expectation (a job takes ~3 s).
JOB_TIMEOUT_S = 180.0
POLL_S = 0.2


async def run_ended(handle) -> int:
    """The exit code of a backend run, once it ended."""
    return await asyncio.wait_for(handle.wait(), JOB_TIMEOUT_S)


async def eventually(check: Callable[[], Awaitable[object]], what: str) -> object:
    """``check()`` polled every ``POLL_S`` until truthy (its value), for up to ``JOB_TIMEOUT_S``."""
    return await wait_for(check, what, timeout=JOB_TIMEOUT_S, interval=POLL_S)


def slurm_job(cluster: SlurmCluster, slurm_id: str) -> dict[str, str]:
    """What ``scontrol show job`` says of ``slurm_id`` (which Slurm must still know)."""
    job = cluster.job(slurm_id)
    assert job is not None, f"Slurm forgot job {slurm_id}"
    return job


def in_environment(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """``cluster`` with its environment (``SLURM_CONF`` ...) set for the test; the cluster."""
    for name, value in cluster.env.items():
        monkeypatch.setenv(name, value)
    return cluster


@contextlib.asynccontextmanager
async def slurm_backends(work: Path, peer_id: str, partition: str = "") -> AsyncIterator[Callable[..., SlurmBackend]]:
    """``make(peer=peer_id, partition=partition)``: a new SlurmBackend (an agent run each)
    on the work folder ``work``; every one made closed at the end."""
    made: list[SlurmBackend] = []

    def make(peer: str = peer_id, partition: str = partition) -> SlurmBackend:
        backend = SlurmBackend(work, peer, partition=partition, poll_interval_s=POLL_S)
        made.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in made:
            await backend.close()
