"""Arrays as people see them (docs/design.md §3.8), as pure rules: one line per array in
``irisfed jobs`` and on the Jobs page, its state summed up from its elements' counts.
(The router writes arrays: services/router/arrays.py; Postgres releases held elements.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import msgspec

from irisfed.shared.lifecycle import JobState

# An array's state: the first of these that one of its jobs is in (live before ended;
# among ended ones the worst first).
_STATE_ORDER = (JobState.RUNNING, JobState.ASSIGNED, JobState.QUEUED, JobState.FAILED, JobState.KILLED,
                JobState.UNSCHEDULABLE, JobState.REJECTED, JobState.SUCCEEDED)

_Row = TypeVar("_Row", bound=msgspec.Struct)


def array_state(counts: Mapping[str, int]) -> str:
    """The state an array shows: ``running`` while one of its jobs runs, ..., ``succeeded``
    once all did."""
    return next((state.value for state in _STATE_ORDER if counts.get(state.value)), JobState.QUEUED.value)


def counts_words(counts: Mapping[str, int]) -> str:
    """``6 jobs: 3 succeeded, 2 running, 1 queued`` (states in the order above)."""
    total = sum(counts.values())
    parts = [f"{counts[state.value]} {state.value}" for state in _STATE_ORDER if counts.get(state.value)]
    return f"{total} job{'s' if total != 1 else ''}: {', '.join(parts)}"


def fold_arrays(rows: Sequence[_Row], counts: Mapping[str, Mapping[str, int]]) -> list[_Row]:
    """``rows`` (newest first, each with ``job_id`` and ``array_id``) with each array's
    elements folded into one row where its first element stood: named by the array, in
    the array's state, its reason the counts (``counts``: array id → state → jobs; an
    array absent from it is counted from ``rows``)."""
    seen: set[str] = set()
    folded = []
    for row in rows:
        array_id = getattr(row, "array_id", None)
        if not array_id:
            folded.append(row)
            continue
        if array_id in seen:
            continue
        seen.add(array_id)
        mine = counts.get(array_id) or _count(rows, array_id)
        folded.append(msgspec.structs.replace(row, job_id=array_id, state=JobState(array_state(mine)),
                                              reason=counts_words(mine)))
    return folded


def _count(rows: Sequence[msgspec.Struct], array_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        if getattr(row, "array_id", None) == array_id:
            counts[str(row.state)] = counts.get(str(row.state), 0) + 1
    return counts
