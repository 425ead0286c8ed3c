"""Crash points for fault-injection tests: ``IRISFED_CRASH_AT=<name>`` kills the
process right there (as SIGKILL would), e.g. between a commit and its publish.
Unset in production, where this is a dictionary lookup and nothing else."""

from __future__ import annotations

import os

CRASH_ENV = "IRISFED_CRASH_AT"
_crash_at = os.environ.get(CRASH_ENV, "")


def crash_point(name: str) -> None:
    if _crash_at == name:
        os._exit(137)
