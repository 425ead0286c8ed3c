"""The double-run check: which real job processes are alive, sampled in a thread; and,
from the agents' run records, which device indices those hold (invariant 17)."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.tooling.chaos.world import FENCING_WINDOW_S, SAMPLE_PERIOD_S, live_state


@dataclass
class _Run:
    """One real job process (the ``sh`` of JOB_SCRIPT), as its own log lines tell."""

    job_id: str
    epoch: int
    peer_id: str
    pid: int
    first_seen: float
    last_seen: float
    gone_at: float | None = None
    ended: bool = False  # it wrote its "end" line: it ran to its end, it was not killed
    token: str = "-"  # the workspace token its folder held ("-": none)
    cwd: str = ""  # where it started: its run folder, or the workspace copy in it
    node: str = ""
    devices: dict[str, list[int]] | None = None  # from its agent's run.json (None: not read yet)
    label: str = field(default="", repr=False)


def held_twice(holders: Iterable[tuple[str, str, Mapping[str, Sequence[int]], str]]) -> dict[tuple, list[str]]:
    """Invariant 17 at one moment: each (peer, node, resource, index) that two or more of
    the live runs ``holders`` — (peer, node, devices, run) each — hold, and by which runs."""
    by_index: dict[tuple, list[str]] = defaultdict(list)
    for peer, node, devices, run in holders:
        for name, indices in devices.items():
            for index in indices:
                by_index[(peer, node, name, index)].append(run)
    return {where: sorted(runs) for where, runs in by_index.items() if len(runs) > 1}


def recorded_devices(cwd: str, pid: int) -> tuple[str, dict[str, list[int]]] | None:
    """The node and devices the agent recorded for process ``pid`` started in ``cwd``
    (``run.json`` in its run folder: ``cwd`` or, for a workspace copy, its parent);
    None until that record is written."""
    for folder in (Path(cwd), Path(cwd).parent):
        try:
            record = json.loads((folder / "run.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("pid") == pid:
            devices = record.get("devices")
            return str(record.get("node", "")), devices if isinstance(devices, dict) else {}
    return None


class RunWatcher:
    """Samples which real job processes are alive, every SAMPLE_PERIOD_S, in a thread.

    Each job's script appends ``start JOB EPOCH PID CWD`` to a log as it begins and
    ``end JOB EPOCH PID`` when its sleep is over (never when killed); the watcher
    reads new lines and checks each known pid in /proc (zombies count as dead).
    Whenever one job has live processes under two epochs it records the overlap.

    The rule (docs/design.md §6.3, fencing), checked by :meth:`violations`: a job never
    has live processes under two epochs at once, except that an older copy may
    still be alive for at most FENCING_WINDOW_S after a newer one starts, and only
    if it is then killed (it never writes its "end" line). Jobs last at most
    MAX_JOB_S, less than TTL + grace, so a copy left by a dead or cut-off agent
    has ended on its own before the tick may hand its job out again; any overlap
    at all means a stale copy outlived the moment its job moved on (e.g. a
    restarted agent that failed to kill what its previous run left behind).
    """

    def __init__(self, log_path: Path, work_dir: Path) -> None:
        self.log_path = log_path
        self.work_dir = work_dir
        self.offset = 0
        self.runs: dict[int, _Run] = {}
        self.overlaps: dict[tuple[str, int, int], list[float]] = {}  # (job, old, new) → [first, last]
        # (peer, node, resource, index, runs) held by more than one live run → [first, last] seen
        self.device_clashes: dict[tuple, list[float]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="chaos-run-watcher", daemon=True)

    def start(self) -> None:
        self.log_path.touch()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sweep()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            self.sweep()

    def _read_log(self) -> None:
        with open(self.log_path, "rb") as log:
            log.seek(self.offset)
            data = log.read()
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        now = time.time()
        for line in data[:complete].decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0] == "start":
                try:
                    peer = Path(parts[4]).relative_to(self.work_dir).parts[0]
                except (ValueError, IndexError):
                    peer = "?"
                self.runs[int(parts[3])] = _Run(parts[1], int(parts[2]), peer, int(parts[3]), now, now,
                                                token=parts[5] if len(parts) >= 6 else "-", cwd=parts[4],
                                                label=f"{parts[1]} epoch {parts[2]} (pid {parts[3]})")
            elif len(parts) >= 4 and parts[0] == "end" and int(parts[3]) in self.runs:
                self.runs[int(parts[3])].ended = True

    def sweep(self) -> None:
        with self._lock:
            self._read_log()
            now = time.time()
            live: dict[str, set[int]] = defaultdict(set)
            for run in self.runs.values():
                if run.gone_at is not None:
                    continue
                found = live_state(run.pid)
                if found is None or found[0] in "ZX":
                    run.gone_at = now
                    continue
                run.last_seen = now
                live[run.job_id].add(run.epoch)
                if run.devices is None:
                    found = recorded_devices(run.cwd, run.pid)
                    if found is not None:
                        run.node, run.devices = found
            for job_id, epochs in live.items():
                newest = max(epochs)
                for old in epochs - {newest}:
                    seen = self.overlaps.setdefault((job_id, old, newest), [now, now])
                    seen[1] = now
            holders = [(r.peer_id, r.node, r.devices, r.label) for r in self.runs.values()
                       if r.gone_at is None and r.devices]
            for where, runs in held_twice(holders).items():
                seen = self.device_clashes.setdefault((*where, tuple(runs)), [now, now])
                seen[1] = now

    def live_on(self, peer_id: str) -> bool:
        with self._lock:
            return any(r.gone_at is None and r.peer_id == peer_id for r in self.runs.values())

    def live_pids(self) -> list[int]:
        with self._lock:
            return [r.pid for r in self.runs.values() if r.gone_at is None]

    def workspace_violations(self, expected: dict[str, str]) -> tuple[list[str], int]:
        """Invariant 14: every run of a job started in exactly the workspace its digest
        names (``expected``: stored job id → its workspace's token, "-" for none). The
        problems, and how many runs started in a workspace."""
        problems, in_workspace = [], 0
        for run in self.runs.values():
            want = expected.get(run.job_id)
            if want is None:
                continue
            in_workspace += run.token != "-"
            if run.token != want:
                problems.append(f"{run.job_id}: epoch {run.epoch} on {run.peer_id} started in workspace "
                                f"{run.token!r}, its job names {want!r} (invariant 14)")
        return problems, in_workspace

    def violations(self) -> tuple[list[str], int]:
        """Overlaps that break the rule above, and how many overlaps kept it."""
        problems, fenced = [], 0
        for (job_id, old, new), (first, last) in sorted(self.overlaps.items()):
            stale = [r for r in self.runs.values() if r.job_id == job_id and r.epoch == old]
            where = ",".join(sorted({r.peer_id for r in stale}))
            newer = ",".join(sorted({r.peer_id for r in self.runs.values()
                                     if r.job_id == job_id and r.epoch == new}))
            lasted = last - first + SAMPLE_PERIOD_S
            if any(r.ended for r in stale):
                problems.append(f"{job_id}: epoch {old} ran to its end on {where} while epoch {new} "
                                f"was running on {newer} (both alive for ~{lasted:.2f}s)")
            elif lasted > FENCING_WINDOW_S:
                problems.append(f"{job_id}: epoch {old} on {where} stayed alive ~{lasted:.2f}s while "
                                f"epoch {new} ran on {newer} (fencing window {FENCING_WINDOW_S:.1f}s)")
            else:
                fenced += 1
        # No device index of a node held by two live runs at once (invariant 17).
        for (peer, node, name, index, runs), (first, last) in sorted(self.device_clashes.items()):
            problems.append(f"{peer}/{node}: {name} {index} held by {' and '.join(runs)} at once "
                            f"(for ~{last - first + SAMPLE_PERIOD_S:.2f}s; invariant 17)")
        # One run (job, epoch) on one peer: a gang's tasks too (invariant 12).
        peers_of: dict[tuple[str, int], set[str]] = defaultdict(set)
        for run in self.runs.values():
            peers_of[(run.job_id, run.epoch)].add(run.peer_id)
        for (job_id, epoch), peers in sorted(peers_of.items()):
            if len(peers) > 1:
                problems.append(f"{job_id}: epoch {epoch} ran on {', '.join(sorted(peers))} at once "
                                f"(a run, a gang's every task, is on one peer)")
        return problems, fenced
