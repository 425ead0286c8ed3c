"""How the Python client (:mod:`irisfed.client`) talks to the federation over NATS.

- Connecting (``connect_nats``): as the URL's user, with its own inbox prefix; one
  quick try first, so a wrong URL fails fast and clearly (:class:`UnavailableError`,
  the password never shown), then reconnecting forever once connected.
  ``Connecting`` is what ``Client.connect`` returns: awaited, or used with
  ``async with``.
- Asking the router (``ask_router``): one request, asked again with the *same* body
  (so the same ``job_id``) while the answer is retryable — ``unavailable``, a timeout,
  no router listening, a NATS connection between servers — with backoff and jitter,
  at most ``Retry.attempts`` tries in all. Its reply decoded (``answer_or_error``):
  the answer, or the :class:`IrisfedClientError` it carries.
- Whose reads are an operator's (``reads_as_operator``): decided by the NATS URL's user.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

import msgspec
import nats

from irisfed.errors import InternalError, IrisfedClientError, UnavailableError, error_for
from irisfed.settings import Retry
from irisfed.shared.messages import CancelReply, DryRunReply, ErrorReply, SubmitReply, decode_reply
from irisfed.shared.nats_urls import guard_headers, inbox_prefix_for_url, server_list
from irisfed.shared.redact import redact

log = logging.getLogger("irisfed.client")

# NATS errors a request is asked again after (as `unavailable`); any other fails at once.
RETRIED_NATS_ERRORS = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)


class _Closes(Protocol):
    async def close(self) -> None: ...


_C = TypeVar("_C", bound=_Closes)


class Connecting(Generic[_C]):
    """What :meth:`Client.connect` returns: ``await`` it, or ``async with`` it."""

    def __init__(self, open_client: Callable[[], Coroutine[Any, Any, _C]]) -> None:
        self._open = open_client
        self._client: _C | None = None

    def __await__(self):
        return self._open().__await__()

    def __getattr__(self, name: str):
        raise AttributeError(f"Client.connect() gives an awaitable, not a client: use `client = await "
                             f"Client.connect(...)` or `async with Client.connect(...) as client:` "
                             f"(or SyncClient.connect(...) without asyncio), then .{name}")

    async def __aenter__(self) -> _C:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.close()


async def connect_nats(url: str, name: str, reconnected: Callable[[], Awaitable[None]]):
    """A NATS connection as the URL's user (its own inbox prefix) that reconnects forever
    once connected; one quick try first, so a wrong URL fails fast and clearly."""
    last_error: list[BaseException] = []

    async def on_error(exc: Exception) -> None:  # nats-py would log a traceback per attempt
        last_error[:] = [exc]
        log.debug("irisfed client: NATS: %s", redact(exc))

    try:
        nc = await nats.connect(server_list(url), inbox_prefix=inbox_prefix_for_url(url), name=name, connect_timeout=3, max_reconnect_attempts=1,
                                  reconnect_time_wait=0.5, error_cb=on_error, reconnected_cb=reconnected)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is "unreachable" to a user
        cause = last_error[0] if last_error else exc
        raise UnavailableError(f"cannot reach NATS at {redact(url)}: {redact(cause) or type(cause).__name__}") \
            from None
    nc.options["max_reconnect_attempts"] = -1  # connected: from now on ride out any outage
    guard_headers(nc)  # a header no one can read never stops its read loop
    return nc


async def ask_router(nc, subject: str, body: bytes, *, timeout_s: float, retry: Retry,
                     on_retry: Callable[[int, IrisfedClientError, float], None] | None,
                     closed: Callable[[], bool]) -> SubmitReply | DryRunReply | CancelReply:
    """The router's answer to ``body`` on ``subject``, asked again (the same body) while
    the error is retryable, at most ``retry.attempts`` tries; ``on_retry(attempt, error,
    delay_s)`` before each retry. :class:`UnavailableError` once the client is
    ``closed()``."""
    attempt = 1
    while True:
        if closed() or nc.is_closed:
            raise UnavailableError("the client is closed")
        try:
            msg = await nc.request(subject, body, timeout=timeout_s)
            answer = answer_or_error(msg.data)
            if not isinstance(answer, IrisfedClientError):
                return answer
            error = answer
        except nats.errors.NoRespondersError:
            error = UnavailableError(f"no router is listening on {subject}")
        except nats.errors.TimeoutError:
            error = UnavailableError(f"no answer on {subject} within {timeout_s:g}s")
        except RETRIED_NATS_ERRORS as exc:
            error = UnavailableError(f"NATS: {redact(exc)}")
        except nats.errors.Error as exc:
            raise UnavailableError(f"NATS: {redact(exc)}") from None
        if not error.retryable or attempt >= retry.attempts:
            raise error
        delay = retry.delay(attempt)
        log.info("irisfed client: %s; retry %d of %d in %.2fs", error, attempt,
                 retry.attempts - 1, delay)
        if on_retry is not None:
            on_retry(attempt, error, delay)
        await asyncio.sleep(delay)
        attempt += 1


def answer_or_error(data: bytes) -> SubmitReply | DryRunReply | CancelReply | IrisfedClientError:
    """A router reply: the answer, or the error it carries (as an exception, not raised)."""
    try:
        reply = decode_reply(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return InternalError(f"unreadable reply from the router: {exc}")
    if isinstance(reply, ErrorReply):
        return error_for(reply.error.code, reply.error.message)
    return reply


def reads_as_operator(nats_url: str) -> bool:
    """Whether reads name jobs by stored id on the operators' subject: the operator's (or
    admin's) credentials, or none at all (an unsecured server tells no one apart)."""
    first = nats_url.split(",", 1)[0].strip()
    try:
        name = urlsplit(first if "://" in first else f"nats://{first}").username
    except ValueError:
        return False
    return name in (None, "", "operator", "admin")
