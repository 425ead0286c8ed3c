"""The charts' series, rebuilt from counts and the changelog. Pure.

Over the last hour, per minute:
- submits/s: jobs submitted that minute (``jobs.submitted_at``) / 60;
- completions/s: changes into succeeded, failed, killed or unschedulable / 60 (a
  job rejected at submit never ran: not a completion);
- queue depth and running jobs per peer: the counts now, walked back minute by
  minute through the changelog (the level at the end of a minute is the level at
  the end of the next one less what that next minute changed).

The current minute's rates are over the seconds it has lasted so far. Levels are
never drawn below zero (a changelog row committed late can make the walk dip).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from irisfed.shared.records import ChangelogPoint, ChartCount

WINDOW_MIN = 60
ENDED_RUNS = frozenset({"succeeded", "failed", "killed", "unschedulable"})
MAX_PEER_SERIES = 10  # more peers are summed as "other"
OTHER = "(other peers)"


@dataclass
class Minute:
    """What one minute changed."""

    submits: int = 0
    completions: int = 0
    queued: int = 0  # net change of the queue's depth
    running: dict[str, int] = field(default_factory=dict)  # net change of running jobs per peer


def minute_of(when: datetime) -> int:
    """The start of ``when``'s minute, in epoch seconds."""
    return int(when.timestamp()) // 60 * 60


def window_start(now: datetime, minutes: int = WINDOW_MIN) -> int:
    return minute_of(now) - (minutes - 1) * 60


def fold(counts: Iterable[ChartCount], submits: Mapping[datetime, int] | None = None
         ) -> tuple[dict[int, Minute], int, dict[str, int]]:
    """``changelog_count_by_minute`` rows (and submits per minute) → (minutes, queued now,
    running now per peer)."""
    minutes: dict[int, Minute] = {}
    queued_now, running_now = 0, {}

    def at(when: datetime) -> Minute:
        return minutes.setdefault(minute_of(when), Minute())

    for row in counts:
        if row.kind == "now":
            if row.to_state == "queued":
                queued_now += row.n
            elif row.to_state == "running" and row.peer_id:
                running_now[row.peer_id] = running_now.get(row.peer_id, 0) + row.n
            continue
        minute = at(row.minute)
        if row.to_state in ENDED_RUNS and row.from_state is not None:
            minute.completions += row.n
        if row.to_state == "queued":
            minute.queued += row.n
        if row.from_state == "queued":
            minute.queued -= row.n
        if row.peer_id:
            if row.to_state == "running":
                minute.running[row.peer_id] = minute.running.get(row.peer_id, 0) + row.n
            if row.from_state == "running":
                minute.running[row.peer_id] = minute.running.get(row.peer_id, 0) - row.n
    for when, n in (submits or {}).items():
        at(when).submits += n
    return minutes, queued_now, running_now


def _walk_back(now_level: int, deltas: list[int]) -> list[int]:
    """Levels at the end of each minute, from the level now and each minute's change."""
    levels = [0] * len(deltas)
    level = now_level
    for i in range(len(deltas) - 1, -1, -1):
        levels[i] = max(0, level)
        level -= deltas[i]
    return levels


def series(now: datetime, minutes: Mapping[int, Minute], queued_now: int, running_now: Mapping[str, int],
           window: int = WINDOW_MIN, max_peers: int = MAX_PEER_SERIES) -> dict:
    """The charts' data (JSON-ready): ``t`` (each minute's start, epoch seconds),
    ``submits`` and ``completions`` (per second), ``queued``, and ``running`` (one
    ``{"peer", "values"}`` per peer, busiest first)."""
    first = window_start(now, window)
    times = [first + 60 * i for i in range(window)]
    rows = [minutes.get(t, Minute()) for t in times]
    elapsed = max(1.0, now.timestamp() - times[-1])
    spans = [60.0] * (window - 1) + [min(60.0, elapsed)]
    submits = [round(m.submits / s, 3) for m, s in zip(rows, spans, strict=True)]
    completions = [round(m.completions / s, 3) for m, s in zip(rows, spans, strict=True)]
    queued = _walk_back(queued_now, [m.queued for m in rows])
    peers = set(running_now)
    for m in rows:
        peers.update(m.running)
    running = {peer: _walk_back(running_now.get(peer, 0), [m.running.get(peer, 0) for m in rows])
               for peer in peers}
    busiest = sorted(running, key=lambda p: (-max(running[p], default=0), p))
    shown = [{"peer": p, "values": running[p]} for p in busiest[:max_peers]]
    rest = busiest[max_peers:]
    if rest:
        shown.append({"peer": OTHER, "values": [sum(running[p][i] for p in rest) for i in range(window)]})
    return {"t": times, "submits": submits, "completions": completions, "queued": queued, "running": shown,
            "window_min": window, "generated_at": now.isoformat()}


def merge(kept: Mapping[int, Minute], fresh: Mapping[int, Minute], since: int, first: int) -> dict[int, Minute]:
    """Minutes from ``first`` on: ``kept`` ones before ``since`` (settled), ``fresh`` from ``since``."""
    merged = {t: m for t, m in kept.items() if first <= t < since}
    merged.update({t: m for t, m in fresh.items() if t >= since})
    return merged


async def first_seq_from(probe: Callable[[int], Awaitable[ChangelogPoint | None]], lo: int, hi: int,
                         target: datetime) -> int:
    """A position in [lo, hi + 1] from which the changelog's first row is its first one at
    ``target`` or later (hi + 1: no row is): rows before it are all older.

    Bisects positions with ``probe(seq)`` (the first row at ``seq`` or later), taking
    times to rise with positions; they do to within a transaction's length, which
    callers allow for by asking for a ``target`` a little earlier than they need.
    """
    last = await probe(hi)
    if last is None or last.at < target:
        return hi + 1
    while lo < hi:
        mid = (lo + hi) // 2
        point = await probe(mid)
        if point is None or point.at >= target:
            hi = mid
        else:
            lo = point.seq + 1
    return lo


SETTLE = timedelta(minutes=2)  # a minute older than this no longer changes: its moves are committed
SEQ_MARGIN = timedelta(minutes=2)  # how far positions may run ahead of times (a transaction's length)
