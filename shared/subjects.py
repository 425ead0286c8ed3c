"""NATS subject names (wire contract v1), built from one configurable prefix."""

from __future__ import annotations

import re
from dataclasses import dataclass

from irisfed.shared.errors import ConfigError

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")

SUBMIT_QUEUE_GROUP = "irisfed-router"
TICK_QUEUE_GROUP = "irisfed-tick"


@dataclass(frozen=True, slots=True)
class Subjects:
    """Every subject irisfed uses, under ``prefix`` (default ``irisfed``)."""

    prefix: str = "irisfed"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigError(f"invalid subject prefix {self.prefix!r}")

    @property
    def submit(self) -> str:
        return f"{self.prefix}.submit"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    @property
    def tick_wake(self) -> str:
        return f"{self.prefix}.tick.wake"

    @property
    def tick_ping(self) -> str:
        """Health probe: every running tick answers with how many runs it made."""
        return f"{self.prefix}.tick.ping"

    def heartbeat(self, peer_id: str = "*") -> str:
        return f"{self.prefix}.heartbeat.{peer_id}"

    def assign(self, peer_id: str) -> str:
        return f"{self.prefix}.assign.{peer_id}"

    def cancel_notice(self, peer_id: str) -> str:
        return f"{self.prefix}.cancel.{peer_id}"

    def events(self, job_id: str = "*") -> str:
        return f"{self.prefix}.events.{job_id}"
