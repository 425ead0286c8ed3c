"""Time, injected: every service reads the clock through a ``Clock``.

Two readings, for two purposes:
- ``monotonic()``: seconds on a clock that never jumps, for ages, timeouts and
  schedules (is a peer's heartbeat stale, is a full tick pass due);
- ``now()``: the aware UTC wall-clock time, for what is stamped on messages
  (heartbeats' ``sent_at``, events' ``at``).

Services default to ``SYSTEM_CLOCK``; tests inject a ``ManualClock`` (or, as older
tests do, a bare ``() -> float`` callable, which ``as_clock`` accepts as the
monotonic reading).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Where a service reads the time."""

    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...


class SystemClock:
    """The machine's clocks: ``time.monotonic`` and ``datetime.now(UTC)``."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC)


SYSTEM_CLOCK = SystemClock()


@dataclass
class ManualClock:
    """A clock that moves only when told to (``advance``): for tests, no sleeping."""

    mono: float = 1000.0
    wall: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=UTC))

    def monotonic(self) -> float:
        return self.mono

    def now(self) -> datetime:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class _MonotonicOnly:
    """A bare ``() -> float`` as a Clock: its reading is monotonic, the wall clock the system's."""

    monotonic: Callable[[], float]

    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC)


def as_clock(clock: Clock | Callable[[], float] | None) -> Clock:
    """``clock`` as a Clock (None: the system's; a bare callable: its monotonic reading)."""
    if clock is None:
        return SYSTEM_CLOCK
    if isinstance(clock, Clock):
        return clock
    return _MonotonicOnly(clock)
