"""A user's reads of its own jobs over NATS, for when it has no database URL
(docs/design.md §3.6): the same methods, rows and types as the store's reads
(``JobReads``, ``services.common.store.Store``), each asked of the router on
``P.read.store[.<user>]``, which answers for that user's jobs only, by the ids it
submitted under. The CLI's reads and the client's ``get``/``wait``/``watch`` use it
when no database URL is given.
"""

from __future__ import annotations

from typing import Any

import msgspec
import nats.errors

from irisfed.errors import InternalError, UnavailableError, error_for
from irisfed.shared.messages import StoreReadRequest, encoder
from irisfed.shared.records import (
    ChangelogEntry,
    DependencyRow,
    JobRow,
    JobSummary,
    OutputRow,
    PeerHeartbeatRow,
    TaskRow,
)
from irisfed.shared.redact import redact
from irisfed.shared.subjects import Subjects

_ANSWERS: dict[str, Any] = {
    "job_get": JobRow | None,
    "changelog_list_for_job": list[ChangelogEntry],
    "job_tasks_list": list[TaskRow],
    "job_outputs_list": list[OutputRow],
    "job_list": list[JobSummary],
    "job_live_usage_by_user": dict[str, dict[str, int]],
    "job_count_by_user": dict[str, dict[str, int]],
    "peer_heartbeat_list": list[PeerHeartbeatRow],
    "job_dependencies_of": list[DependencyRow],
    "job_dependents_of": list[DependencyRow],
    "job_array_counts": dict[str, int],
}


class RemoteReads:
    """The store's reads of ``user``'s own jobs, over NATS client ``nc``."""

    def __init__(self, nc, prefix: str, user: str, timeout: float = 10.0, own_connection: bool = False) -> None:
        self._nc, self.user, self.timeout = nc, user, timeout
        self._subject = Subjects(prefix).read_for("store", user)
        self._own = own_connection

    async def _read(self, method: str, *args: Any) -> Any:
        body = encoder.encode(StoreReadRequest(method=method, args=list(args)))
        try:
            msg = await self._nc.request(self._subject, body, timeout=self.timeout)
        except nats.errors.NoRespondersError:
            raise UnavailableError(f"no router is listening on {self._subject}") from None
        except nats.errors.TimeoutError:
            raise UnavailableError(f"no answer on {self._subject} within {self.timeout:g}s") from None
        except nats.errors.Error as exc:
            raise UnavailableError(f"NATS: {redact(exc)}") from None
        try:
            if msg.data[:1] == b"{" and b'"error"' in msg.data:  # rows never are an object: decoded once
                raw = msgspec.json.decode(msg.data)
                error = raw.get("error") if isinstance(raw, dict) and len(raw) == 1 else None
                if isinstance(error, dict) and isinstance(error.get("code"), str) and isinstance(
                        error.get("message"), str):  # an ErrorReply (not the usage of a user named "error")
                    raise error_for(error["code"], error["message"])
            return msgspec.json.decode(msg.data, type=_ANSWERS[method])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InternalError(f"unreadable answer from the router to {method}: {exc}") from None

    async def job_get(self, job_id: str) -> JobRow | None:
        return await self._read("job_get", job_id)

    async def changelog_list_for_job(self, job_id: str) -> list[ChangelogEntry]:
        return await self._read("changelog_list_for_job", job_id)

    async def job_tasks_list(self, job_id: str) -> list[TaskRow]:
        return await self._read("job_tasks_list", job_id)

    async def job_dependencies_of(self, job_id: str) -> list[DependencyRow]:
        return await self._read("job_dependencies_of", job_id)

    async def job_dependents_of(self, job_id: str) -> list[DependencyRow]:
        return await self._read("job_dependents_of", job_id)

    async def job_array_counts(self, array_id: str) -> dict[str, int]:
        return await self._read("job_array_counts", array_id)

    async def job_outputs_list(self, job_id: str, epoch: int | None = None, task: int | None = None) -> list[OutputRow]:
        return await self._read("job_outputs_list", job_id, epoch, task)

    async def job_list(self, state: str | None = None, limit: int = 100, user_id: str | None = None) -> list[JobSummary]:
        return await self._read("job_list", state, limit)  # the router lists the asker's own jobs only

    async def job_live_usage_by_user(self, *_: Any, **__: Any) -> dict[str, dict[str, int]]:
        return await self._read("job_live_usage_by_user")

    async def job_count_by_user(self) -> dict[str, dict[str, int]]:
        return await self._read("job_count_by_user")

    async def peer_heartbeat_list(self) -> list[PeerHeartbeatRow]:
        return await self._read("peer_heartbeat_list")

    async def close(self) -> None:
        if self._own:
            await self._nc.close()
