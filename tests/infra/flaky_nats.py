"""A NATS client stand-in for the one fault a real server cannot be made to produce at
an exact point of a loop: a publish that fails while the client says it is connected."""

from __future__ import annotations

import nats.errors


class FlakyNats:
    """Connected, but every publish after the first ``ok`` ones fails."""

    is_connected = True

    def __init__(self, ok: int = 1) -> None:
        self.ok = ok
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes = b"", **_) -> None:
        if len(self.published) >= self.ok:
            raise nats.errors.ConnectionClosedError
        self.published.append(subject)
