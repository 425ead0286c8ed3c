"""docs/design.md §6 checks shared by every end-to-end test (and the chaos suite).

The pure checks (:func:`quota_violations`, :func:`identity_violations`) take rows and
return what is wrong; the async ones read them from Postgres first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import ACTIVE_STATES, JobState, can_transition
from irisfed.shared.resources import (
    SLOTS,
    as_resources,
    fmt_amount,
    from_units,
    resources_from_json,
)
from irisfed.shared.users import Usage, add_units, quota_units, split_job_id


class Queryable(Protocol):
    """An asyncpg connection or pool."""

    async def fetch(self, query: str, *args: Any) -> list[Any]: ...


async def changelog_violations(store: Store) -> list[str]:
    """Everything wrong between `jobs` and `federation_changelog` (empty: all good).

    - the changelog replays, transition by legal transition, to each job's state;
    - epochs never go backwards and end at the job's epoch;
    - a pinned job never reaches a peer other than its pin;
    - no job succeeds twice.
    """
    problems: list[str] = []
    history = defaultdict(list)
    for row in await store.changelog_list_all():
        history[row.job_id].append(row)
    for job in await store.job_list_states():
        job_id = job.job_id
        rows = history.pop(job_id, [])
        if not rows:
            problems.append(f"{job_id}: no changelog rows")
            continue
        state: JobState | None = None
        epoch = -1
        successes = 0
        for row in rows:
            from_state = JobState(row.from_state) if row.from_state else None
            to_state = JobState(row.to_state)
            if from_state != state:
                problems.append(f"{job_id}: seq {row.seq} starts from {from_state} but the job was {state}")
            if not can_transition(from_state, to_state):
                problems.append(f"{job_id}: seq {row.seq} illegal {from_state} → {to_state}")
            if row.epoch < epoch:
                problems.append(f"{job_id}: epoch went back from {epoch} to {row.epoch}")
            pin = job.pinned_peer_id
            if pin and row.peer_id and row.peer_id != pin:
                problems.append(f"{job_id}: pinned to {pin} but reached {row.peer_id}")
            successes += to_state is JobState.SUCCEEDED
            state, epoch = to_state, row.epoch
        if state is not None and state.value != job.state:
            problems.append(f"{job_id}: changelog replays to {state.value} but jobs says {job.state}")
        if epoch != job.epoch:
            problems.append(f"{job_id}: changelog ends at epoch {epoch} but jobs says {job.epoch}")
        if successes > 1:
            problems.append(f"{job_id}: succeeded {successes} times")
    for job_id in history:
        problems.append(f"{job_id}: changelog rows for a job that does not exist")
    return problems


async def assert_changelog_replays(store: Store) -> None:
    problems = await changelog_violations(store)
    assert not problems, "invariant violations:\n" + "\n".join(problems)


# ---------------------------------------------------------------- invariant 10: quota

LIVE_STATES = frozenset(state.value for state in ACTIVE_STATES)  # assigned, running: holding room


@dataclass(frozen=True, slots=True)
class JobHolding:
    """What a job holds while live: whose it is (``jobs.user_id``) and what it asked
    (``jobs.resources``: a mapping, its JSON text, or None for the default request)."""

    user_id: str
    resources: Mapping[str, object] | str | None = None


def _units(resources: Mapping[str, object] | str | None) -> tuple[tuple[str, int], ...]:
    if isinstance(resources, str):
        return resources_from_json(resources).units
    return as_resources(resources).units


def _state(value: object) -> str:
    return value.value if isinstance(value, JobState) else str(value)


def replay_live_usage(changelog: Iterable[Any], jobs: Mapping[str, JobHolding]
                      ) -> Iterator[tuple[Any, str, Usage]]:
    """Replay ``changelog`` (rows with ``seq``, ``job_id``, ``to_state``; any order: sorted
    here by ``seq``) tracking each job's state; after each row that makes a job live
    (assigned or running, from not live) or ends its being live, yield (row, its job's
    user, what that user's live jobs hold then: units per resource, ``slots`` their
    number). The usage dict is live: copy it to keep it. Rows of jobs missing from
    ``jobs`` are skipped (:func:`changelog_violations` reports them)."""
    state: dict[str, str] = {}
    held: dict[str, Usage] = defaultdict(dict)
    units_of: dict[str, tuple[tuple[str, int], ...]] = {}
    for row in sorted(changelog, key=lambda r: r.seq):
        job = jobs.get(row.job_id)
        if job is None:
            continue
        was = state.get(row.job_id) in LIVE_STATES
        to_state = _state(row.to_state)
        state[row.job_id] = to_state
        now = to_state in LIVE_STATES
        if was == now:
            continue
        units = units_of.get(row.job_id)
        if units is None:
            units = units_of[row.job_id] = _units(job.resources)
        usage = held[job.user_id]
        add_units(usage, units, sign=1 if now else -1)
        yield row, job.user_id, usage


def quota_violations(changelog: Iterable[Any], jobs: Mapping[str, JobHolding],
                     quotas: Mapping[str, Mapping[str, int | float]]) -> list[str]:
    """Invariant 10 (docs/design.md §6): every moment (changelog position, in ``seq``
    order) at which some user's live jobs held more than its quota of a resource
    (``quotas``: user → resource → most, as configured; ``slots``: live jobs). Each
    moment that goes over is one line, naming the row that took the user over."""
    limits = {user: {name: quota_units(name, amount) for name, amount in quota.items()}
              for user, quota in quotas.items() if quota}
    problems: list[str] = []
    for row, user, usage in replay_live_usage(changelog, jobs):
        limit = limits.get(user)
        if not limit or _state(row.to_state) not in LIVE_STATES:
            continue  # a job that stops being live only gives back
        for name, most in limit.items():
            have = usage.get(name, 0)
            if have > most:
                problems.append(
                    f"{row.job_id}: quota: at seq {row.seq} (→ {_state(row.to_state)}) user {user}'s live jobs "
                    f"held {_amount(name, have)} {name}, over its quota of {_amount(name, most)}")
    return problems


def peak_live_usage(changelog: Iterable[Any], jobs: Mapping[str, JobHolding]) -> dict[str, Usage]:
    """The most each user's live jobs held of each resource at any one moment (units)."""
    peaks: dict[str, Usage] = defaultdict(dict)
    for _, user, usage in replay_live_usage(changelog, jobs):
        peak = peaks[user]
        for name, amount in usage.items():
            if amount > peak.get(name, 0):
                peak[name] = amount
    return dict(peaks)


def _amount(name: str, units: int) -> str:
    return fmt_amount(units if name == SLOTS else from_units(name, units))


async def job_holdings(conn: Queryable) -> dict[str, JobHolding]:
    """Every job's user and resources (``jobs.user_id``, ``jobs.resources``)."""
    rows = await conn.fetch("SELECT job_id, user_id, resources::text AS resources FROM jobs")
    return {r["job_id"]: JobHolding(r["user_id"], r["resources"]) for r in rows}


async def quota_replay_violations(store: Store, conn: Queryable,
                                  quotas: Mapping[str, Mapping[str, int | float]]) -> list[str]:
    """:func:`quota_violations` over the whole changelog and the ``jobs`` table."""
    return quota_violations(await store.changelog_list_all(), await job_holdings(conn), quotas)


async def assert_quotas_held(store: Store, conn: Queryable, quotas: Mapping[str, Mapping[str, int | float]]) -> None:
    problems = await quota_replay_violations(store, conn, quotas)
    assert not problems, "quota violations:\n" + "\n".join(problems)


# ---------------------------------------------------------------- invariant 9: identity


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """Whose a job is and who asked to cancel it (``jobs`` columns); ``sent_by``: the
    user its submitter says it sent it as (a spec label, when the test writes one)."""

    user_id: str
    state: str
    cancel_requested: bool = False
    cancel_requested_by: str | None = None
    sent_by: str | None = None


def _may_cancel(requested_by: str, user_id: str) -> bool:
    """May a cancel stored as asked by ``requested_by`` end ``user_id``'s job? Its own
    user (``user alice``) or an operator (``operator``, ``operator (web)``)."""
    return requested_by == f"user {user_id}" or requested_by == "operator" or requested_by.startswith("operator (")


def identity_violations(jobs: Mapping[str, JobIdentity], sent: Collection[tuple[str, str]] | None = None,
                        foreign_cancels: Iterable[tuple[str, str]] = (),
                        own_cancels: Collection[str] = ()) -> list[str]:
    """Invariant 9 (docs/design.md §6) over the ``jobs`` table (stored id → JobIdentity).

    - every job's ``user_id`` is the user its stored id names (``alice:x`` is alice's,
      a bare id the user ``default``'s), and the one its submitter sent it as;
    - with ``sent`` (every (user, job_id) any client sent, acknowledged or not): every
      job is one that user sent, so the same job_id from two users is two jobs and
      no job was made for a user that never asked;
    - a stored cancel names the job's own user or an operator, and a killed job has one;
    - ``foreign_cancels`` ((asking user, stored id of another user's job)) never
      touched their target: unless its own user or an operator also asked
      (``own_cancels``: those stored ids), it has no cancel stored and was not killed.
    """
    problems: list[str] = []
    for stored, job in jobs.items():
        user, job_id = split_job_id(stored)
        if job.user_id != user:
            problems.append(f"{stored}: stored as {user}'s job but jobs.user_id is {job.user_id!r}")
        if job.sent_by is not None and job.sent_by != job.user_id:
            problems.append(f"{stored}: {job.sent_by} sent it but it belongs to {job.user_id}")
        if sent is not None and (job.user_id, job_id) not in sent:
            problems.append(f"{stored}: a job of {job.user_id} under id {job_id!r}, which {job.user_id} never sent")
        by = job.cancel_requested_by
        if by is not None and not _may_cancel(by, job.user_id):
            problems.append(f"{stored}: {job.user_id}'s job holds a cancel requested by {by!r}")
        if _state(job.state) == JobState.KILLED.value and by is None:
            problems.append(f"{stored}: killed with no cancel requester recorded")
    for asker, stored in foreign_cancels:
        job = jobs.get(stored)
        if job is None or stored in own_cancels:
            continue
        if job.cancel_requested or _state(job.state) == JobState.KILLED.value:
            problems.append(f"{stored}: only {asker} asked to cancel this job of {job.user_id}, yet it is "
                            f"{job.state} with cancel_requested={job.cancel_requested} "
                            f"(by {job.cancel_requested_by!r})")
    return problems


async def job_identities(conn: Queryable, sent_by_label: str | None = None) -> dict[str, JobIdentity]:
    """Every job's JobIdentity; ``sent_by_label``: the spec label naming its sender."""
    rows = await conn.fetch(
        "SELECT job_id, user_id, state, cancel_requested, cancel_requested_by, "
        "spec->'labels'->>$1::text AS sent_by FROM jobs", sent_by_label or "")
    return {r["job_id"]: JobIdentity(r["user_id"], r["state"], r["cancel_requested"], r["cancel_requested_by"],
                                     r["sent_by"] if sent_by_label else None) for r in rows}
