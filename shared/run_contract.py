"""What a job's run contract (docs/design.md §3.7) says, as people read it. Pure.

- ``contract_text``: its time limit, grace and failure retries (``time limit 30m,
  grace 30s, failure retries 2``), for ``irisfed job``, ``explain`` and the job page;
- ``runs_text``: how many runs it had and why each ran again (failures,
  infrastructure, preemptions, its agent's restarts): ``attempts`` counts runs;
- ``grace_until``: while a stop is under way (a cancel of a running job, a preempted
  run not yet seen to stop), when its grace ends and SIGKILL follows.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import DEFAULT_GRACE_S
from irisfed.shared.retry import retries_used
from irisfed.shared.shorthands import duration_words


def grace_of(spec: Mapping[str, Any], default_s: float = DEFAULT_GRACE_S) -> float:
    """The job's ``grace_s``, else ``default_s``."""
    grace = spec.get("grace_s")
    return float(grace) if isinstance(grace, (int, float)) and not isinstance(grace, bool) else default_s


def time_limit_of(spec: Mapping[str, Any]) -> float | None:
    limit = spec.get("time_limit_s")
    return float(limit) if isinstance(limit, (int, float)) and not isinstance(limit, bool) else None


def contract_text(spec: Mapping[str, Any]) -> str:
    """``time limit 30m, grace 30s, failure retries 2`` (``no time limit`` when none)."""
    limit = time_limit_of(spec)
    retries = spec.get("max_failure_retries") or 0
    return (f"{'time limit ' + duration_words(limit) if limit is not None else 'no time limit'}, "
            f"grace {duration_words(grace_of(spec))}, failure retries {retries}")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def runs_text(job: Any) -> str:
    """``3 runs: again after 1 failure (of 2 allowed), 1 preemption; infrastructure
    retries 0 of 2`` for a job row (attempts, max_retries, preemptions, failures,
    restarts, spec)."""
    failures, restarts = getattr(job, "failures", 0), getattr(job, "restarts", 0)
    spec = job.spec if isinstance(getattr(job, "spec", None), Mapping) else {}
    again = []
    if failures:
        again.append(f"{_count(failures, 'failure', 'failures')} (of {spec.get('max_failure_retries') or 0} allowed)")
    if job.preemptions:
        again.append(_count(job.preemptions, "preemption", "preemptions"))
    if restarts:
        again.append(_count(restarts, "agent restart", "agent restarts"))
    used = retries_used(job.attempts, job.preemptions, failures + restarts)
    head = _count(job.attempts, "run", "runs")
    return (f"{head}{': again after ' + ', '.join(again) if again else ''}; "
            f"infrastructure retries {used} of {job.max_retries}")


def grace_until(job: Any) -> datetime | None:
    """When SIGKILL follows SIGTERM for a stop under way: a running job whose cancel is
    stored, or a preempted job whose old run has not been seen to stop; else None."""
    grace = timedelta(seconds=grace_of(job.spec if isinstance(job.spec, Mapping) else {}))
    if job.state == JobState.RUNNING and job.cancel_requested and job.cancel_requested_at is not None:
        return job.cancel_requested_at + grace
    if job.state == JobState.QUEUED and getattr(job, "stopping_on", None):
        return job.updated_at + grace
    return None
