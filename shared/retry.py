"""Retry policy, as a pure function.

Infrastructure failures (peer lost, agent restarted under a running job, backend
launch error) are retried while the job's ``max_retries`` allows. User failures
(the command exited non-zero) are final.
"""

from __future__ import annotations


def may_retry_infra_failure(attempts: int, max_retries: int) -> bool:
    """Whether a job that has been started ``attempts`` times may be started again."""
    retries_used = max(0, attempts - 1)
    return retries_used < max_retries
