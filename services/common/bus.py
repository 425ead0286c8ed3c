"""NATS at the edge: connect with endless reconnects, publish our structs.

Every client of ours connects through :func:`connect_nats` (services) or
:func:`connect_client` (CLI, tests, chaos, bench), which use the inbox prefix of
the URL's user (``_INBOX_<user>``: the only inbox that user may read) and never
put a password in a message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
import nats
from nats.aio.client import Client

from irisfed.services.common import metrics
from irisfed.services.common.log import EventLogger
from irisfed.shared.messages import JobEvent, encoder
from irisfed.shared.nats_urls import guard_headers, inbox_prefix_for_url, server_list
from irisfed.shared.redact import redact
from irisfed.shared.seen import scrub
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import split_job_id

log = EventLogger("bus")

# How long a service's drain at shutdown waits for the messages its handlers are still
# on (nats-py's default is 30 s); then the connection closes, cancelling them: a
# producer left without its answer retries, as it would after a crash.
DRAIN_TIMEOUT_S = 2.0
SERVER_HEADERS = "Nats-"  # what JetStream adds to every message it sends out of a stream (from_jetstream)
STATUS_HEADER = "Status"  # on the server's own answers (a direct get that found nothing)


async def connect_client(url: str, **options) -> Client:
    """One connection attempt with ``url``'s user and its inbox prefix (``options`` go to
    nats-py), whose read loop no unreadable header stops (``guard_headers``)."""
    nc = await nats.connect(server_list(url), inbox_prefix=inbox_prefix_for_url(url), **options)
    guard_headers(nc)
    return nc


async def connect_nats(
    url: str,
    name: str,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> Client:
    """Connect to NATS, retrying until it answers; reconnect forever afterwards."""

    async def disconnected() -> None:
        log.warning("nats_disconnected", client=name)

    async def reconnected() -> None:
        metrics.NATS_RECONNECTS.inc()
        log.info("nats_reconnected", client=name)
        if on_reconnect is not None:
            await on_reconnect()

    async def error(exc: Exception) -> None:
        log.debug("nats_error", client=name, error=redact(exc))

    delay = 0.2
    while True:
        try:
            return await connect_client(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                drain_timeout=DRAIN_TIMEOUT_S,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
            )
        except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
            if stop is not None and stop.is_set():
                raise
            log.warning("nats_connect_retry", client=name, error=redact(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)


async def close_quietly(nc: Client) -> None:
    """Close ``nc`` while cleaning up after another failure, which must stay the one raised.

    nats-py's ``close`` can itself fail when the server went away meanwhile (its
    transport's ``wait_closed`` then raises CancelledError, though nobody cancelled
    us); only a cancellation of this task is passed on.
    """
    try:
        await nc.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("nats_close_failed", error="CancelledError from the transport")
    except Exception as exc:  # noqa: BLE001 - the caller's own failure is the one that matters
        log.warning("nats_close_failed", error=redact(repr(exc)))


async def publish(nc: Client, subject: str, message: msgspec.Struct) -> None:
    """Publish one of our structs (fire and forget; Postgres already holds the truth)."""
    await nc.publish(subject, encoder.encode(message))


async def publish_event(nc: Client, subjects: Subjects, event: JobEvent) -> None:
    """A committed change of a job, for live watchers: on ``P.events.<stored id>`` (operators,
    the dashboard) and, as its user sees it, on ``P.uevents.<user>.<id>`` (``user_event``),
    which that user's credentials alone may hear (docs/design.md §3.6)."""
    await publish(nc, subjects.events(event.job_id), event)
    subject, copy = user_event(subjects, event)
    await publish(nc, subject, copy)


def user_event(subjects: Subjects, event: JobEvent) -> tuple[str, JobEvent]:
    """Where ``event``'s user hears it, and what it hears: its job by the id it submitted,
    other users' jobs its reason names hidden (shared.seen)."""
    user, bare = split_job_id(event.job_id)
    return subjects.user_events(user, bare), msgspec.structs.replace(event, job_id=bare,
                                                                    reason=scrub(event.reason, user))


def from_jetstream(msg) -> bool:
    """Whether ``msg`` was sent by JetStream out of a stream, not published by a client:
    delivered by a consumer (its reply an ack subject) or a direct get's answer (the
    ``Nats-Stream``, ``Nats-Sequence``... headers the server adds, or a ``Status`` one
    when it found nothing; every ``Nats-`` header counts, since a stored header the
    server appends to may swallow its first line). No publisher of ours sets one on a
    message a handler hears. Nothing of the federation's comes either way, and the
    server checks neither against the asker's rights: a consumer delivers to any
    subject its creator names, and a direct get answers on any reply subject, so a user
    could store a message in its own bucket and have it answered onto
    ``P.submit.<another user>``. Every handler drops such a message unread."""
    reply = getattr(msg, "reply", "") or ""
    headers = getattr(msg, "headers", None) or {}
    return reply.startswith("$JS.") or any(key == STATUS_HEADER or key.startswith(SERVER_HEADERS) for key in headers)

