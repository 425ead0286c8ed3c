"""A run's outputs (docs/design.md §3.5): what it left in ``IRISFED_OUTPUT_DIR`` goes
to the object store when it ends, succeeded or failed, and Postgres lists it.

``scan_outputs`` walks each task's output directory (never following links) in name
order; ``choose_outputs`` (pure) decides what is stored: regular files while the run's
total stays within ``max_output_mb``, in name order; what is left out is listed with
why (over the cap, a link or special file, a name the store cannot hold: not UTF-8,
control characters, or so long that its object's name would not fit a NATS subject).
A left-out name is shown with its undecodable bytes as ``\\xNN`` and cut to
``MAX_NAME`` characters, each shown name once. At most ``MAX_LISTED`` entries per run
are listed; the agent logs how many more there were.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAX_LISTED = 10_000
MAX_NAME = 1024  # job_outputs.name's bound (migration 0017)
# An object's name travels base64-encoded in a NATS subject (nats-py's object store),
# and a control line is at most 4 KiB: object names past this are refused.
MAX_OBJECT_NAME = 2_000


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


def _name_problem(name: str, object_name: Callable[[str], str]) -> str:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not UTF-8"
    if len(name) > MAX_NAME or any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return "its name is too long or holds control characters"
    if len(object_name(name)) > MAX_OBJECT_NAME:
        return "its name is too long for the object store"
    return ""


def _shown(task: int, name: str, taken: set[tuple[int, str]]) -> str:
    """``name`` as a row can hold it: undecodable bytes as \\xNN, at most MAX_NAME
    characters, and no name of the task's already taken."""
    shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    shown = shown if len(shown) <= MAX_NAME else shown[:MAX_NAME - 12] + "…"
    candidate, n = shown, 1
    while (task, candidate) in taken:
        n += 1
        candidate = f"{shown[:MAX_NAME - 12]} ({n})"
    taken.add((task, candidate))
    return candidate


def _storable_text(name: str) -> bool:
    """Whether a row can hold ``name`` as it is (UTF-8, within MAX_NAME)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return len(name) <= MAX_NAME


def choose_outputs(found: list[Found], max_bytes: int,
                   object_name: Callable[[int, str], str] = lambda task, name: name) -> list[Output]:
    """What of ``found`` to store within ``max_bytes`` (module docstring), in order;
    ``object_name(task, name)``: the name its object would have in the store."""
    chosen, total = [], 0
    taken = {(e.task, e.name) for e in found}
    for entry in found[:MAX_LISTED]:
        problem = "" if entry.regular else "not a regular file"
        problem = problem or _name_problem(entry.name, lambda name, task=entry.task: object_name(task, name))
        if not problem and total + entry.size > max_bytes:
            problem = f"over max_output_mb ({max_bytes // 2**20:,} MiB for the run)"
        if problem:
            shown = entry.name if _storable_text(entry.name) else _shown(entry.task, entry.name, taken)
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
