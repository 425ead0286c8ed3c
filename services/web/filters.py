"""The job list's filters and its keyset cursor, from a query string to a
``JobPageQuery`` and back to links. Pure.

Every value comes from a URL anyone can type, so every one is checked (length,
characters, form) and a bad one is a ``FilterError`` whose message the page shows
(HTTP 400), never a failed query. The cursor is opaque to people:
base64url of ``<submitted_at ISO>|<job_id>``, the last row of the previous page (a
stored id: ``alice:train-1`` for a user's job, shared.users).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlencode

from irisfed.shared.federation.peer import PEER_ID_PATTERN
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import JobPageQuery
from irisfed.shared.users import STORED_JOB_ID_PATTERN, USER_ID_PATTERN

MAX_TEXT = 200
MAX_LABELS = 8
MAX_LABEL_PART = 256  # a label key or value (the wire's limit)
MAX_CURSOR = 400
STATES = tuple(s.value for s in JobState)

_JOB_ID = re.compile(STORED_JOB_ID_PATTERN)
_PEER_ID = re.compile(PEER_ID_PATTERN)
_USER_ID = re.compile(USER_ID_PATTERN)
_KNOWN = ("state", "peer", "user", "label", "text", "after")


class FilterError(ValueError):
    """A filter or cursor that cannot be used; the message is for the person who typed it."""


@dataclass(frozen=True)
class JobFilter:
    """What the job list shows: the checked filters and where the page starts."""

    state: str = ""
    peer: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    text: str = ""
    after: tuple[datetime, str] | None = None
    user: str = ""  # whose jobs (shared.users); "": everyone's

    def query(self, limit: int) -> JobPageQuery:
        return JobPageQuery(state=self.state or None, owner_peer_id=self.peer or None,
                            labels=dict(self.labels) or None, text=like_escape(self.text) or None,
                            after=self.after, limit=limit, user_id=self.user or None)

    def params(self, after: tuple[datetime, str] | None = None) -> list[tuple[str, str]]:
        """The query string's fields for these filters (and the cursor ``after``)."""
        fields = [("state", self.state), ("peer", self.peer), ("user", self.user)]
        fields += [("label", f"{k}={v}") for k, v in self.labels]
        fields += [("text", self.text)]
        if after is not None:
            fields.append(("after", encode_cursor(*after)))
        return [(k, v) for k, v in fields if v]

    def query_string(self, after: tuple[datetime, str] | None = None) -> str:
        """``?state=...`` (or "" when there is nothing to say)."""
        params = self.params(after)
        return "?" + urlencode(params) if params else ""

    @property
    def active(self) -> bool:
        return bool(self.state or self.peer or self.user or self.labels or self.text)


def like_escape(text: str) -> str:
    """``text`` for ``ILIKE '%' || text || '%'``: its LIKE metacharacters taken literally."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _one(items: list[tuple[str, str]], name: str) -> str:
    values = [v for k, v in items if k == name]
    if len(values) > 1 and len(set(values)) > 1:
        raise FilterError(f"give the {name} filter at most once")
    return values[0].strip() if values else ""


def _no_nul(value: str, what: str) -> None:
    if "\x00" in value:
        raise FilterError(f"the {what} must not contain NUL characters")


def parse_label(raw: str) -> tuple[str, str]:
    """``key=value`` → (key, value); the key must not be empty."""
    _no_nul(raw, "label filter")
    key, sep, value = raw.partition("=")
    key = key.strip()
    if not sep or not key:
        raise FilterError("a label filter looks like key=value")
    if len(key) > MAX_LABEL_PART or len(value) > MAX_LABEL_PART:
        raise FilterError(f"a label's key and value are at most {MAX_LABEL_PART} characters each")
    return key, value


def parse_filters(items: Iterable[tuple[str, str]]) -> JobFilter:
    """A query string's (name, value) pairs → ``JobFilter``; unknown names are ignored."""
    items = [(k, v) for k, v in items if k in _KNOWN]
    state = _one(items, "state")
    if state and state not in STATES:
        raise FilterError(f"unknown state {state[:40]!r}: one of {', '.join(STATES)}")
    peer = _one(items, "peer")
    if peer and not _PEER_ID.fullmatch(peer):
        raise FilterError("a peer id is letters, digits, '_' or '-' (at most 64)")
    user = _one(items, "user")
    if user and not _USER_ID.fullmatch(user):
        raise FilterError("a user id is a lower-case letter, then up to 31 lower-case letters, digits, '_' or '-'")
    raw_labels = [v for k, v in items if k == "label" and v.strip()]
    if len(raw_labels) > MAX_LABELS:
        raise FilterError(f"at most {MAX_LABELS} label filters")
    labels = tuple(dict(parse_label(v) for v in raw_labels).items())
    text = _one(items, "text")
    _no_nul(text, "text filter")
    if len(text) > MAX_TEXT:
        raise FilterError(f"the text filter is at most {MAX_TEXT} characters")
    cursor = _one(items, "after")
    after = decode_cursor(cursor) if cursor else None
    return JobFilter(state=state, peer=peer, labels=labels, text=text, after=after, user=user)


def encode_cursor(submitted_at: datetime, job_id: str) -> str:
    raw = f"{submitted_at.isoformat()}|{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (submitted_at, job_id) an ``encode_cursor`` value holds; FilterError otherwise."""
    bad = FilterError("this page link is not valid (start again from the first page)")
    if len(cursor) > MAX_CURSOR or not re.fullmatch(r"[A-Za-z0-9_-]+", cursor):
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, ValueError):
        raise bad from None
    when, sep, job_id = raw.partition("|")
    if not sep or not _JOB_ID.fullmatch(job_id):
        raise bad
    try:
        at = datetime.fromisoformat(when)
    except ValueError:
        raise bad from None
    if at.tzinfo is None:
        raise bad
    try:  # Postgres compares it in UTC: 9999-12-31T23:59-14:00 has no UTC datetime
        at.astimezone(UTC)
    except OverflowError:
        raise bad from None
    return at, job_id
