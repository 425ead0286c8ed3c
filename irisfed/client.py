"""irisfed's Python client: submit, cancel, get, wait for and watch jobs.

Most of the module is the documentation a producer reads; the async client and its
sync wrapper sit side by side so that they cannot drift apart. Their plumbing is
elsewhere: NATS (connecting, asking the router with retries, its replies) in
:mod:`irisfed.connection`, a watch's changelog reads in :mod:`irisfed.watching`, the
sync wrapper's event loop thread in :mod:`irisfed.loop_thread`.

Async, for services and ``asyncio`` code::

    import asyncio
    from irisfed.client import Client

    async def main() -> None:
        async with Client.connect() as client:
            reply = await client.submit(["python3", "train.py"], constraints=["device_type=gpu"],
                                        resources={"gpu": 4, "memory_mb": 65536})
            print(reply.job_id, reply.disposition, reply.state)  # a SubmitReply (shared.messages)
            if reply.disposition != "reject":
                final = await client.wait(reply.job_id)         # a JobEvent: state, exit_code, reason
                print(final.state, final.exit_code)

    asyncio.run(main())

Sync, for scripts and notebooks (its own event loop in a background thread, so it
works where a loop already runs, as in Jupyter)::

    from irisfed.client import SyncClient

    with SyncClient.connect() as client:
        reply = client.submit(["echo", "hello"])
        for event in client.watch(reply.job_id):
            print(event.state, event.peer_id)

**Where the servers come from** (like the ``irisfed`` command line): the arguments,
else ``IRISFED_NATS_URL`` / ``IRISFED_DATABASE_URL``, else ``.irisfed/connect.json``
that a running ``irisfed up`` writes (``state_dir=`` for another folder). The subject
prefix: ``prefix=``, else the federation's config file (``IRISFED_CONFIG``, else the
one ``connect.json`` names), else ``irisfed``. ``eval "$(irisfed env)"`` exports the
``producer`` user's NATS URL; ``eval "$(irisfed env --role operator)"`` adds the
database's.

**What needs what.** ``submit`` and ``cancel`` are NATS requests: any NATS user that
may publish ``<prefix>.submit`` / ``<prefix>.cancel`` (the ``producer`` role). ``get``,
``wait``, ``watch``, ``tasks`` and ``outputs`` read the durable truth in Postgres:
directly with a database URL (an operator's), else through the router over NATS
(``<prefix>.read.store[.<user>]``, :mod:`irisfed.remote_reads`), which answers for the
user's own jobs only, by the ids it submitted. ``logs`` always reads through the
router (``<prefix>.read.logs[.<user>]``). ``watch`` also listens to the job's events on
``<prefix>.events.<job_id>`` when its NATS user may (``operator`` may, users may not)
and uses them only as a cue to read again; it reads anyway every ``poll_interval``
seconds and after every NATS reconnect, so a lost event delays it and never misleads it.

**Bands and dry runs.** ``submit(..., band="batch")`` (``batch``, ``interactive`` — the
default — or ``production``; at most the user's ``max_band``, else
:class:`ForbiddenError`) and ``max_preemptions=`` (how often a higher band may stop it
before it fails; default 100). ``submit(..., dry_run=True)`` writes nothing and
returns a :class:`~shared.messages.DryRunReply`: what the submit would answer now, plus
where the job would run now (``placement``: peer, backend and the jobs it would
preempt) or why it would wait (``waiting``)::

    plan = await client.submit(["python3", "train.py"], resources={"gpu": 8}, band="production",
                               dry_run=True)
    if plan.placement:
        print(plan.placement.peer_id, plan.placement.backend, plan.placement.preempts)
    else:
        print(plan.disposition, plan.waiting or plan.reason)

**Errors.** A reject is an answer, not an error: ``submit`` returns the
:class:`~shared.messages.SubmitReply` with ``disposition == "reject"``, its ``reason``
and one verdict per peer. An error reply raises :class:`IrisfedClientError` (a
subclass per documented code: :class:`InvalidRequestError`, :class:`ConflictError`,
:class:`UnknownPeerError`, :class:`NotFoundError`, :class:`ForbiddenError`,
:class:`UnavailableError`, :class:`InternalError`, :class:`ConfigurationError`), with ``.code`` (a
:class:`~shared.errors.ErrorCode`) and ``.message``. A request that is invalid is
refused here, before it is sent, with the router's own checks and the same code; so is
a job id no job can have (``get``, ``wait``, ``watch``, ``cancel``:
:class:`InvalidRequestError`, quoting at most its first characters). Settings no retry
can fix raise :class:`ConfigurationError` (not retryable): a database URL that cannot
be parsed, a login Postgres refuses (the user and host named, never the password), no
such database; its subclass :class:`SchemaMismatchError` says the database is not at
this irisfed's schema (run ``irisfed migrate``).

**Retries.** ``unavailable`` answers, timeouts and "no router is listening" are retried
with the *same* request (so the same ``job_id``: submits are idempotent; a job_id is
made here when you give none), with exponential backoff and jitter, at most
``Retry.attempts`` tries in all; then :class:`UnavailableError` is raised. After a
retry, ``duplicate`` may be true: an earlier try had committed the job before its
answer was lost. Either way exactly one job exists.

A :class:`Client` belongs to the event loop it was connected on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats

from irisfed.connection import Connecting, ask_router, connect_nats, reads_as_operator
from irisfed.errors import (
    ConfigurationError,
    ConflictError,
    ForbiddenError,
    InternalError,
    InvalidRequestError,
    IrisfedClientError,
    NotFoundError,
    SchemaMismatchError,
    UnavailableError,
    UnknownPeerError,
    error_for,
    translated,
)
from irisfed.jobs import (
    ConstraintLike,
    Job,
    Task,
    build_submit,
    checked_submit,
    job_view,
    new_job_id,
    task_views,
)
from irisfed.logs import lines, read_logs
from irisfed.loop_thread import LoopThread, awaited
from irisfed.reads import JobReads, checked_job_id, checked_stored_job_id
from irisfed.remote_reads import RemoteReads
from irisfed.settings import DEFAULT_STATE_DIR, Retry, Servers, resolve_servers
from irisfed.shared.config import DEFAULT_MAX_WORKSPACE_MB
from irisfed.shared.errors import IrisfedError
from irisfed.shared.messages import (
    CancelReply,
    CancelRequest,
    DryRunReply,
    JobEvent,
    LogsReply,
    LogsRequest,
    OperatorCancelRequest,
    SubmitReply,
    SubmitRequest,
    encoder,
)
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import split_job_id, stored_job_id
from irisfed.transfer import Output, download_outputs, output_views, store_workspace
from irisfed.watching import changelog_events

__all__ = [
    "Client",
    "ConfigurationError",
    "ConflictError",
    "DryRunReply",
    "ForbiddenError",
    "InternalError",
    "InvalidRequestError",
    "IrisfedClientError",
    "Job",
    "NotFoundError",
    "Retry",
    "SchemaMismatchError",
    "Servers",
    "SyncClient",
    "Task",
    "UnavailableError",
    "UnknownPeerError",
    "error_for",
    "new_job_id",
    "resolve_servers",
]

log = logging.getLogger("irisfed.client")
_T = TypeVar("_T")


# ---------------------------------------------------------------- the async client

class Client:
    """An async irisfed client (see the module's documentation). Make one with :meth:`connect`."""

    def __init__(self, nc, servers: Servers, *, timeout: float = 5.0, retry: Retry | None = None,
                 poll_interval: float = 1.0,
                 on_retry: Callable[[int, IrisfedClientError, float], None] | None = None,
                 wakers: set[asyncio.Event] | None = None) -> None:
        self._nc = nc
        self.servers = servers
        self.subjects = Subjects(servers.prefix)
        self.user = servers.user
        self.timeout = timeout
        self.retry = retry or Retry()
        self.poll_interval = poll_interval
        self.on_retry = on_retry
        self._store = None
        self._store_lock = asyncio.Lock()
        # One event per running watch: set on a NATS event for its job and on every reconnect.
        self._wakers: set[asyncio.Event] = set() if wakers is None else wakers
        self._closed = False

    @classmethod
    def connect(cls, nats_url: str | None = None, database_url: str | None = None, *,
                prefix: str | None = None, timeout: float = 5.0, retry: Retry | None = None,
                poll_interval: float = 1.0, state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
                name: str = "irisfed-client", user: str | None = None,
                on_retry: Callable[[int, IrisfedClientError, float], None] | None = None) -> Connecting[Client]:
        """Connect to the federation: ``client = await Client.connect()`` or
        ``async with Client.connect() as client: ...`` (closed at the end).

        - ``nats_url``, ``database_url``, ``prefix``, ``state_dir``: where, as
          :func:`resolve_servers` says (the database only for ``get``/``wait``/``watch``;
          Postgres is connected on first use).
        - ``timeout``: seconds one request waits for its answer (the router answers within
          about 4 s even when Postgres hangs, so keep it above that).
        - ``retry``: :class:`Retry` (``Retry(attempts=1)`` never retries).
        - ``poll_interval``: how often ``watch``/``wait`` re-read Postgres without an event.
        - ``on_retry(attempt, error, delay_s)``: called before each retry (e.g. to log it).
        - ``user``: the configured user to act as (else ``IRISFED_USER``, else the NATS
          URL's ``user-<id>``, else ``default``). Its submits and cancels go to its own
          subjects, which only its NATS credentials may publish; ``get``/``wait``/``watch``
          read its jobs by the ids it submitted under.

        Raises :class:`ConfigurationError` without a NATS URL and
        :class:`UnavailableError` when NATS cannot be reached.
        """
        servers = resolve_servers(nats_url, database_url, prefix=prefix, state_dir=state_dir, user=user)

        async def open_client() -> Client:
            wakers: set[asyncio.Event] = set()

            async def reconnected() -> None:
                # Events published while we were away are gone: every watch re-reads Postgres.
                log.info("irisfed client: NATS reconnected; watches re-read Postgres")
                for wake in list(wakers):
                    wake.set()

            nc = await connect_nats(servers.nats_url, name, reconnected)
            return cls(nc, servers, timeout=timeout, retry=retry, poll_interval=poll_interval,
                       on_retry=on_retry, wakers=wakers)

        return Connecting(open_client)

    # ------------------------------------------------------------ requests

    async def submit(self, command: Sequence[str], *, job_id: str | None = None, name: str = "",
                     env: Mapping[str, str] | None = None, constraints: Sequence[ConstraintLike] = (),
                     resources: Mapping[str, float] | None = None,
                     preferences: Sequence[ConstraintLike] = (), cluster_pin: str = "", priority: int = 0,
                     max_retries: int | None = None, deadline_s: float | None = None,
                     labels: Mapping[str, str] | None = None, band: str | None = None,
                     max_preemptions: int | None = None, dry_run: bool = False, replicas: int | None = None,
                     group_by: str = "", workspace: str | os.PathLike[str] | None = None,
                     time_limit_s: float | None = None, grace_s: float | None = None,
                     max_failure_retries: int | None = None, after: Sequence[Any] = (),
                     array: int | None = None, array_parallel: int | None = None,
                     max_workspace_mb: int = DEFAULT_MAX_WORKSPACE_MB) -> SubmitReply | DryRunReply:
        """Submit a job; return the router's :class:`~shared.messages.SubmitReply` (sent
        after the job is committed in Postgres) — or, with ``dry_run=True``, its
        :class:`~shared.messages.DryRunReply` (nothing is written).

        ``command`` is the program and its arguments. ``constraints`` and ``preferences``
        take wire dicts, ``Constraint`` objects or shorthands (``"device_type=gpu"``,
        ``"memory_gb>=80"``, ``"zone=in:a,b"``, ``"exists:spot"``); ``resources`` maps
        ``cpu`` / ``memory_mb`` / ``gpu`` / other names to amounts. Everything else is as
        in the wire contract (README, "Submit request"). Without ``job_id`` one is made
        here (:func:`new_job_id`), so retries are safe.

        ``band``: ``batch``, ``interactive`` or ``production`` (None: the contract's
        default, ``interactive``); one above the user's ``max_band`` raises
        :class:`ForbiddenError`. ``max_preemptions``: how many times a job of a higher
        band may preempt it before the next preemption fails it (None: 100).
        ``dry_run``: answer what this submit would do now — its disposition, state,
        reason and verdicts, and where it would be placed (``placement``: peer, backend
        and the stored ids of the jobs it would preempt) or why it would wait
        (``waiting``) — writing nothing. A dry run is checked exactly like a submit
        (the same errors) and is safe to retry; an id that already names a job answers
        as its resubmission would (``duplicate``, or :class:`ConflictError`).
        ``replicas``: a gang of that many tasks of ``command``, each asking ``resources``,
        started together on distinct nodes of one backend or not at all; ``group_by``: a
        node attribute its nodes all share one value of (docs/design.md §3.4).
        ``workspace``: a folder packed and stored in the federation's object store (not
        sent again when already there); every run starts in a fresh copy of it. One that
        cannot travel (a link leaving it, an unreadable file, over ``max_workspace_mb``)
        raises :class:`InvalidRequestError` naming the file, before anything is stored.
        ``time_limit_s``: the run is stopped after that much running time and the job fails
        (not retried); ``grace_s``: SIGTERM to SIGKILL when a run is stopped (None: 30 s);
        ``max_failure_retries``: runs again after a non-zero exit, up to that many times.
        ``after``: your jobs this one waits for: ids (each must succeed), ``(id, when)``
        pairs or ``{"job_id", "when"}`` dicts (``ok``, ``any``, ``failed``); a job named
        that is not yours or does not exist raises :class:`InvalidRequestError`; an array's
        id stands for each of its jobs.
        ``array``: that many jobs ``<job_id>_<i>`` (1-10,000) from this one submit, each run
        told ``IRISFED_ARRAY_INDEX`` and ``IRISFED_ARRAY_SIZE``; ``array_parallel``: at most
        that many of them live at once. The reply names the array (``job_id``); cancel,
        ``after`` and ``irisfed jobs`` take that id for all of them.

        A reject returns normally (``reply.disposition == "reject"``; ``reply.reason``,
        ``reply.verdicts``). Errors raise :class:`IrisfedClientError` subclasses::

            try:
                reply = await client.submit(["echo", "hi"], job_id="nightly-2024-05-01")
            except ConflictError:
                ...  # that id already names a different job
        """
        request = build_submit(command, job_id=job_id, name=name, env=env, constraints=constraints,
                               resources=resources, preferences=preferences, cluster_pin=cluster_pin,
                               priority=priority, max_retries=max_retries, deadline_s=deadline_s,
                               labels=labels, band=band, max_preemptions=max_preemptions, dry_run=dry_run,
                               replicas=replicas, group_by=group_by, time_limit_s=time_limit_s,
                               grace_s=grace_s, max_failure_retries=max_failure_retries, after=after,
                               array=array, array_parallel=array_parallel)
        if workspace is not None:
            stored, _ = await store_workspace(self._nc, self.servers.prefix, workspace, max_workspace_mb,
                                              self.user)
            request = msgspec.structs.replace(request, workspace=stored)
        return await self.submit_request(request)

    async def submit_request(self, request: SubmitRequest) -> SubmitReply | DryRunReply:
        """Submit a ready-made :class:`~shared.messages.SubmitRequest` (a job_id is added
        when it has none): its :class:`~shared.messages.SubmitReply`, or for a request
        with ``dry_run`` its :class:`~shared.messages.DryRunReply`."""
        if request.job_id is None:
            request = msgspec.structs.replace(request, job_id=new_job_id())
        request = checked_submit(request)
        reply = await self._request(self.subjects.submit_for(self.user), encoder.encode(request))
        expected = DryRunReply if request.dry_run else SubmitReply
        if not isinstance(reply, expected):
            if request.dry_run and isinstance(reply, SubmitReply):
                # Routers from before dry runs refuse the field; should one commit it, say so loudly.
                raise InternalError(f"the router SUBMITTED job {reply.job_id!r} instead of a dry run "
                                    f"({reply.disposition} → {reply.state}); cancel it if unwanted")
            raise InternalError(f"the router answered a submit with {type(reply).__name__}")
        return reply

    async def cancel(self, job_id: str) -> CancelReply:
        """Request cancellation; return the :class:`~shared.messages.CancelReply` (``outcome``:
        never_started, not_restarted, kill_sent, pending_owner_offline, already_requested,
        already_finished). Raises :class:`NotFoundError` for an unknown job. Safe to
        repeat (and so retried like submits)."""
        body = encoder.encode(CancelRequest(job_id=_checked_job_id(job_id)))
        reply = await self._request(self.subjects.cancel_for(self.user), body)
        if not isinstance(reply, CancelReply):
            raise InternalError(f"the router answered a cancel with {type(reply).__name__}")
        return reply

    async def operator_cancel(self, job_id: str, by: str | None = None) -> CancelReply:
        """An operator's cancel of any user's job, named by its stored id (``alice:train-1``;
        a ``default`` job's id is bare). Needs the operator's NATS credentials (the
        operators' subject refuses anyone else). ``by`` names the operator in the job's
        history (``operator (by)``)."""
        try:
            request = OperatorCancelRequest(job_id=checked_stored_job_id(job_id), by=by)
        except IrisfedError as exc:
            raise InvalidRequestError(exc.message) from None
        reply = await self._request(self.subjects.operator_cancel, encoder.encode(request))
        if not isinstance(reply, CancelReply):
            raise InternalError(f"the router answered a cancel with {type(reply).__name__}")
        return reply

    async def log_replies(self, job_id: str, *, stderr: bool = False, task: int = 0, epoch: int | None = None,
                          follow: bool = False, since_s: float | None = None) -> AsyncIterator[LogsReply]:
        """The router's answers for ``job_id``'s output (:func:`irisfed.logs.read_logs`):
        each a :class:`~shared.messages.LogsReply` whose ``data`` are the next bytes.
        A user's job is named by the id it submitted; with the operator's credentials
        (or none: an unsecured server), by its stored id (``alice:train-1``)."""
        operator = reads_as_operator(self.servers.nats_url)
        try:
            request = LogsRequest(job_id=checked_stored_job_id(job_id) if operator else _checked_job_id(job_id),
                                  stream="stderr" if stderr else "stdout", task=task, epoch=epoch,
                                  since_s=since_s)
        except (IrisfedError, msgspec.ValidationError) as exc:
            raise InvalidRequestError(getattr(exc, "message", str(exc))) from None
        subject = self.subjects.operator_read("logs") if operator else self.subjects.read_for("logs", self.user)

        async def ask(next_request: LogsRequest) -> LogsReply:
            reply = await self._request(subject, encoder.encode(next_request))
            if not isinstance(reply, LogsReply):
                raise InternalError(f"the router answered a log read with {type(reply).__name__}")
            return reply
        async for reply in read_logs(ask, request, follow):
            yield reply

    async def logs(self, job_id: str, **options: Any) -> AsyncIterator[str]:
        """``job_id``'s output line by line (stdout; ``stderr=True``, ``task=``,
        ``epoch=``, ``since_s=``), read from where it was shipped, wherever the job ran:
        what was shipped so far, or with ``follow=True`` every line as the job writes
        it until the job ends. Needs no database URL."""
        async for line in lines(self.log_replies(job_id, **options)):
            yield line

    async def _request(self, subject: str, body: bytes) -> SubmitReply | DryRunReply | CancelReply:
        return await ask_router(self._nc, subject, body, timeout_s=self.timeout, retry=self.retry,
                                on_retry=self.on_retry, closed=lambda: self._closed)

    # ------------------------------------------------------------ reads (Postgres)

    async def _get_store(self):
        if self._store is not None:
            return self._store
        if not self.servers.database_url:
            # No database URL: the user's own jobs, read through the router (irisfed.remote_reads).
            self._store = RemoteReads(self._nc, self.servers.prefix, self.user, timeout=self.timeout)
            return self._store
        async with self._store_lock:
            if self._store is None:
                self._store = await _translated(JobReads.connect(self.servers.database_url))
        return self._store

    async def get(self, job_id: str) -> Job:
        """The job as Postgres has it now (a :class:`Job`); :class:`NotFoundError` if none
        (or another user's). Without a database URL, read through the router."""
        job_id = _checked_job_id(job_id)
        store = await self._get_store()
        row = await _translated(store.job_get(stored_job_id(self.user, job_id)))
        if row is None:
            raise NotFoundError(f"no job {job_id!r}")
        return job_view(row)

    async def tasks(self, job_id: str) -> list[Task]:
        """A gang's tasks in its newest run (a :class:`Task` each: node, state, exit code,
        log folder); [] for a single-task job or a gang not started yet."""
        job_id = _checked_job_id(job_id)
        store = await self._get_store()
        rows = await _translated(store.job_tasks_list(stored_job_id(self.user, job_id)))
        return task_views(rows)

    async def outputs(self, job_id: str, *, epoch: int | None = None, task: int | None = None,
                      to: str | os.PathLike[str] | None = None) -> list[Output]:
        """The output files of ``job_id``'s newest run that left any (or of ``epoch``; of
        ``task`` only), each an :class:`Output`; with ``to``, the stored ones are also
        written under that folder (a gang's under ``task-<i>/``)."""
        job_id = _checked_job_id(job_id)
        store = await self._get_store()
        stored_id = stored_job_id(self.user, job_id)
        try:
            row = await store.job_get(stored_id)
            if row is None:
                raise NotFoundError(f"no job {job_id!r}")
            found = output_views(await store.job_outputs_list(stored_id, epoch, task))
        except IrisfedError as exc:
            raise translated(exc) from None
        if to is not None:
            await download_outputs(self._nc, self.servers.prefix, stored_id, found, Path(to), row.replicas > 1)
        return found

    async def watch(self, job_id: str, *, history: bool = True) -> AsyncIterator[JobEvent]:
        """Every state change of ``job_id``, in order, each once, ending with its terminal one.

        ``async for event in client.watch(job_id): print(event.state, event.peer_id)``

        The events come from the job's changelog in Postgres (the durable record of every
        hand-off; without a database URL, read through the router), read again whenever
        an event of the job arrives on its user's own event subject (``P.uevents.<user>.<id>``),
        after every NATS reconnect, and every ``poll_interval`` seconds: events missed
        while NATS was away are never missed here. ``history=True`` starts from the job's first state;
        ``False`` from its current one. Ends after the terminal event (succeeded, failed,
        killed, rejected, unschedulable). Once it has started, a transient Postgres failure
        is waited out.
        Raises :class:`NotFoundError` for an unknown job (or another user's).
        """
        job_id = _checked_job_id(job_id)
        stored = stored_job_id(self.user, job_id)
        store = await self._get_store()
        wake = asyncio.Event()

        async def on_event(msg) -> None:
            wake.set()

        subscription = None
        try:
            # Its user's copy of its events: what that user's own credentials may hear (§3.6).
            subscription = await self._nc.subscribe(self.subjects.user_events(*split_job_id(stored)), cb=on_event)
        except nats.errors.Error as exc:  # events are a shortcut; Postgres is the truth
            log.debug("irisfed client: no events for %s (%s); polling Postgres", job_id, exc)
        self._wakers.add(wake)
        try:
            async with contextlib.aclosing(changelog_events(store, stored, job_id, history=history, wake=wake,
                                                            poll_interval=self.poll_interval)) as events:
                async for event in events:
                    yield event
        finally:
            self._wakers.discard(wake)
            if subscription is not None:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    async def wait(self, job_id: str, timeout: float | None = None) -> JobEvent:  # noqa: ASYNC109 - as documented
        """Wait until the job ends; return its terminal :class:`~shared.messages.JobEvent`
        (``state``, ``exit_code``, ``reason``, ``peer_id``). Raises ``TimeoutError`` after
        ``timeout`` seconds (None: no limit)."""
        final: JobEvent | None = None
        try:
            async with asyncio.timeout(timeout):
                async with contextlib.aclosing(self.watch(job_id, history=False)) as events:
                    async for event in events:
                        final = event
        except TimeoutError:
            where = f" (still {final.state})" if final is not None else ""
            raise TimeoutError(f"job {job_id} did not end within {timeout:g}s{where}") from None
        assert final is not None  # watch ends only after a terminal event
        return final

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        """Close the NATS connection and the Postgres pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await self._nc.close()
        if self._store is not None:
            with contextlib.suppress(Exception):
                await self._store.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _checked_job_id(job_id: str) -> str:
    """``job_id`` if a job can have it, else :class:`InvalidRequestError` (no I/O)."""
    try:
        return checked_job_id(job_id)
    except IrisfedError as exc:
        raise InvalidRequestError(exc.message) from None


async def _translated(pending: Awaitable[_T]) -> _T:
    """What ``pending`` returns, a store's :class:`IrisfedError` raised as the client's
    error for it (``irisfed.errors.translated``)."""
    try:
        return await pending
    except IrisfedError as exc:
        raise translated(exc) from None


# ---------------------------------------------------------------- the sync wrapper


class SyncClient:
    """The same client without ``await``, for scripts and notebooks::

        from irisfed.client import SyncClient

        client = SyncClient.connect()          # same arguments as Client.connect
        reply = client.submit(["python3", "-c", "print(42)"], resources={"gpu": 1})
        print(client.wait(reply.job_id, timeout=600).state)
        client.close()                         # or: with SyncClient.connect() as client: ...

    It runs a :class:`Client` on an event loop of its own in a background thread, so it
    works the same in a plain script and where a loop is already running (Jupyter,
    IPython). Several threads may call it at once: their calls share that loop. Ctrl-C
    during a call cancels it.
    """

    def __init__(self, client: Client, runner: LoopThread) -> None:
        self._client = client
        self._runner = runner

    @classmethod
    def connect(cls, nats_url: str | None = None, database_url: str | None = None, **options: Any) -> SyncClient:
        """Connect (``options`` as :meth:`Client.connect`)."""
        runner = LoopThread()
        try:
            connecting = Client.connect(nats_url, database_url, **options)
            client = runner.run(awaited(connecting))
        except BaseException:
            runner.stop()
            raise
        return cls(client, runner)

    @property
    def client(self) -> Client:
        """The async client underneath (its methods must run on this wrapper's loop)."""
        return self._client

    @property
    def servers(self) -> Servers:
        return self._client.servers

    def submit(self, command: Sequence[str], **fields: Any) -> SubmitReply | DryRunReply:
        """:meth:`Client.submit` (``band=``, ``max_preemptions=``, ``dry_run=`` included)."""
        return self._runner.run(self._client.submit(command, **fields))

    def submit_request(self, request: SubmitRequest) -> SubmitReply | DryRunReply:
        """:meth:`Client.submit_request`."""
        return self._runner.run(self._client.submit_request(request))

    def cancel(self, job_id: str) -> CancelReply:
        """:meth:`Client.cancel`."""
        return self._runner.run(self._client.cancel(job_id))

    def operator_cancel(self, job_id: str, by: str | None = None) -> CancelReply:
        return self._runner.run(self._client.operator_cancel(job_id, by))

    def get(self, job_id: str) -> Job:
        """:meth:`Client.get`."""
        return self._runner.run(self._client.get(job_id))

    def outputs(self, job_id: str, **options: Any) -> list[Output]:
        """:meth:`Client.outputs`."""
        return self._runner.run(self._client.outputs(job_id, **options))

    def tasks(self, job_id: str) -> list[Task]:
        """:meth:`Client.tasks`."""
        return self._runner.run(self._client.tasks(job_id))

    def wait(self, job_id: str, timeout: float | None = None) -> JobEvent:
        """:meth:`Client.wait`."""
        return self._runner.run(self._client.wait(job_id, timeout))

    def watch(self, job_id: str, *, history: bool = True) -> Iterator[JobEvent]:
        """:meth:`Client.watch`, as a plain iterator."""
        return self._iterate(self._client.watch(job_id, history=history))

    def logs(self, job_id: str, **options: Any) -> Iterator[str]:
        """:meth:`Client.logs`, as a plain iterator of lines."""
        return self._iterate(self._client.logs(job_id, **options))

    def _iterate(self, items: AsyncIterator[_T]) -> Iterator[_T]:
        try:
            while True:
                try:
                    yield self._runner.run(items.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            with contextlib.suppress(Exception):
                self._runner.run(items.aclose())

    def close(self) -> None:
        """Close the client and stop its thread (idempotent)."""
        if not self._runner.loop.is_closed():
            with contextlib.suppress(Exception):
                self._runner.run(self._client.close())
            self._runner.stop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

