"""What one user may see of other users' jobs (docs/design.md §3.6): a text that names
jobs (the tick's ``preempted by J``, ``held for J``, ``placed; preempted A, B``) names
the user's own by the ids it submitted, and every other user's as ``another user's
job`` (its id would tell that it exists). Pure: used by the router's reads and by the
copies of job events published for their user (``P.uevents.<user>.<id>``).
"""

from __future__ import annotations

import re
from typing import Any

from irisfed.shared.users import split_job_id

OTHERS_JOB = "another user's job"
# Texts that name other jobs (the tick's preemption and hold details, docs/scheduling.md).
_NAMED = re.compile(r"(preempted by |held for )((?:[a-z][a-z0-9_-]{0,31}:)?[A-Za-z0-9][A-Za-z0-9._-]{0,127})")
_PLACED_PREEMPTING = "placed; preempted "


def as_seen_by(user: str, job_id: str) -> str:
    """A job named in ``user``'s rows: its own by the id it sent; any other user's as
    OTHERS_JOB (its id would tell that it exists)."""
    owner, bare = split_job_id(job_id)
    return bare if owner == user else OTHERS_JOB


def scrub(value: Any, user: str) -> Any:
    """Text (or a document of texts) with every job it names shown as ``user`` may see it."""
    if isinstance(value, str):
        if "preempted" not in value and "held for " not in value:
            return value  # names no job (most texts): nothing to look for
        if value.startswith(_PLACED_PREEMPTING):
            named = value[len(_PLACED_PREEMPTING):].split(", ")
            value = _PLACED_PREEMPTING + ", ".join(as_seen_by(user, job_id) for job_id in named)
        return _NAMED.sub(lambda m: m.group(1) + as_seen_by(user, m.group(2)), value)
    if isinstance(value, list):
        return [scrub(item, user) for item in value]
    if isinstance(value, dict):
        return {key: scrub(item, user) for key, item in value.items()}
    return value
