"""Reads a user makes with only its own credentials (docs/design.md §3.6): a job's
shipped output, read from the log stream of the peer its run was on; and its jobs as
the store has them (``store_read``: what ``irisfed jobs``, ``job``, ``explain``,
``users``, ``outputs`` and ``watch`` read, so a user needs no database URL).

A user asks on ``P.read.<kind>`` (``default``) or ``P.read.<kind>.<user>``; only that
user's NATS credentials may publish there, so the router takes the user from the
subject, as for submit and cancel, and reads only that user's jobs by the ids it
submitted: another user's job is answered ``not_found`` word for word like a job
that does not exist. Operators ask on ``P.operator.read.logs`` with a stored id.
Users hold no right on the log streams themselves: what they read comes through
this check.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import msgspec
from nats.aio.client import Client

from irisfed.services.common.logstore import LogStore
from irisfed.services.common.objects import ObjectStoreError, StoreMissing
from irisfed.shared.errors import InvalidRequest, NotFound, Unavailable
from irisfed.shared.lifecycle import JobState
from irisfed.shared.logs import Piece, assemble, log_subject
from irisfed.shared.messages import (
    JOB_ID_PATTERN,
    MAX_REPLICAS,
    LogsReply,
    LogsRequest,
    StoreReadRequest,
)
from irisfed.shared.records import JobRow
from irisfed.shared.seen import scrub
from irisfed.shared.users import split_job_id, stored_job_id, user_job_id

READ_BYTES = 384 * 1024  # an answer's most log bytes (base64 in JSON stays under a 1 MiB message)
_JOB_ID = re.compile(JOB_ID_PATTERN)
SETTLED_S = 10.0  # a run ended this long ago without its end message (its agent died): nothing more comes


def _shown_epoch(row: JobRow, asked: int | None, shown: str) -> int:
    if asked is None:
        return row.epoch
    if asked > row.epoch:
        raise NotFound(f"job {shown!r} has no run {asked} (its newest is {row.epoch})")
    return asked


def scoped_job_id(user: str, job_id: object) -> str | None:
    """The stored id of ``user``'s job named ``job_id`` (the id it submitted under, or its
    own stored ``user:id``); None for anything else: another user's stored id, or a
    string no job id can be (answered as a job that does not exist)."""
    if not isinstance(job_id, str):
        return None
    owner, bare = split_job_id(job_id)
    if (bare != job_id and owner != user) or not _JOB_ID.fullmatch(bare):
        return None
    return stored_job_id(user, bare)


_TEXT_FIELDS = ("reason", "detail", "explanation")


def as_users(value: Any, user: str) -> Any:
    """Rows as ``user`` sees them: every ``job_id`` the id it submitted under, and no
    other user's job named in their texts."""
    if isinstance(value, list):
        return [as_users(item, user) for item in value]
    if isinstance(value, msgspec.Struct):
        changes = {name: scrub(getattr(value, name), user) for name in _TEXT_FIELDS if hasattr(value, name)}
        if hasattr(value, "job_id"):
            changes["job_id"] = user_job_id(value.job_id)
        if getattr(value, "array_id", None):
            changes["array_id"] = user_job_id(value.array_id)
        return msgspec.structs.replace(value, **changes) if changes else value
    return value


def _whole(value: Any, name: str, least: int, most: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidRequest(f"{name} must be a whole number from {least} to {most:,}")
    return value


class Reads:
    """Answers read requests over the router's store and NATS client."""

    def __init__(self, nc: Client, prefix: str, store, timeout_s: float = 10.0) -> None:
        self.nc, self.prefix, self.store, self.timeout_s = nc, prefix, store, timeout_s
        self._logs: dict[str, LogStore] = {}  # per peer

    def _log_store(self, peer: str) -> LogStore:
        store = self._logs.get(peer)
        if store is None:
            store = self._logs[peer] = LogStore(self.nc, self.prefix, peer, timeout_s=self.timeout_s)
        return store

    async def user_logs(self, user: str, request: LogsRequest) -> LogsReply:
        """``user``'s read of its own job, named by the id it submitted under."""
        stored = scoped_job_id(user, request.job_id)
        if stored is None:  # a stored id (``bob:train``) names another user's job
            raise NotFound(f"no job {request.job_id!r}")
        return await self.logs(stored, request.job_id, request)

    async def store_read(self, user: str, request: StoreReadRequest) -> Any:
        """``request``'s store read for ``user``: its own jobs only, ids as it named them;
        a job of anyone else reads as none (None, or no rows)."""
        args, method = list(request.args), request.method
        if method in ("job_get", "changelog_list_for_job", "job_tasks_list", "job_outputs_list", "job_dependencies_of",
                      "job_dependents_of"):
            if not args:
                raise InvalidRequest(f"{method}: a job id is needed")
            stored = scoped_job_id(user, args[0])
            if stored is None or (method != "job_get" and (await self.store.job_get(stored)) is None):
                return None if method == "job_get" else []
            if method == "job_outputs_list":
                extra = (_whole(args[1] if len(args) > 1 else None, "epoch", 1, 2**31 - 1),
                         _whole(args[2] if len(args) > 2 else None, "task", 0, MAX_REPLICAS))
                return as_users(await self.store.job_outputs_list(stored, *extra), user)
            return as_users(await getattr(self.store, method)(stored), user)
        if method == "job_array_counts":
            if not args or not isinstance(args[0], str):
                raise InvalidRequest("job_array_counts: an array id is needed")
            stored = scoped_job_id(user, args[0])  # another user's reads as no array at all
            return {} if stored is None else await self.store.job_array_counts(stored)
        if method == "job_list":
            state = args[0] if args else None
            if state is not None and state not in {s.value for s in JobState}:
                raise InvalidRequest(f"job_list: state must be one of {', '.join(s.value for s in JobState)}")
            limit = _whole(args[1] if len(args) > 1 else 100, "limit", 1, 10_000)
            return as_users(await self.store.job_list(state, limit, user_id=user), user)
        if method == "job_live_usage_by_user":
            return {u: held for u, held in (await self.store.job_live_usage_by_user([user])).items() if u == user}
        if method == "job_count_by_user":
            return {u: counts for u, counts in (await self.store.job_count_by_user()).items() if u == user}
        return await self.store.peer_heartbeat_list()  # what peers advertise is no user's

    async def logs(self, stored_id: str, shown: str, request: LogsRequest, now: datetime | None = None) -> LogsReply:
        """The next bytes of ``request``'s log of job ``stored_id`` (named ``shown`` to its asker)."""
        row = await self.store.job_get(stored_id)
        if row is None:
            raise NotFound(f"no job {shown!r}")
        if request.task >= row.replicas:
            raise InvalidRequest(f"task: job {shown} has {row.replicas} task{'s' if row.replicas != 1 else ''} "
                                 f"(0..{row.replicas - 1}); no task {request.task}")
        epoch = _shown_epoch(row, request.epoch, shown)
        peer = row.owner_peer_id if epoch == row.epoch else await self._peer_of(stored_id, epoch)
        reply = dict(job_id=shown, epoch=epoch, task=request.task, stream=request.stream, state=row.state.value,
                     exit_code=row.exit_code if epoch == row.epoch else None, peer_id=peer)
        ended_at = row.finished_at or row.updated_at
        settled = epoch < row.epoch or (row.state.is_terminal and ended_at is not None and
                                        ((now or datetime.now(UTC)) - ended_at).total_seconds() > SETTLED_S)
        if epoch < 1 or peer is None or (epoch == row.epoch and row.state.is_terminal and row.log_dir is None):
            # Never ran, or ran where nothing is written (a simulated backend): nothing was shipped.
            return LogsReply(**reply, data=b"", seq=request.seq, offset=request.offset,
                             done=row.state.is_terminal or epoch < row.epoch)
        pieces = await self._read(peer, log_subject(self.prefix, peer, stored_id, epoch, request.task,
                                                    request.stream), request)
        offset = request.offset
        if request.since_s is not None and request.seq == 0 and pieces and pieces[0].end is None:
            offset = pieces[0].offset  # from a time: what came before is not "dropped"
        data, offset, ended = assemble(pieces, offset)
        seq = pieces[-1].seq + 1 if pieces else request.seq
        return LogsReply(**reply, data=data, seq=seq, offset=offset, done=ended or (settled and not pieces))

    async def _read(self, peer: str, subject: str, request: LogsRequest) -> list[Piece]:
        since = None
        if request.seq == 0 and request.since_s is not None:
            since = datetime.now(UTC).timestamp() - request.since_s
        try:
            return await self._log_store(peer).read(subject, request.seq or 1, since=since, max_bytes=READ_BYTES)
        except StoreMissing as exc:
            raise Unavailable(f"logs: {exc}") from None
        except ObjectStoreError as exc:
            raise Unavailable(f"logs: cannot read them now ({exc}); retry") from None

    async def _peer_of(self, stored_id: str, epoch: int) -> str | None:
        """The peer run ``epoch`` of the job was given to (its history says)."""
        for row in await self.store.changelog_list_for_job(stored_id):
            if row.epoch == epoch and row.to_state in (JobState.ASSIGNED, JobState.RUNNING) and row.peer_id:
                return row.peer_id
        return None
