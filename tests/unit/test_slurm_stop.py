"""A Slurm run's stop (``_SlurmRun.kill``) before any poll saw it run: its own start
marker gets it SIGTERM and its grace; anything else (no marker, an earlier job's, a
folder that errs or hangs) a cancel at once, never an error or a wait on the disk."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import slurm_run
from irisfed.services.peer_agent.backends.slurm_run import _Followed, _SlurmRun
from irisfed.services.peer_agent.backends.slurm_text import STARTED_MARKER

pytestmark = pytest.mark.unit

SLURM_ID = "222"


class _Slurm:
    """Records the stop's calls; a cancel ends the run at once."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.done: asyncio.Future | None = None

    async def terminate(self, slurm_id: str, gang: bool) -> bool:
        assert slurm_id == SLURM_ID
        self.calls.append("terminate")
        return True

    async def scancel(self, slurm_id: str) -> None:
        assert slurm_id == SLURM_ID
        self.calls.append("scancel")
        if not self.done.done():
            self.done.set_result(-15)


async def _stop(run_dir: Path, grace_s: float = 0.05) -> list[str]:
    slurm = _Slurm()
    followed = _Followed(asyncio.get_running_loop().create_future(), run_dir, str(run_dir))
    slurm.done = followed.done
    await asyncio.wait_for(_SlurmRun(slurm, SLURM_ID, followed).kill(grace_s), 10)
    return slurm.calls


def test_its_own_start_marker_gets_sigterm_then_the_cancel_after_its_grace(tmp_path):
    (tmp_path / STARTED_MARKER).write_text(f"{SLURM_ID}\n")
    assert asyncio.run(_stop(tmp_path)) == ["terminate", "scancel"]


def test_no_marker_or_an_earlier_jobs_is_cancelled_at_once(tmp_path):
    assert asyncio.run(_stop(tmp_path)) == ["scancel"]
    (tmp_path / STARTED_MARKER).write_text("111\n")  # an earlier submission to the same folder
    assert asyncio.run(_stop(tmp_path)) == ["scancel"]


def test_no_grace_reads_no_marker(tmp_path, monkeypatch):
    (tmp_path / STARTED_MARKER).write_text(f"{SLURM_ID}\n")
    monkeypatch.setattr(slurm_run, "read_marker", lambda path: pytest.fail("read with no grace to give"))
    assert asyncio.run(_stop(tmp_path, grace_s=0)) == ["scancel"]


def test_a_folder_that_errs_is_cancelled_at_once_without_an_error(tmp_path, monkeypatch):
    def unreadable(path):
        raise OSError(errno.EIO, "Input/output error", str(path))
    monkeypatch.setattr(slurm_run, "read_marker", unreadable)
    assert asyncio.run(_stop(tmp_path)) == ["scancel"]


def test_a_folder_that_hangs_is_cancelled_once_the_read_times_out(tmp_path, monkeypatch):
    release = threading.Event()

    def hangs(path):
        release.wait(10)
        return SLURM_ID
    monkeypatch.setattr(slurm_run, "read_marker", hangs)
    monkeypatch.setattr(slurm_run, "MARKER_READ_TIMEOUT_S", 0.1)

    async def stop_then_release() -> list[str]:
        try:
            return await _stop(tmp_path)
        finally:
            release.set()  # the read's thread ends, so the loop closes
    assert asyncio.run(stop_then_release()) == ["scancel"]
