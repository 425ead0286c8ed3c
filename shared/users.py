"""Users: who a request speaks for, whose job a row is, quotas and fair share. Pure, no I/O.

A federation serves several users (docs/design.md §3.2). Identity comes from the NATS
subject a request arrived on (which the server lets only that user's credentials
publish), never from a body. This module owns the rules every service applies:

- **Configured users** (``[[users]]``): ids, bands, weights, quotas, validated strictly.
- **Scoped job ids**: the same ``job_id`` from two users names two jobs. The id a user
  sends is stored as ``<user>:<job_id>`` (``alice:train-1``); the user ``default``'s
  ids are stored bare, so every v1 id and row stays what it was. ``:`` can be in no
  user-sent id (``JOB_ID_PATTERN``), so a stored id names exactly one (user, id), and it
  is safe in file names, NATS subject tokens, Slurm job names and Ray submission ids.
- **Quota**: the resources a user's live jobs hold never exceed any amount of its quota.
- **Fair share**: the dominant share of a user's live usage, divided by its weight.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from irisfed.shared.bands import BANDS, DEFAULT_BAND
from irisfed.shared.errors import ConfigError
from irisfed.shared.resources import (
    SLOTS,
    ResourceError,
    check_amount,
    check_name,
    fmt_amount,
    from_units,
    to_units,
)

DEFAULT_USER = "default"
USER_ENV = "IRISFED_USER"  # the user a client acts as when not told (`irisfed env --user` sets it)
USER_ROLE_PREFIX = "user-"  # configured user U's NATS user is `user-U`
USER_ID_PATTERN = r"^[a-z][a-z0-9_-]{0,31}(?!\n)$"
_USER_ID_RE = re.compile(USER_ID_PATTERN)
SEPARATOR = ":"
# A stored job id: an optional "<user>:" before the id the user sent (shared.messages).
STORED_JOB_ID_PATTERN = r"^(?:[a-z][a-z0-9_-]{0,31}:)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}(?!\n)$"

DEFAULT_MAX_BAND = DEFAULT_BAND

QUOTA = "quota"  # the waiting code of a job held back by its user's quota

_USER_KEYS = {"id", "max_band", "weight", "quota"}
MAX_USERS = 10_000  # a federation's users are teams and people, not jobs


@dataclass(frozen=True, slots=True)
class UserConfig:
    """One configured user. ``quota``: resource name → the most its live jobs may hold
    (absent: no cap on that resource); ``slots`` caps how many jobs may be live at once."""

    id: str
    max_band: str = DEFAULT_MAX_BAND
    weight: float = 1.0
    quota: Mapping[str, int | float] = field(default_factory=dict)

    def quota_units(self) -> dict[str, int]:
        return {name: quota_units(name, amount) for name, amount in self.quota.items()}


def quota_units(name: str, amount: float) -> int:
    return int(amount) if name == SLOTS else to_units(name, amount)


def validate_user_id(user_id: object, where: str = "user id") -> str:
    """``user_id`` when it is a valid user id (a NATS subject token); ConfigError otherwise."""
    if not isinstance(user_id, str) or not _USER_ID_RE.match(user_id):
        raise ConfigError(
            f"{where} {user_id!r} is invalid: a lower-case letter, then up to 31 lower-case letters, "
            "digits, '_' or '-' (it names NATS subjects and users)")
    return user_id


def _parse_quota(raw: object, where: str) -> dict[str, int | float]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: quota must be a table of resource name = amount, e.g. {{ gpu = 16 }}")
    quota: dict[str, int | float] = {}
    for name, amount in raw.items():
        try:
            if name == SLOTS:
                if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
                    raise ResourceError(f"{where}: quota.slots must be a whole number >= 0, got {amount!r}")
                quota[name] = amount
                continue
            check_name(name, f"{where}: quota")
            quota[name] = check_amount(name, amount, f"{where}: quota")
        except ResourceError as exc:
            raise ConfigError(str(exc)) from None
    return dict(sorted(quota.items()))


def parse_users(raw: object, peer_ids: Iterable[str] = ()) -> tuple[UserConfig, ...]:
    """``[[users]]`` entries → UserConfigs; ConfigError naming the first problem.

    A user id may not also be a peer id: ``P.cancel.<id>`` is a user's cancel request
    and a peer's cancel notice, and one subject cannot be both.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("users must be a list of [[users]] tables")
    if len(raw) > MAX_USERS:
        raise ConfigError(f"{len(raw)} [[users]] configured; at most {MAX_USERS}")
    peers = set(peer_ids)
    users: list[UserConfig] = []
    for entry in raw:
        if not isinstance(entry, Mapping):
            raise ConfigError("each [[users]] entry must be a table")
        user_id = validate_user_id(entry.get("id"), "[[users]] id")
        where = f"user {user_id}"
        bad = set(entry) - _USER_KEYS
        if bad:
            raise ConfigError(f"unknown keys in [[users]] {user_id}: {', '.join(sorted(map(str, bad)))}")
        if user_id in peers:
            raise ConfigError(f"{where}: a peer has the same id; {user_id!r} would name both a user's cancel "
                              "requests and that peer's cancel notices (P.cancel.<id>): rename one")
        max_band = entry.get("max_band", DEFAULT_MAX_BAND)
        if max_band not in BANDS:
            raise ConfigError(f"{where}: max_band must be one of {', '.join(BANDS)}, got {max_band!r}")
        weight = entry.get("weight", 1.0)
        if (isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight)
                or weight <= 0 or weight > 1e6):
            raise ConfigError(f"{where}: weight must be a number > 0 (at most 1e6), got {weight!r}")
        users.append(UserConfig(user_id, max_band, float(weight), _parse_quota(entry.get("quota", {}), where)))
    ids = [u.id for u in users]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ConfigError(f"users configured twice: {', '.join(twice)}")
    return tuple(users)


# ---------------------------------------------------------------- job ids


def stored_job_id(user: str, job_id: str) -> str:
    """The stored id of ``user``'s ``job_id``: ``alice:train-1``; the default user's bare."""
    return job_id if user == DEFAULT_USER else f"{user}{SEPARATOR}{job_id}"


def split_job_id(stored: str) -> tuple[str, str]:
    """(user, the id that user sent) of a stored job id."""
    user, sep, job_id = stored.partition(SEPARATOR)
    return (user, job_id) if sep else (DEFAULT_USER, stored)


def user_job_id(stored: str) -> str:
    """The id its user sent (and cancels by)."""
    return split_job_id(stored)[1]


# ---------------------------------------------------------------- quota


Usage = dict[str, int]  # resource → units held (cpu in millicores); "slots": live tasks


def add_units(usage: Usage, units: Iterable[tuple[str, int]], sign: int = 1, tasks: int = 1) -> None:
    """Add (or with ``sign`` -1 take away) one job's units — ``tasks`` tasks of them —
    and its slots (one per task)."""
    for name, amount in units:
        usage[name] = usage.get(name, 0) + sign * amount * tasks
    usage[SLOTS] = usage.get(SLOTS, 0) + sign * tasks


def _amount(name: str, units: int) -> str:
    return fmt_amount(units if name == SLOTS else from_units(name, units))


def quota_wait(user: UserConfig, held: Mapping[str, int], units: Iterable[tuple[str, int]],
               tasks: int = 1) -> str | None:
    """Why a job of ``tasks`` tasks each of ``units`` must wait for ``user``'s quota (``held``: what its live jobs
    hold now), or None when it fits: ``quota: this job's 1 gpu would take alice over its
    quota of 16 gpu``. The words name the quota and the job, not what the user holds
    now, so a waiting job's stored reason does not change (and is not written again)
    each time the user's usage moves; ``irisfed users`` shows the usage."""
    quota = user.quota
    if not quota:
        return None
    asked = {name: amount * tasks for name, amount in units}
    asked[SLOTS] = tasks
    for name, amount in user.quota_units().items():
        want = asked.get(name, 0)
        if want and held.get(name, 0) + want > amount:
            return (f"quota: this job's {_amount(name, want)} {name} would take {user.id} over its quota of "
                    f"{_amount(name, amount)} {name}")
    return None


def over_whole_quota(user: UserConfig, units: Iterable[tuple[str, int]], tasks: int = 1) -> str | None:
    """Why a job (``tasks`` tasks each of ``units``) can never run under ``user``'s quota
    (it asks more than the whole quota of some resource, or of slots), or None."""
    if not user.quota:
        return None
    asked = {name: amount * tasks for name, amount in units}
    for name, amount in user.quota_units().items():
        want = tasks if name == SLOTS else asked.get(name, 0)
        if want > amount:
            return (f"quota: the job asks {_amount(name, want)} {name}; user {user.id}'s quota allows "
                    f"{_amount(name, amount)} in all")
    return None


# ---------------------------------------------------------------- fair share


def share_text(share: float) -> str:
    """A weighted dominant share as people read it, everywhere: ``25.0%``."""
    return f"{share * 100:.1f}%"


def dominant_share(held: Mapping[str, int], totals: Mapping[str, int], weight: float) -> float:
    """The largest fraction of any federation total that ``held`` takes, divided by ``weight``."""
    share = 0.0
    for name, amount in held.items():
        total = totals.get(name, 0)
        if amount > 0 and total > 0:
            fraction = amount / total
            if fraction > share:
                share = fraction
    return share / weight


@dataclass(slots=True)
class UserTable:
    """The configured users by id; a user not configured (``default`` when absent,
    or one since removed from the file) has weight 1, no quota, ``max_band`` default."""

    users: Mapping[str, UserConfig] = field(default_factory=dict)

    @classmethod
    def of(cls, users: Iterable[UserConfig]) -> UserTable:
        return cls({u.id: u for u in users})

    def get(self, user_id: str) -> UserConfig:
        found = self.users.get(user_id)
        return found if found is not None else UserConfig(user_id)

    def knows(self, user_id: str) -> bool:
        """May ``user_id`` make requests? Configured users, and ``default`` always."""
        return user_id == DEFAULT_USER or user_id in self.users

    def with_quota(self) -> set[str]:
        return {u.id for u in self.users.values() if u.quota}


def describe_usage(held: Mapping[str, int]) -> dict[str, Any]:
    """Units held → amounts in each resource's own unit (``slots``: live jobs)."""
    return {name: (units if name == SLOTS else from_units(name, units)) for name, units in sorted(held.items())}
