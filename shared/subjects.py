"""NATS subject names (wire contract v1), built from one configurable prefix."""

from __future__ import annotations

import re
from dataclasses import dataclass

from irisfed.shared.errors import ConfigError
from irisfed.shared.users import DEFAULT_USER

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

    def submit_for(self, user: str) -> str:
        """Where ``user`` submits (docs/design.md §3.2); ``default``'s is v1's ``submit``."""
        return self.submit if user == DEFAULT_USER else f"{self.prefix}.submit.{user}"

    def cancel_for(self, user: str) -> str:
        """Where ``user`` asks for cancels; ``default``'s is v1's ``cancel``."""
        return self.cancel if user == DEFAULT_USER else f"{self.prefix}.cancel.{user}"

    @property
    def operator_cancel(self) -> str:
        """Operators cancel any job here (operator and web NATS users only)."""
        return f"{self.prefix}.operator.cancel"

    def user_of(self, subject: str, base: str) -> str | None:
        """The user a request on ``subject`` speaks for, ``base`` being ``submit`` or
        ``cancel``'s subject: ``default`` for ``base`` itself, the last token of
        ``base.<user>``; None for any other subject."""
        if subject == base:
            return DEFAULT_USER
        head, _, user = subject.rpartition(".")
        return user if head == base and user else None

    def read_for(self, kind: str, user: str) -> str:
        """Where ``user`` reads its own jobs' ``kind`` (``logs``, docs/design.md §3.6):
        ``P.read.<kind>`` for ``default``, ``P.read.<kind>.<user>`` for any other user."""
        base = f"{self.prefix}.read.{kind}"
        return base if user == DEFAULT_USER else f"{base}.{user}"

    def operator_read(self, kind: str) -> str:
        """Operators read any job's ``kind`` here (operator and web NATS users only)."""
        return f"{self.prefix}.operator.read.{kind}"

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

    def fetch(self, peer_id: str = "*") -> str:
        """Where peer_id's agent asks the router for a job's workspace (docs/design.md §3.5)."""
        return f"{self.prefix}.fetch.{peer_id}"

    def fetch_peer(self, subject: str) -> str | None:
        """The peer a request on ``subject`` (``fetch.<peer>``) speaks for; None otherwise."""
        head, _, peer = subject.rpartition(".")
        return peer if head == f"{self.prefix}.fetch" and peer else None

    def events(self, job_id: str = "*") -> str:
        """``P.events.<job>``: job ``job_id`` (its stored id) as one token (``job_token``)."""
        return f"{self.prefix}.events.{job_token(job_id)}"

    def user_events(self, user: str, job_id: str = "*") -> str:
        """``P.uevents.<user>.<id>``: ``user``'s job ``job_id`` (the id it submitted, as one
        token) as that user sees its events; ``*`` (the default) every one of them: what
        its credentials may subscribe to (docs/design.md §3.6)."""
        return f"{self.prefix}.uevents.{user}.{job_token(job_id)}"


def job_token(job_id: str) -> str:
    """A job id as one subject token: its dots (a job id may hold them; a token may not)
    as ``~`` (which no job id holds, so ``job_of_token`` reads it back)."""
    return job_id.replace(".", "~")


def job_of_token(token: str) -> str:
    return token.replace("~", ".")
