"""What the dashboard's routes (app.py) use of the process that serves them (service.py).

``Dashboard`` names it: the federation's config and the web's settings, the store and
the caches every viewer shares (``reads``), the live broker and the peer view, the
operator's session signer and login throttle, the last Postgres poll's state, and the
two things an operator may do (``cancel``, ``output``). ``WebService`` is the one
implementation; app.py depends on this, never on service.py, so the service may build
its app without an import circle. ``JOB_ID``: a stored job id, as both check it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from irisfed.shared.users import STORED_JOB_ID_PATTERN

if TYPE_CHECKING:
    from irisfed.services.common.logstore import LogStore
    from irisfed.services.common.peer_view import PeerView
    from irisfed.services.common.store import Store
    from irisfed.services.web.live import Broker
    from irisfed.services.web.reads import ChartSource, FederationReads
    from irisfed.services.web.security import LoginThrottle, Signer
    from irisfed.services.web.settings import WebSettings
    from irisfed.shared.clock import Clock
    from irisfed.shared.config import FederationConfig

JOB_ID = re.compile(STORED_JOB_ID_PATTERN)


class Dashboard(Protocol):
    """The dashboard's process as its routes see it (``WebService``)."""

    config: FederationConfig
    settings: WebSettings
    clock: Clock
    store: Store
    federation: FederationReads  # the federation page's and users' reads, cached
    charts: ChartSource
    broker: Broker  # live updates: who watches, what changed
    view: PeerView
    signer: Signer | None  # None: no operator token, operator actions off
    login_throttle: LoginThrottle
    db_state: str  # "unknown", "ok" or "unavailable": the last poll's

    @property
    def log_stores(self) -> Callable[[str], LogStore] | None:
        """A peer's log stream, or None while there is no NATS to read logs over."""
        ...

    async def cancel(self, job_id: str) -> tuple[str, str]:
        """An operator's cancel of the job stored as ``job_id``: ("outcome", ...) or ("error", code)."""
        ...

    async def output(self, job_id: str, epoch: int, task: int, name: str) -> tuple[str, bytes | str]:
        """One stored output file: ("file", bytes) or ("error", "not_found" | "unavailable")."""
        ...
