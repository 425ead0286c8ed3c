"""Jobs that wait for other jobs (docs/design.md §3.8), as pure rules.

A dependency ``(job, when)`` is *met* once that job ended as ``when`` asks (``ok``:
succeeded; ``failed``: ended any other way; ``any``: ended), *broken* once it ended
otherwise (it never can be met: the waiting job ends ``unschedulable`` naming it),
and *pending* while it has not ended. The router applies these at submit (the states
it read under lock); Postgres applies the same rule when a dependency ends
(``irisfed_dependencies_settle``, migration 0019, whose reason texts match
``broken_reason`` word for word: tests/integration/test_dependencies.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from irisfed.shared.lifecycle import TERMINAL_STATES, JobState

DEPENDENCY = "dependency"  # the waiting code of a job whose dependencies have not all ended
MET, PENDING, BROKEN = "met", "pending", "broken"
CONDITIONS = ("ok", "any", "failed")
SHOWN_AT_MOST = 10  # pending dependencies a waiting job's reason names (the rest counted)
# How a condition reads to a person (irisfed job, the job page).
CONDITION_WORDS = {"ok": "must succeed", "any": "must end", "failed": "must end other than succeeded"}


def outcome(when: str, state: str) -> str:
    """``met``, ``pending`` or ``broken``: a dependency on a job in ``state``."""
    if state not in TERMINAL_STATES:
        return PENDING
    if when == "any" or (when == "ok") == (state == JobState.SUCCEEDED):
        return MET
    return BROKEN


def broken_reason(shown: str, state: str, when: str) -> str:
    """Why a job ends ``unschedulable``: ``dependency prep ended failed; it had to succeed``."""
    need = "it had to succeed" if when == "ok" else "it had to end other than succeeded"
    return f"dependency {shown} ended {state}; {need}"


@dataclass(frozen=True)
class Settled:
    """A submit's dependencies as their states stand: how many are pending, and the
    first broken one's reason ("" when none is)."""

    pending: int
    broken: str
    waiting_on: tuple[str, ...]  # ``prep (running)`` for each pending one, in order
    edges: tuple[tuple[str, str, str], ...] = ()  # (shown id, stored id, when) of each dependency

    def reason(self) -> str:
        """What a job waiting on them says: ``waiting for its dependencies: prep (running)``;
        past SHOWN_AT_MOST of them, how many more (an array named stands for thousands)."""
        shown = ", ".join(self.waiting_on[:SHOWN_AT_MOST])
        more = len(self.waiting_on) - SHOWN_AT_MOST
        return f"waiting for its dependencies: {shown}" + (f" and {more:,} more" if more > 0 else "")


def settle(after: Sequence[tuple[str, str, str]], states: Mapping[str, str]) -> Settled:
    """``after``: (shown id, stored id, when) each; ``states``: stored id → state."""
    pending, broken, waiting = 0, "", []
    for shown, stored, when in after:
        state = states[stored]
        result = outcome(when, state)
        if result == PENDING:
            pending += 1
            waiting.append(f"{shown} ({state})")
        elif result == BROKEN and not broken:
            broken = broken_reason(shown, state, when)
    return Settled(pending, broken, tuple(waiting), tuple(after))
