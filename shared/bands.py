"""Priority bands (docs/design.md §3.3): the one place their names and order live.

``production`` > ``interactive`` (the default) > ``batch``. Bands order the queue
before anything else (fair share, priority, submit time), and a queued job may
preempt running work only of a strictly lower band. Stored as a small integer
(``jobs.band``: its rank here) so the queue's index sorts by it.
"""

from __future__ import annotations

BATCH = "batch"
INTERACTIVE = "interactive"
PRODUCTION = "production"
BANDS = (BATCH, INTERACTIVE, PRODUCTION)  # lowest first: a band's rank is its index
DEFAULT_BAND = INTERACTIVE
DEFAULT_BAND_RANK = BANDS.index(DEFAULT_BAND)
# Never preempted, whatever asks (§3.3).
UNPREEMPTIBLE_RANK = BANDS.index(PRODUCTION)
# How many times a job may be preempted before the next preemption fails it (submit
# field ``max_preemptions``, §3.3).
DEFAULT_MAX_PREEMPTIONS = 100
MAX_PREEMPTIONS_LIMIT = 10_000


def band_rank(name: str) -> int:
    """``batch`` 0, ``interactive`` 1, ``production`` 2; ValueError naming the bands otherwise."""
    try:
        return BANDS.index(name)
    except ValueError:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {name!r}") from None


def band_name(rank: int) -> str:
    """The band stored as ``rank`` (an unknown rank, from a newer writer, is shown as a number)."""
    return BANDS[rank] if 0 <= rank < len(BANDS) else str(rank)


def may_preempt(preemptor_rank: int, victim_rank: int) -> bool:
    """Only strictly lower bands, and never ``production``."""
    return victim_rank < preemptor_rank and victim_rank < UNPREEMPTIBLE_RANK
