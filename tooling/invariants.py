"""docs/design.md §6 checks shared by every end-to-end test (and the chaos suite).

The pure checks (:func:`quota_violations`, :func:`identity_violations`,
:func:`preemption_violations`, :func:`gang_violations`, :func:`dependency_violations`,
:func:`array_violations`) take rows and return what is wrong; the async ones read them
from Postgres first.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from irisfed.services.common.store import Store
from irisfed.shared.bands import band_name, may_preempt
from irisfed.shared.lifecycle import ACTIVE_STATES, TERMINAL_STATES, JobState, can_transition
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
    resources: Mapping[str, object] | str | None = None  # each task's
    replicas: int = 1  # its tasks: it holds ``resources`` that many times, and that many slots


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
        add_units(usage, units, sign=1 if now else -1, tasks=job.replicas)
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
    """Every job's user, resources and tasks (``jobs.user_id``, ``jobs.resources``, ``jobs.replicas``)."""
    rows = await conn.fetch("SELECT job_id, user_id, resources::text AS resources, replicas FROM jobs")
    return {r["job_id"]: JobHolding(r["user_id"], r["resources"], r["replicas"]) for r in rows}


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


# ---------------------------------------------------------------- invariant 11: preemption

# What the tick's preemption writes (services/tick/service.py, shared/sql/jobs.sql
# ``job_preempt_batch`` and ``job_assign_batch``): each victim's row says
# ``preempted by <stored id>`` (then ``; ...`` when it ends failed or killed) and the
# preempting job's assignment row ``placed; preempted <id>, <id>``.
PREEMPTED_BY = "preempted by "
PLACED_PREEMPTING = "placed; preempted "
_PREEMPTION_ENDS = frozenset({JobState.QUEUED.value, JobState.FAILED.value, JobState.KILLED.value})


class HistoryRow(NamedTuple):
    """A changelog row as the preemption checks read it; ``tx``: what tells its
    transaction (``federation_changelog.at``, ``now()`` at the transaction's start; the
    same for every row one transaction wrote), or None when unknown."""

    seq: int
    job_id: str
    from_state: str | None
    to_state: str
    peer_id: str | None
    epoch: int
    actor: str
    detail: str
    tx: Any = None


@dataclass(frozen=True, slots=True)
class BandedJob:
    """A job as invariant 11 needs it: ``jobs.band`` (a rank, shared/bands.py), what it
    asked (``jobs.resources``: mapping, JSON text or None for the default), its state
    now and ``jobs.preemptions`` (None: not compared)."""

    band: int
    resources: Mapping[str, object] | str | None = None
    state: str | None = None
    preemptions: int | None = None
    replicas: int = 1  # its tasks (resources is each one's)


def preemptor_of(row: Any) -> str | None:
    """The job a tick's ``preempted by J[; ...]`` row names (None: not such a row)."""
    detail = row.detail or ""
    if row.actor != "tick" or not detail.startswith(PREEMPTED_BY):
        return None
    return detail[len(PREEMPTED_BY):].partition(";")[0].strip()


def victims_named(row: Any) -> list[str] | None:
    """The victims a ``placed; preempted a, b`` assignment row lists (None: not such a row)."""
    detail = row.detail or ""
    if row.actor != "tick" or not detail.startswith(PLACED_PREEMPTING):
        return None
    return [v.strip() for v in detail[len(PLACED_PREEMPTING):].split(",")]


def count_preemptions(changelog: Iterable[Any]) -> int:
    """How many preemptions (victims moved) the changelog records."""
    return sum(1 for row in changelog if preemptor_of(row) is not None)


def _covers(victims: Iterable[tuple[tuple[tuple[str, int], ...], int]], asks: Mapping[str, int]) -> bool:
    """Would these victims' room (a slot per task, their units per task) hold everything in ``asks``?"""
    freed: dict[str, int] = {SLOTS: 0}
    for units, tasks in victims:
        freed[SLOTS] += tasks
        for name, amount in units:
            freed[name] = freed.get(name, 0) + amount * tasks
    return all(freed.get(name, 0) >= amount for name, amount in asks.items())


def preemption_violations(changelog: Iterable[Any], jobs: Mapping[str, BandedJob],
                          advertised: Mapping[str, Collection[str]] | None = None,
                          noded: Collection[str] = ()) -> list[str]:
    """Invariant 11 (docs/design.md §6, §3.3) over the changelog (rows with ``seq``,
    ``job_id``, ``from_state``, ``to_state``, ``peer_id``, ``epoch``, ``actor``,
    ``detail`` and optionally ``tx``, any order) and the ``jobs`` table.

    For every victim row ``preempted by J`` (V, of job X):

    - only strictly lower bands, never production: ``band(X) < band(J)`` and X is not
      ``production`` (``shared.bands.may_preempt``);
    - X was live (V comes from assigned or running, as X's row before it left it) on a
      peer, its run owner (that row's peer); V bumps X's epoch by one; V ends X
      ``queued`` with no peer (``failed`` or ``killed`` only with a ``; why`` suffix);
    - the room is J's at once, on that peer: J's next row after V is the tick's
      queued → assigned ``placed; preempted ...`` naming X, on X's run owner, in V's
      transaction (same ``tx``; also J's rows are locked in it, so nothing of J can
      come between);
    - fenced: no later row of X carries an epoch below V's; after a ``queued`` V the
      next row of X starts from ``queued`` (no write of the old run lands), after a
      terminal V there is none;
    - never lost: X is still in ``jobs``, and ``jobs.preemptions`` (when given) counts
      exactly its ``preempted by`` rows.

    For every ``placed; preempted a, b`` row (R, of job J): the victims it names are
    distinct and are exactly the jobs whose ``preempted by J`` rows lead to R (one
    preemption per placement: never two for one J in a pass), all on R's peer; and
    never more than needed: no victim could be spared, i.e. the others alone never
    free a slot and everything J asks of the resources its peer's backends advertise
    (``advertised``: peer → resource names, empty for a slots-only peer; a peer not
    in it counts every resource J asks). That is the sound form of "the fewest":
    whatever J lacked there was at most a slot and J's own ask, so if the rest cover
    that, one victim was needless however busy the backend was (a gang: a slot and its
    ask per task). On a peer whose backends advertise nodes (``noded``) a job also needs a
    node per task, which victims of any size may be needed to free: there it is not
    checked. (The exact form,
    against the room free when the tick decided, cannot be replayed: the tick decides
    on a snapshot, and jobs that end between it and the commit are not in its view.)
    """
    history: dict[str, list[Any]] = defaultdict(list)
    for row in sorted(changelog, key=lambda r: r.seq):
        history[row.job_id].append(row)
    problems: list[str] = []
    # placed row (J, seq) → the victims whose preemption led to it
    led_to: dict[tuple[str, int], list[str]] = defaultdict(list)
    run_owner: dict[tuple[str, int], str | None] = {}  # victim row (X, seq) → its run's owner
    preempted: dict[str, int] = defaultdict(int)
    for victim, rows in history.items():
        for i, row in enumerate(rows):
            by = preemptor_of(row)
            if by is None:
                continue
            preempted[victim] += 1
            where = f"{victim}: seq {row.seq} ({PREEMPTED_BY}{by})"
            to_state, from_state = _state(row.to_state), _state(row.from_state) if row.from_state else None
            mine, theirs = jobs.get(victim), jobs.get(by)
            if mine is None:
                problems.append(f"{where}: the preempted job is gone from jobs")
            if theirs is None:
                problems.append(f"{where}: the preempting job {by} is not in jobs")
            if mine is not None and theirs is not None and not may_preempt(theirs.band, mine.band):
                problems.append(f"{where}: band {band_name(mine.band)} preempted by {by} of band "
                                f"{band_name(theirs.band)} (only strictly lower bands, never production)")
            if from_state not in LIVE_STATES:
                problems.append(f"{where}: preempted from {from_state}, not from assigned or running")
            before = rows[i - 1] if i else None
            owner = before.peer_id if before is not None else None
            run_owner[(victim, row.seq)] = owner
            if owner is None:
                problems.append(f"{where}: no run owner on record before it")
            if before is not None and row.epoch != before.epoch + 1:
                problems.append(f"{where}: epoch {before.epoch} → {row.epoch}, not bumped by one (the old run "
                                f"is not fenced)")
            if to_state not in _PREEMPTION_ENDS:
                problems.append(f"{where}: ends {to_state}; a preemption ends queued (failed, killed)")
            elif to_state == JobState.QUEUED.value:
                if row.peer_id is not None:
                    problems.append(f"{where}: queued again but still names peer {row.peer_id}")
                if row.detail != f"{PREEMPTED_BY}{by}":
                    problems.append(f"{where}: queued again with detail {row.detail!r}")
            elif not row.detail.startswith(f"{PREEMPTED_BY}{by}; "):
                problems.append(f"{where}: ended {to_state} without saying why ({row.detail!r})")
            # Fenced: nothing of the old run lands after it.
            later = rows[i + 1:]
            for after in later:
                if after.epoch < row.epoch:
                    problems.append(f"{victim}: seq {after.seq} ({_state(after.to_state)}, by {after.actor}) "
                                    f"carries epoch {after.epoch} after its preemption moved it to {row.epoch}")
            if later:
                nxt = later[0]
                if to_state != JobState.QUEUED.value:
                    problems.append(f"{victim}: seq {nxt.seq} after its preemption ended it {to_state}")
                elif (_state(nxt.from_state) if nxt.from_state else None) != JobState.QUEUED.value:
                    problems.append(f"{victim}: seq {nxt.seq} ({nxt.from_state} → {_state(nxt.to_state)}, by "
                                    f"{nxt.actor}) follows its preemption back to queued")
            # The room is J's, in the same transaction, on the same peer.
            placed = next((r for r in history.get(by, ()) if r.seq > row.seq), None)
            named = victims_named(placed) if placed is not None else None
            if placed is None or named is None or _state(placed.to_state) != JobState.ASSIGNED.value:
                problems.append(f"{where}: {by}'s next row is not its placement naming its victims "
                                f"({'none' if placed is None else repr(placed.detail)})")
                continue
            led_to[(by, placed.seq)].append(victim)
            if victim not in named:
                problems.append(f"{where}: {by}'s placement (seq {placed.seq}) does not name it: {placed.detail!r}")
            if owner is not None and placed.peer_id != owner:
                problems.append(f"{where}: it ran on {owner} but {by} was placed on {placed.peer_id} "
                                f"(preempting on one peer for room on another)")
            tx, placed_tx = getattr(row, "tx", None), getattr(placed, "tx", None)
            if tx is not None and placed_tx is not None and tx != placed_tx:
                problems.append(f"{where}: {by}'s placement (seq {placed.seq}) is another transaction")
    for job_id, rows in history.items():
        for row in rows:
            named = victims_named(row)
            if named is None:
                continue
            where = f"{job_id}: seq {row.seq} ({row.detail})"
            if _state(row.to_state) != JobState.ASSIGNED.value or _state(row.from_state) != JobState.QUEUED.value:
                problems.append(f"{where}: a preempting placement that is not queued → assigned")
            if len(set(named)) != len(named):
                problems.append(f"{where}: names a victim twice")
            led = led_to.get((job_id, row.seq), [])
            missing, extra = sorted(set(named) - set(led)), sorted(set(led) - set(named))
            if missing:
                problems.append(f"{where}: names {', '.join(missing)} but no preemption by {job_id} of them "
                                f"came just before")
            if extra:
                problems.append(f"{where}: {', '.join(extra)} preempted for it but not named")
            if len(led) < 2 or missing or extra or jobs.get(job_id) is None or row.peer_id in noded:
                continue
            # Never more than needed: could any victim have been spared?
            counted = None if advertised is None else advertised.get(row.peer_id)
            tasks = jobs[job_id].replicas
            asks = {SLOTS: tasks}
            for name, amount in _units(jobs[job_id].resources):
                if counted is None or name in counted:
                    asks[name] = amount * tasks
            units = {v: (_units(jobs[v].resources), jobs[v].replicas) if v in jobs else ((), 1) for v in led}
            for spared in sorted(led):
                if _covers((units[v] for v in led if v != spared), asks):
                    problems.append(f"{where}: preempted {len(led)} jobs where the others would have made room "
                                    f"without {spared} (more than needed)")
                    break
    for job_id, job in jobs.items():
        if job.preemptions is not None and job.preemptions != preempted.get(job_id, 0):
            problems.append(f"{job_id}: jobs.preemptions is {job.preemptions} but the changelog shows "
                            f"{preempted.get(job_id, 0)} preemptions")
    return problems


async def preemption_history(conn: Queryable) -> list[HistoryRow]:
    """The whole changelog with each row's transaction mark (``at``: ``now()`` when its
    transaction began), for :func:`preemption_violations`."""
    rows = await conn.fetch(
        "SELECT seq, job_id, from_state, to_state, peer_id, epoch, actor, detail, at AS tx "
        "FROM federation_changelog ORDER BY seq")
    return [HistoryRow(*r) for r in rows]


async def banded_jobs(conn: Queryable) -> dict[str, BandedJob]:
    """Every job's band, resources, state and preemptions (``jobs``)."""
    rows = await conn.fetch("SELECT job_id, band, resources::text AS resources, state, preemptions, replicas FROM jobs")
    return {r["job_id"]: BandedJob(r["band"], r["resources"], r["state"], r["preemptions"], r["replicas"])
            for r in rows}


async def advertised_resources(conn: Queryable) -> dict[str, set[str]]:
    """Peer → the resource names its latest heartbeat's backends advertise (empty: slots only)."""
    return {peer: names for peer, (names, _) in (await _advertised(conn)).items()}


async def noded_peers(conn: Queryable) -> set[str]:
    """The peers whose latest heartbeat advertises nodes on some backend."""
    return {peer for peer, (_, nodes) in (await _advertised(conn)).items() if nodes}


async def _advertised(conn: Queryable) -> dict[str, tuple[set[str], bool]]:
    rows = await conn.fetch("SELECT peer_id, backends::text AS backends FROM peer_heartbeat")
    found: dict[str, tuple[set[str], bool]] = {}
    for r in rows:
        names: set[str] = set()
        nodes = False
        try:
            backends = json.loads(r["backends"]) or []
        except ValueError:
            backends = []
        for backend in backends if isinstance(backends, list) else []:
            if not isinstance(backend, dict):
                continue
            resources = backend.get("resources")
            if isinstance(resources, dict):
                names.update(resources)
            nodes = nodes or bool(backend.get("nodes"))
        found[r["peer_id"]] = (names, nodes)
    return found


async def preemption_replay_violations(conn: Queryable, advertised: Mapping[str, Collection[str]] | None = None
                                       ) -> tuple[list[str], int]:
    """:func:`preemption_violations` over the whole changelog and ``jobs`` (``advertised``:
    None reads it from ``peer_heartbeat``), and how many preemptions it saw."""
    history = await preemption_history(conn)
    if advertised is None:
        advertised = await advertised_resources(conn)
    return (preemption_violations(history, await banded_jobs(conn), advertised, await noded_peers(conn)),
            count_preemptions(history))


# ---------------------------------------------------------------- invariant 12: gangs


@dataclass(frozen=True, slots=True)
class GangTask:
    """A ``job_tasks`` row as invariant 12 needs it."""

    job_id: str
    epoch: int
    task_index: int
    peer_id: str
    node: str | None
    state: str
    exit_code: int | None = None


_TASK_LIVE = frozenset({"pending", "running"})


def gang_violations(changelog: Iterable[Any], replicas: Mapping[str, int], tasks: Iterable[GangTask]) -> list[str]:
    """Invariant 12 (docs/design.md §6, §3.4) from the changelog (rows with ``seq``,
    ``job_id``, ``from_state``, ``to_state``, ``peer_id``, ``epoch``, ``actor``; any order),
    each job's ``replicas`` and the ``job_tasks`` rows:

    - all or none: a run (job, epoch) with task rows has exactly one per task, 0..N-1;
      a single-task job has none;
    - one peer: every task of a run on the peer that ran it (its ``running`` row's, or
      for a run its agent never accepted its ``assigned`` row's), each on a node of its own;
    - one fate: a run its agent ended (the row leaving ``running`` at that epoch is the
      peer's own) left no task pending or running; a run with a failed task did not
      end ``succeeded``; a job that succeeded has every task of its last run succeeded.
    """
    history: dict[str, list[Any]] = defaultdict(list)
    for row in sorted(changelog, key=lambda r: r.seq):
        history[row.job_id].append(row)
    runs: dict[tuple[str, int], list[GangTask]] = defaultdict(list)
    for task in tasks:
        runs[(task.job_id, task.epoch)].append(task)
    problems: list[str] = []
    for (job_id, epoch), listed in sorted(runs.items()):
        where = f"{job_id}: epoch {epoch}"
        n = replicas.get(job_id)
        if n is None:
            problems.append(f"{where}: task rows of a job that is not in jobs")
            continue
        if n == 1:
            problems.append(f"{where}: task rows for a single-task job")
            continue
        indexes = sorted(t.task_index for t in listed)
        if indexes != list(range(n)):
            problems.append(f"{where}: tasks {indexes} recorded of its {n} (all or none)")
        rows = history.get(job_id, [])
        # The run's anchor: its ``running`` row; a gang whose tasks ended before its agent
        # could accept it (Postgres away meanwhile, a task failing at once) has only the
        # ``assigned`` row naming the peer its agent started them on.
        ran = next((r for r in rows if r.epoch == epoch and _state(r.to_state) == JobState.RUNNING.value), None)
        if ran is None:
            ran = next((r for r in rows if r.epoch == epoch and _state(r.to_state) == JobState.ASSIGNED.value), None)
            if ran is None:
                problems.append(f"{where}: tasks recorded but the job was never placed at this epoch")
                continue
            # Never accepted: its agent records such a run's tasks only once they ended.
            alive = sorted(t.task_index for t in listed if t.state in _TASK_LIVE)
            if alive:
                problems.append(f"{where}: tasks {alive} recorded live though the gang never ran (never accepted)")
        peers = {t.peer_id for t in listed}
        if peers != {ran.peer_id}:
            problems.append(f"{where}: tasks on {', '.join(sorted(peers))} but the job ran on {ran.peer_id} "
                            f"(a gang runs on one peer)")
        nodes = [t.node for t in listed if t.node]
        if len(nodes) != len(set(nodes)):
            problems.append(f"{where}: two tasks on one node ({', '.join(sorted(nodes))})")
        ended = next((r for r in rows if r.seq > ran.seq), None)
        if ended is not None and ended.actor == ran.peer_id:
            alive = sorted(t.task_index for t in listed if t.state in _TASK_LIVE)
            if alive:
                problems.append(f"{where}: ended {_state(ended.to_state)} by {ended.actor} with tasks {alive} "
                                f"still {'/'.join(sorted({t.state for t in listed if t.state in _TASK_LIVE}))}")
        failed = sorted(t.task_index for t in listed if t.state == "failed")
        if failed and ended is not None and _state(ended.to_state) == JobState.SUCCEEDED.value:
            problems.append(f"{where}: succeeded though tasks {failed} failed (one fate)")
    for job_id, rows in history.items():
        if replicas.get(job_id, 1) < 2 or not rows or _state(rows[-1].to_state) != JobState.SUCCEEDED.value:
            continue
        last = runs.get((job_id, rows[-1].epoch))
        if last and any(t.state != "succeeded" for t in last):
            states = ", ".join(f"{t.task_index}:{t.state}" for t in sorted(last, key=lambda t: t.task_index))
            problems.append(f"{job_id}: succeeded but its last run's tasks say {states}")
    return problems


async def gang_replay_violations(conn: Queryable) -> tuple[list[str], int]:
    """:func:`gang_violations` over the whole changelog, ``jobs`` and ``job_tasks``, and
    how many gang runs (job, epoch) recorded tasks."""
    history = await preemption_history(conn)
    replicas = {r["job_id"]: r["replicas"] for r in await conn.fetch("SELECT job_id, replicas FROM jobs")}
    tasks = [GangTask(*r) for r in await conn.fetch(
        "SELECT job_id, epoch, task_index, peer_id, node, state, exit_code FROM job_tasks")]
    return gang_violations(history, replicas, tasks), len({(t.job_id, t.epoch) for t in tasks})


# ---------------------------------------------------------------- invariant 16: dependencies

# Who ends a waiting job whose dependency can no longer be met: the router at submit
# (services/router/dependencies.py) and Postgres when the dependency ends (trigger
# irisfed_dependencies_settle, migration 0019) both write their row as this actor.
DEPENDENCY_ACTOR = "dependency"
_TERMINAL = frozenset(state.value for state in TERMINAL_STATES)


class DependencyEdge(NamedTuple):
    """A ``job_dependencies`` row: ``job_id`` waits for ``needs`` (``ok``, ``any``, ``failed``)."""

    job_id: str
    needs: str
    condition: str


@dataclass(frozen=True, slots=True)
class WaitingJob:
    """A job as invariant 16's last clause needs it: ``jobs.state`` and ``jobs.deps_pending``
    (None: not compared)."""

    state: str
    deps_pending: int | None = None


def condition_met(condition: str, state: str) -> bool:
    """Does a dependency that ended ``state`` meet ``condition`` (docs/design.md §3.8)?
    ``ok``: it succeeded; ``failed``: it ended any other way; ``any``: it ended."""
    return condition == "any" or (condition == "ok") == (state == JobState.SUCCEEDED.value)


def dependency_violations(changelog: Iterable[Any], edges: Iterable[Any],
                          jobs: Mapping[str, WaitingJob]) -> list[str]:
    """Invariant 16 (docs/design.md §6, §3.8) from the changelog (rows with ``seq``,
    ``job_id``, ``to_state``, ``actor``; any order: sorted here by ``seq``), the
    ``job_dependencies`` edges (``job_id``, ``needs``, ``condition``) and each job's state
    (and ``deps_pending``) as the run ended:

    - no early start: a dependent's first row into a live state (assigned, running)
      follows, in ``seq`` order, each dependency's first terminal row, and that end met
      the edge's condition;
    - a dependency that ended breaking its condition ends its dependent
      ``unschedulable``, unless the dependent had ended before; and a job ends
      ``unschedulable`` by actor ``dependency`` only after one of its dependencies
      ended breaking its condition;
    - never waits forever: no job is still ``queued`` once every dependency has ended
      (each met, or it would have ended), and a queued job's ``deps_pending`` counts
      exactly its dependencies not ended (more would strand it).

    (``seq`` order is the order these happened in: a dependency's end, its changelog
    row and the settling of its dependents are one statement; a start is claimed only
    once that has committed.)
    """
    history: dict[str, list[Any]] = defaultdict(list)
    for row in sorted(changelog, key=lambda r: r.seq):
        history[row.job_id].append(row)

    def first(job_id: str, states: Collection[str]) -> Any | None:
        return next((r for r in history.get(job_id, ()) if _state(r.to_state) in states), None)

    needs: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for edge in edges:
        needs[edge.job_id].append((edge.needs, edge.condition))
    problems: list[str] = []
    for job_id, deps in sorted(needs.items()):
        live = first(job_id, LIVE_STATES)
        end = first(job_id, _TERMINAL)
        ended = {needed: first(needed, _TERMINAL) for needed, _ in deps}
        broke_first: Any | None = None  # the earliest end of a dependency breaking its condition
        for needed, condition in sorted(deps):
            done = ended[needed]
            how = f"{needed} ({condition})"
            if needed not in jobs and needed not in history:
                problems.append(f"{job_id}: waits for {how}, a job that does not exist")
            if live is not None:
                if done is None or done.seq > live.seq:
                    problems.append(f"{job_id}: {_state(live.to_state)} at seq {live.seq} before its dependency "
                                    f"{how} ended ({'never' if done is None else f'at seq {done.seq}'})")
                elif not condition_met(condition, _state(done.to_state)):
                    problems.append(f"{job_id}: {_state(live.to_state)} at seq {live.seq} though its dependency "
                                    f"{how} ended {_state(done.to_state)} at seq {done.seq}")
            if done is None or condition_met(condition, _state(done.to_state)):
                continue
            if broke_first is None or done.seq < broke_first.seq:
                broke_first = done
            if end is not None and end.seq < done.seq:
                continue  # it had ended (cancelled, say) before its dependency did
            if end is None or _state(end.to_state) != JobState.UNSCHEDULABLE.value:
                now = "still " + jobs[job_id].state if end is None and job_id in jobs else \
                    "never ended" if end is None else f"ended {_state(end.to_state)} at seq {end.seq}"
                problems.append(f"{job_id}: its dependency {how} ended {_state(done.to_state)} at seq {done.seq} "
                                f"(never to be met) but it {now}, not unschedulable")
        if end is not None and _state(end.to_state) == JobState.UNSCHEDULABLE.value \
                and end.actor == DEPENDENCY_ACTOR and (broke_first is None or broke_first.seq > end.seq):
            problems.append(f"{job_id}: ended unschedulable for a dependency at seq {end.seq} ({end.detail!r}) "
                            f"but none of its dependencies had ended breaking its condition")
        job = jobs.get(job_id)
        if job is None or _state(job.state) != JobState.QUEUED.value:
            continue
        open_deps = [needed for needed, _ in deps
                     if (_state(jobs[needed].state) not in _TERMINAL if needed in jobs else ended[needed] is None)]
        if not open_deps and broke_first is None:  # (a broken one is reported above)
            states = ", ".join(f"{needed} {jobs[needed].state if needed in jobs else _state(ended[needed].to_state)}"
                               for needed, _ in sorted(deps))
            problems.append(f"{job_id}: still queued though every dependency ended ({states}): it waits forever")
        if job.deps_pending is not None and job.deps_pending != len(open_deps):
            problems.append(f"{job_id}: queued with deps_pending {job.deps_pending} but {len(open_deps)} of its "
                            f"dependencies have not ended ({', '.join(sorted(open_deps)) or 'none'})")
    return problems


async def dependency_edges(conn: Queryable) -> list[DependencyEdge]:
    """Every ``job_dependencies`` row."""
    return [DependencyEdge(*r) for r in await conn.fetch("SELECT job_id, needs, condition FROM job_dependencies")]


async def waiting_jobs(conn: Queryable) -> dict[str, WaitingJob]:
    """Every job's state and ``deps_pending``, less the one a held array element counts
    for its slot (migration 0020: its dependencies are the rest)."""
    return {r["job_id"]: WaitingJob(r["state"], r["deps_pending"])
            for r in await conn.fetch("SELECT job_id, state, deps_pending - (array_held AND state = 'queued')::int "
                                      "AS deps_pending FROM jobs")}


@dataclass(frozen=True, slots=True)
class DependencyCounts:
    """What a run's dependencies did: edges, and how the dependents ended."""

    edges: int = 0
    dependents: int = 0  # jobs with at least one edge
    started: int = 0  # dependents that went live (every dependency met first)
    unschedulable: int = 0  # dependents ended for a dependency that could no longer be met


def dependency_counts(changelog: Collection[Any], edges: Collection[Any]) -> DependencyCounts:
    """How many edges and dependents ``edges`` holds, and how many of those the changelog
    shows started, or ended ``unschedulable`` for a dependency."""
    dependents = {edge.job_id for edge in edges}
    started = {r.job_id for r in changelog if r.job_id in dependents and _state(r.to_state) in LIVE_STATES}
    ended = {r.job_id for r in changelog if r.job_id in dependents and r.actor == DEPENDENCY_ACTOR
             and _state(r.to_state) == JobState.UNSCHEDULABLE.value}
    return DependencyCounts(len(edges), len(dependents), len(started), len(ended))


async def dependency_replay_violations(conn: Queryable) -> tuple[list[str], DependencyCounts]:
    """:func:`dependency_violations` over the whole changelog, ``job_dependencies`` and
    ``jobs``, and what the dependencies did (:class:`DependencyCounts`)."""
    history = await preemption_history(conn)
    edges = await dependency_edges(conn)
    return dependency_violations(history, edges, await waiting_jobs(conn)), dependency_counts(history, edges)


# ---------------------------------------------------------------- arrays: at most K live

class JobArray(NamedTuple):
    """A ``job_arrays`` row: its stored base id, size and limit (``parallel``; None: none)."""

    array_id: str
    size: int
    parallel: int | None

    @property
    def limit(self) -> int:
        """The most elements that may be live at once: ``parallel``, else all of them."""
        return self.parallel if self.parallel is not None else self.size


class ArrayElement(NamedTuple):
    """An element's ``jobs`` row as the array checks need it, as the run ended."""

    job_id: str
    array_id: str
    array_index: int
    state: str
    array_held: bool


@dataclass(frozen=True, slots=True)
class ArrayPeak:
    """The most elements of one array live at once, its limit, and the first row that
    took it past the limit (None: it never went past) with the elements live then."""

    most: int
    limit: int
    over: Any | None = None
    live_then: tuple[str, ...] = ()


def array_peaks(changelog: Iterable[Any], arrays: Iterable[JobArray],
                elements: Iterable[ArrayElement]) -> dict[str, ArrayPeak]:
    """Replay the changelog in ``seq`` order counting each array's live elements: an
    element is live from its first row into ``assigned`` or ``running`` to its first
    terminal row (a preempted or retried element queued meanwhile keeps its slot, as
    only an end frees one: trigger ``irisfed_array_release``, migration 0020). Every
    array of ``arrays`` gets its peak, elements of arrays not among them none."""
    limits = {a.array_id: a.limit for a in arrays}
    array_of = {e.job_id: e.array_id for e in elements if e.array_id in limits}
    live: dict[str, set[str]] = defaultdict(set)
    ended: set[str] = set()
    most: dict[str, int] = dict.fromkeys(limits, 0)
    over: dict[str, tuple[Any, tuple[str, ...]]] = {}
    for row in sorted(changelog, key=lambda r: r.seq):
        array_id = array_of.get(row.job_id)
        if array_id is None or row.job_id in ended:
            continue
        state = _state(row.to_state)
        if state in _TERMINAL:
            ended.add(row.job_id)
            live[array_id].discard(row.job_id)
        elif state in LIVE_STATES and row.job_id not in live[array_id]:
            live[array_id].add(row.job_id)
            most[array_id] = max(most[array_id], len(live[array_id]))
            if len(live[array_id]) > limits[array_id] and array_id not in over:
                over[array_id] = (row, tuple(sorted(live[array_id])))
    return {array_id: ArrayPeak(most[array_id], limit, *over.get(array_id, (None, ())))
            for array_id, limit in limits.items()}


def array_violations(changelog: Iterable[Any], arrays: Iterable[JobArray],
                     elements: Iterable[ArrayElement]) -> list[str]:
    """Arrays (docs/design.md §3.8) from the changelog (rows with ``seq``, ``job_id``,
    ``to_state``; any order: sorted here by ``seq``), the ``job_arrays`` rows and each
    element's row as the run ended:

    - whole: an array's elements are exactly ``<array_id>_0`` .. ``<array_id>_<size-1>``,
      and no element names an array ``job_arrays`` does not hold;
    - at most K live: replaying the changelog, never more of an array's elements live
      (first ``assigned``/``running`` row seen, terminal row not yet) than its
      ``parallel`` (:func:`array_peaks`);
    - none stranded: no element is still ``queued`` and held (``array_held``) while
      fewer than ``parallel`` of its array's elements hold a slot (released, that is
      not held, and not ended): a slot is free, and nothing would ever release it.
    """
    arrays = list(arrays)
    elements = list(elements)
    known = {a.array_id for a in arrays}
    of_array: dict[str, list[ArrayElement]] = defaultdict(list)
    for element in elements:
        of_array[element.array_id].append(element)
    problems: list[str] = []
    for array_id in sorted(set(of_array) - known):
        ids = ", ".join(sorted(e.job_id for e in of_array[array_id]))
        problems.append(f"{array_id}: its elements ({ids}) name an array job_arrays does not hold")
    peaks = array_peaks(changelog, arrays, elements)
    for array in sorted(arrays, key=lambda a: a.array_id):
        mine = sorted(of_array.get(array.array_id, ()), key=lambda e: (e.array_index, e.job_id))
        indexes = [e.array_index for e in mine]
        wrong = []
        if len(mine) != array.size:
            wrong.append(f"{len(mine)} elements")
        missing = sorted(set(range(array.size)) - set(indexes))
        if missing:
            wrong.append(f"no element at index {', '.join(map(str, missing))}")
        twice = sorted({i for i in indexes if indexes.count(i) > 1 or not 0 <= i < array.size})
        if twice:
            wrong.append(f"index {', '.join(map(str, twice))} twice or out of range")
        misnamed = [f"{e.job_id} (index {e.array_index})" for e in mine
                    if e.job_id != f"{array.array_id}_{e.array_index}"]
        if misnamed:
            wrong.append(f"misnamed {', '.join(misnamed)}")
        if wrong:
            problems.append(f"{array.array_id}: an array of size {array.size} with {'; '.join(wrong)}")
        peak = peaks[array.array_id]
        if peak.over is not None:
            problems.append(f"{array.array_id}: {peak.limit + 1} elements live at seq {peak.over.seq} "
                            f"({', '.join(peak.live_then)}; {peak.over.job_id} → {_state(peak.over.to_state)}), "
                            f"over its limit of {peak.limit} (most at once: {peak.most})")
        held = [e.job_id for e in mine if e.array_held and _state(e.state) == JobState.QUEUED.value]
        slots = [e.job_id for e in mine if not e.array_held and _state(e.state) not in _TERMINAL]
        if held and len(slots) < array.limit:
            problems.append(f"{array.array_id}: {', '.join(held)} still held, waiting for a slot, though only "
                            f"{len(slots)} of its {array.limit} slots are taken"
                            f"{' (' + ', '.join(slots) + ')' if slots else ''}: stranded")
    return problems


@dataclass(frozen=True, slots=True)
class ArrayCounts:
    """What a run's arrays did: how many, their elements, and each one's peak as
    (most live at once, limit), in ``array_id`` order."""

    arrays: int = 0
    elements: int = 0
    peaks: tuple[tuple[int, int], ...] = ()


async def job_arrays(conn: Queryable) -> list[JobArray]:
    """Every ``job_arrays`` row."""
    return [JobArray(*r) for r in await conn.fetch("SELECT array_id, size, parallel FROM job_arrays")]


async def array_elements(conn: Queryable) -> list[ArrayElement]:
    """Every job that is an array's element, as it is now."""
    return [ArrayElement(*r) for r in await conn.fetch(
        "SELECT job_id, array_id, array_index, state, array_held FROM jobs WHERE array_id IS NOT NULL")]


async def array_replay_violations(conn: Queryable) -> tuple[list[str], ArrayCounts]:
    """:func:`array_violations` over the whole changelog, ``job_arrays`` and the elements'
    rows, and what the arrays did (:class:`ArrayCounts`)."""
    history = await preemption_history(conn)
    arrays, elements = await job_arrays(conn), await array_elements(conn)
    peaks = array_peaks(history, arrays, elements)
    counts = ArrayCounts(len(arrays), len(elements),
                         tuple((peaks[a].most, peaks[a].limit) for a in sorted(peaks)))
    return array_violations(history, arrays, elements), counts
