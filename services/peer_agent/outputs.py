"""A run's outputs (docs/design.md §3.5): what it left in ``IRISFED_OUTPUT_DIR`` goes
to the object store when it ends, succeeded or failed, and Postgres lists it.

``scan_outputs`` walks each task's output directory (never following links) in name
order; ``choose_outputs`` (pure) decides what is stored: regular files while the run's
total stays within ``max_output_mb``, in name order; what is left out is listed with
why (over the cap, a link or special file, a name the store cannot hold). At most
``MAX_LISTED`` entries per run are listed; the rest are counted in one line of the log.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_LISTED = 10_000
MAX_NAME = 1024  # job_outputs.name's bound (migration 0017)


@dataclass(frozen=True)
class Found:
    """An entry of a task's output directory: its relative name, size, and kind."""

    task: int
    name: str
    path: Path
    size: int
    regular: bool


@dataclass(frozen=True)
class Output:
    """One row of a run's output list: stored, or left out with ``note`` saying why."""

    task: int
    name: str
    path: Path
    size: int
    stored: bool
    note: str = ""


def _name_problem(name: str) -> str:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not UTF-8"
    if len(name) > MAX_NAME or any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return "its name is too long or holds control characters"
    return ""


def choose_outputs(found: list[Found], max_bytes: int) -> list[Output]:
    """What of ``found`` to store within ``max_bytes`` (module docstring), in order."""
    chosen, total = [], 0
    for entry in found[:MAX_LISTED]:
        shown = entry.name.encode("utf-8", "replace").decode("utf-8")
        problem = "" if entry.regular else "not a regular file"
        problem = problem or _name_problem(entry.name)
        if not problem and total + entry.size > max_bytes:
            problem = f"over max_output_mb ({max_bytes // 2**20:,} MiB for the run)"
        if problem:
            chosen.append(Output(entry.task, shown, entry.path, entry.size, False, problem))
            continue
        total += entry.size
        chosen.append(Output(entry.task, entry.name, entry.path, entry.size, True))
    return chosen


def scan_outputs(dirs: list[tuple[int, Path]]) -> list[Found]:
    """Every entry below each task's output directory but folders (links to folders
included, not followed), by task then name."""
    found = []
    for task, root in dirs:
        if not root.is_dir() or root.is_symlink():
            continue
        for folder, subdirs, files in os.walk(root):
            subdirs.sort()
            entries = sorted(files) + [d for d in subdirs if os.path.islink(os.path.join(folder, d))]
            for name in sorted(entries):
                path = Path(folder, name)
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                relative = path.relative_to(root).as_posix()
                found.append(Found(task, relative, path, info.st_size, stat.S_ISREG(info.st_mode)))
                if len(found) > MAX_LISTED * 2:
                    break
    found.sort(key=lambda entry: (entry.task, entry.name))
    return found
