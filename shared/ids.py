"""Job ids the router makes when a producer gives none: short, sortable by time, unique.

``JobIds()()`` → ``01jfq3x7m9a2b7z0c`` (17 characters, Crockford's base32 in lower
case: no ``i``, ``l``, ``o``, ``u``, so nothing reads as another letter):

- 9 characters of milliseconds since the Unix epoch (45 bits: good until 3084), so
  ids sort by the time they were made;
- 5 characters of a tag drawn at random once per generator (25 bits: one per router
  process);
- 3 characters of a counter within the millisecond (32,768 ids per millisecond; past
  that the generator borrows the next millisecond, so ids stay increasing).

One generator never repeats an id. Two routers can only make the same id if they
drew the same tag (about one chance in 30 million for two routers) *and* made an id
in the same millisecond with the same count. (A uuid4 is 32 characters; 128 random
bits buy nothing a producer needs here: the id is a name, not a secret.)
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford's base32, lower case
TIME_CHARS, TAG_CHARS, COUNT_CHARS = 9, 5, 3
MAX_COUNT = 32 ** COUNT_CHARS


def _base32(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        chars.append(ALPHABET[digit])
    if value:
        raise ValueError(f"{value} does not fit in {width} base32 characters")
    return "".join(reversed(chars))


class JobIds:
    """A generator of job ids (call it); ``clock_ms`` is for tests."""

    def __init__(self, clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000, tag: int | None = None):
        self.clock_ms = clock_ms
        self.tag = _base32(secrets.randbelow(32 ** TAG_CHARS) if tag is None else tag, TAG_CHARS)
        self.last_ms = -1
        self.count = 0

    def __call__(self) -> str:
        now = self.clock_ms()
        if now > self.last_ms:
            self.last_ms, self.count = now, 0
        else:  # the same millisecond, or the clock went back: count on from the last id
            self.count += 1
            if self.count == MAX_COUNT:
                self.last_ms, self.count = self.last_ms + 1, 0
        return _base32(self.last_ms, TIME_CHARS) + self.tag + _base32(self.count, COUNT_CHARS)
