"""``irisfed chaos`` and ``irisfed bench`` stopped mid-run by SIGTERM (as ``timeout`` or
a CI runner stops them) or SIGINT leave no process of theirs behind.

Each run gets a scratch folder of its own (``TMPDIR``): everything it starts lives
under it (Postgres' data, nats-server's config, the services' configs, the jobs' run
logs). The signal goes to the command alone, as ``timeout`` sends it, never to its
process group. Then no process it started may be left: neither one of the
descendants seen just before the signal (same pid and start time) nor any process
whose command line or working folder names the scratch folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 120.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid``, None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root`` → its start time."""
    parents: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            parents.setdefault(stat[0], []).append(pid)
            started[pid] = stat[1]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in found:
                found[child] = started[child]
                todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def naming(folder: Path) -> list[str]:
    """Live processes whose command line or working folder is under ``folder``."""
    mine = str(folder)
    left = []
    for pid in _all_pids():
        if pid == os.getpid() or _stat(pid) is None:
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        line = _cmdline(pid)
        if mine in line or cwd.startswith(mine):
            left.append(f"{pid}: {line[:200]}")
    return left


@pytest.fixture
def scratch():
    """The run's TMPDIR: a folder of /tmp's own, which Postgres (its own user) reaches
    whatever the permissions of pytest's folders above ``tmp_path``."""
    folder = Path(tempfile.mkdtemp(prefix="irisfed-stops-", dir="/tmp"))
    os.chmod(folder, 0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _stop_mid_run(tmp_path: Path, scratch: Path, args: list[str], ready: tuple[str, ...], sig: int) -> None:
    env = {**os.environ, "TMPDIR": str(scratch)}
    out = (tmp_path / "out.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "irisfed.cli", *args], cwd=tmp_path, env=env,
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # mid-run: every kind of process it starts is up
            seen = descendants(process.pid)
            lines = " ".join(_cmdline(pid) for pid in seen)
            if all(word in lines for word in ready):
                break
            assert process.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"never saw {ready} in {lines[:2000]}"
            time.sleep(0.2)
        time.sleep(1.0)  # into its work, not at the very start
        seen = descendants(process.pid)
        process.send_signal(sig)
        code = process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if process.poll() is None:  # the failure below says so; never leave it running
            stray = descendants(process.pid)
            process.kill()
            process.wait()
            for pid in stray:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        out.close()
    left = [f"{pid}: {_cmdline(pid)[:200]}" for pid, start in seen.items()
            if (_stat(pid) or (None, None))[1] == start]
    left += [line for line in naming(scratch) if line not in left]
    for line in left:  # a failure must not leave them running for the rest of the suite
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert left == [], (code, left, (tmp_path / "out.log").read_text()[-3000:])
    assert code != 0  # stopped, not finished


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_chaos_stopped_by_a_signal_leaves_no_process_behind(tmp_path, scratch, sig):
    _stop_mid_run(tmp_path, scratch, ["chaos", "--schedules", "50", "--seed", "7"],
                  ("nats-server", "postgres", "irisfed.services.router", "irisfed.services.tick",
                   "irisfed.services.peer_agent"), sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_bench_stopped_by_a_signal_leaves_no_process_behind(tmp_path, scratch, sig):
    _stop_mid_run(tmp_path, scratch, ["bench", "--quick", "--sections", "dispatch"],
                  ("nats-server", "postgres", "irisfed.services.router", "irisfed.services.tick"), sig)
