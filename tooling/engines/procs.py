"""Process plumbing shared by the engine starters: a daemon in its own process
group, stopped by that group's id (never by name), and waiting on conditions."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Availability:
    """Whether this machine can start an engine, and why not (``reason``)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class EngineError(RuntimeError):
    """An engine did not start or answer; the message carries its log's tail."""


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (not zombie, not dead) processes in process group ``pgid`` (read
    from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces and parentheses):
        # state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def kill_tagged(
    name: str, value: str, *, spare_group: int | None = None, timeout: float = 20.0,
) -> list[int]:
    """SIGKILL, by PID, every process whose environment holds ``name=value`` (except
    members of process group ``spare_group``); wait until they are gone. Returns the
    PIDs it killed.

    For what an engine starts outside its daemon's process group (Ray workers and job
    entrypoints, Slurm job steps): they inherit a tag we put in the environment.
    """
    tag = f"{name}={value}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if tag in environ.split(b"\0") and _pgid(int(entry.name)) != spare_group:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2:].split()[0] != "Z"


@dataclass
class GroupProcess:
    """A daemon we started as the leader of a new process group (``start_new_session``)."""

    name: str
    process: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(
        self, sig: int = signal.SIGTERM, timeout: float = 20.0, leader_only: bool = False,
    ) -> None:
        """Signal the whole group (or only its leader, which then stops the rest
        itself), wait for the group to empty, then SIGKILL what is left."""
        pgid = self.pid
        if group_members(pgid):
            if leader_only:
                try:
                    self.process.send_signal(sig)
                except ProcessLookupError:
                    pass
            else:
                _killpg(pgid, sig)
            if not _wait_group_gone(self.process, pgid, timeout):
                _killpg(pgid, signal.SIGKILL)
                _wait_group_gone(self.process, pgid, timeout)
        if self.process.poll() is None:
            self.process.wait(timeout=timeout)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group_gone(process: subprocess.Popen, pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap the leader so it does not linger as a zombie
        if not group_members(pgid):
            return True
        time.sleep(0.05)
    return False


def spawn(
    name: str, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> GroupProcess:
    """Start ``args`` in a new session (so a process group of its own), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            list(args), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=cwd,
        )
    return GroupProcess(name, process, log_path)


def wait_until(
    probe: Callable[[], T], what: str, timeout: float,
    alive: Sequence[GroupProcess] = (), interval: float = 0.1,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail early when a daemon dies."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        last = probe()
        if last:
            return last
        for daemon in alive:
            if not daemon.running():
                raise EngineError(
                    f"{daemon.name} exited with code {daemon.process.returncode} while waiting "
                    f"for {what}; {daemon.log_path}:\n{log_tail(daemon.log_path)}"
                )
        if time.monotonic() >= deadline:
            raise EngineError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
