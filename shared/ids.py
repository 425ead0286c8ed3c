"""Job ids the router makes when a producer gives none: short, sortable by time, unique,
and not guessable.

``JobIds()()`` → ``01jfq3x7m9a2b7z0c`` (17 characters, Crockford's base32 in lower
case: no ``i``, ``l``, ``o``, ``u``, so nothing reads as another letter):

- 9 characters of milliseconds since the Unix epoch (45 bits: good until 3084), so
  ids sort by the time they were made;
- 8 characters (40 bits) drawn at random: a millisecond's first id starts at a random
  point of the lower half of that range, and each next id of the same millisecond a
  random step (1 to 2**20) above the last, so one generator's ids strictly increase
  (at least 2**19 per millisecond; past that it borrows the next millisecond).

Not guessable, on purpose: anyone allowed to submit may also submit with a ``job_id``
of their choosing, and may cancel any job by its id. When the rest of an id was a tag
fixed per router and a counter (a first version), one reply told a producer every id
the router would make in the next seconds: submitting those first made other
producers' submits fail with ``conflict``, and the same guesses named their jobs for
``cancel``. Now the next id of the same millisecond is one of 2**20, any later
millisecond's one of 2**39. Two routers make the same id only by drawing the same
value in the same millisecond (for two busy routers: once in thousands of years).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford's base32, lower case
TIME_CHARS, RANDOM_CHARS = 9, 8
SPAN = 32 ** RANDOM_CHARS  # 2**40 values of the random part
FIRST_SPAN = SPAN // 2  # a millisecond's first id: below this
MAX_STEP = 2 ** 20  # each next id of the same millisecond: at most this much above the last


def _base32(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        chars.append(ALPHABET[digit])
    if value:
        raise ValueError(f"{value} does not fit in {width} base32 characters")
    return "".join(reversed(chars))


class JobIds:
    """A generator of job ids (call it); ``clock_ms`` and ``randbelow`` are for tests."""

    def __init__(self, clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
                 randbelow: Callable[[int], int] = secrets.randbelow) -> None:
        self.clock_ms = clock_ms
        self.randbelow = randbelow
        self.last_ms = -1
        self.value = 0

    def __call__(self) -> str:
        now = self.clock_ms()
        if now > self.last_ms:
            self.last_ms, self.value = now, self.randbelow(FIRST_SPAN)
        else:  # the same millisecond, or the clock went back: on from the last id
            self.value += 1 + self.randbelow(MAX_STEP)
            if self.value >= SPAN:
                self.last_ms, self.value = self.last_ms + 1, self.randbelow(FIRST_SPAN)
        return _base32(self.last_ms, TIME_CHARS) + _base32(self.value, RANDOM_CHARS)
