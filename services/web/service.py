"""``WebService``: the dashboard's process — an HTTP server, live updates from NATS,
and Postgres polling when NATS is away.

- HTTP: uvicorn serves the app (``app.py``) as a task this service owns; it listens
  on a socket bound at start (a port in use is a clear error, not a crash) and stops
  on SIGTERM with the other tasks (the runtime owns signals, not uvicorn).
- Live: ``events.*`` and ``heartbeat.*`` feed the broker (``live.py``) and the peer
  view. The service starts without NATS and connects in the background. Job events
  come fast (several per job: thousands a second under load) and a batch names at
  most ``MAX_IDS`` jobs, so the ``events.*`` subscription asks NATS for only
  ``EVENTS_PER_FLUSH`` messages: once they are in, the batch says "many jobs
  changed", NATS sends no more, and the broker renews the subscription just before
  its next flush (anything published in between falls in the batch being flushed).
  The dashboard so reads at most ~``EVENTS_PER_FLUSH / flush_s`` messages a second,
  however busy the federation is, and leaves the CPU to the services.
- Fallback: while NATS is not connected, every ``poll_s`` the changelog's new rows
  and the stored heartbeats stand in for the messages (and every ``live_poll_s``
  while it is, so a lost message still reaches the pages); pages say which.

It only reads Postgres (in production as the read-only ``irisfed_web`` role) and
sends one kind of message: an operator's cancel of any user's job, on
``<prefix>.operator.cancel`` with the job's stored id and ``"by": "web"`` (what
``irisfed cancel --operator`` sends with ``cli``; the web's NATS user may publish
nowhere else).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import uvicorn

from irisfed.services.common.bus import from_jetstream
from irisfed.services.common.log import EventLogger
from irisfed.services.common.logstore import LogStore
from irisfed.services.common.peer_view import PeerView
from irisfed.services.common.runtime import WAIT_OUT, Service
from irisfed.services.web.app import build_app
from irisfed.services.web.dashboard import JOB_ID
from irisfed.services.web.live import MAX_IDS, Broker, ChangeTail
from irisfed.services.web.reads import ChartSource, FederationReads
from irisfed.services.web.security import LoginThrottle, Signer
from irisfed.services.web.settings import WebSettings
from irisfed.shared.clock import Clock
from irisfed.shared.config import FederationConfig
from irisfed.shared.errors import ConfigError
from irisfed.shared.messages import CANCEL_OUTCOMES
from irisfed.shared.subjects import job_of_token

log = EventLogger("web")

CANCELLED_BY = "web"  # the operator's name in a cancelled job's history: `operator (web)`
EVENTS_PER_FLUSH = MAX_IDS + 1  # job events read per flush; one more than a batch names
CHANGES_PER_POLL = 2000  # changelog rows read per poll; more at once are "many jobs changed"
STOP_WAIT_S = 5.0  # for the HTTP server to finish its responses on shutdown


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the service's runtime owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening; ConfigError when that is not possible."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA cannot encode
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    sock.setblocking(False)
    return sock


class WebService(Service):
    """The dashboard. ``nc``: a connected NATS client, or None with ``connect_nats``
    (connects in the background, retrying; the service then owns the connection)."""

    def __init__(
        self,
        config: FederationConfig,
        pool: Any,
        nc: Any,
        settings: WebSettings | None = None,
        clock: Clock | Callable[[], float] | None = None,
        connect_nats: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        settings = settings or WebSettings()
        super().__init__(config, pool, nc, settings, clock)
        self._connect_nats = connect_nats
        self.view = PeerView(config, self.clock.monotonic)
        self.broker = Broker(settings.flush_s, settings.queue_batches, settings.max_viewers, live=False,
                             viewers_per_client=settings.viewers_per_client)
        token = settings.operator_token
        self.signer = Signer.for_token(token.reveal(), settings.session_ttl_s) if token else None
        self.login_throttle = LoginThrottle()
        self.federation = FederationReads(self.store, settings.snapshot_s, settings.totals_s, self.clock.monotonic)
        self.charts = ChartSource(self.store, settings.charts_s, self.clock.monotonic)
        self.app = build_app(self)
        self.db_state = "unknown"  # "ok" or "unavailable": the last poll's
        self.url = ""  # where it listens, once it does
        self._tail: ChangeTail | None = None
        self._heard: dict[str, tuple[str, int]] = {}
        self._server: _Server | None = None
        self._server_task: asyncio.Task | None = None
        self._events_spent = False  # the events subscription took its messages: renew before the next flush
        self._log_stores: dict[str, LogStore] = {}  # per peer

    # ------------------------------------------------------------ lifecycle

    @property
    def live(self) -> bool:
        """Whether NATS is connected (else pages are fed by polling Postgres)."""
        return self.nc is not None and self.nc.is_connected

    def log_store(self, peer_id: str) -> LogStore:
        """The log stream of ``peer_id`` (docs/design.md §3.6), read over this service's NATS."""
        store = self._log_stores.get(peer_id)
        if store is None or store.nc is not self.nc:
            store = self._log_stores[peer_id] = LogStore(self.nc, self.subjects.prefix, peer_id, timeout_s=2.0)
        return store

    @property
    def log_stores(self) -> Callable[[str], LogStore] | None:
        """``log_store``, or None while there is no NATS to read logs over."""
        return self.log_store if self.live else None

    async def start(self, listen: bool = True) -> None:
        """Start live updates and (with ``listen``) the HTTP server; tests drive ``self.app``
        directly with ``listen=False``."""
        if self.nc is not None:
            await self._subscribe()
        elif self._connect_nats is not None:
            self.tasks.spawn(self._connect_later(), name="web-nats-connect")
        self.broker.set_live(self.live)
        self.tasks.spawn(self.broker.run(self._renew_events), name="web-broker")
        self.tasks.spawn(self._poll_loop(), name="web-poll")
        if listen:
            self._serve()
        log.info("web_started", url=self.url or "-", live=self.live, operator=self.signer is not None,
                 prefix=self.subjects.prefix)

    async def close(self) -> None:
        self.broker.close()  # ends every event stream, so the server can finish its responses
        if self._server is not None and self._server_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._server_task), STOP_WAIT_S)
        await self.tasks.close()
        if self._connect_nats is not None and self.nc is not None:
            await self.nc.close()  # ours: connected in the background

    async def on_reconnect(self) -> None:
        """NATS is back: messages may have been missed meanwhile, so pages re-fetch."""
        self.broker.set_live(True)
        self.broker.resync()

    def _serve(self) -> None:
        settings = self.settings
        sock = listen_socket(settings.host, settings.port)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}{settings.root_path}/"
        logging.getLogger("uvicorn").setLevel(logging.WARNING)  # our own events say what matters
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", http="h11",
                                ws="none", server_header=False, timeout_graceful_shutdown=2)
        self._server = _Server(config)
        self._server_task = self.tasks.spawn(self._server.serve(sockets=[sock]), name="web-http")

    # ------------------------------------------------------------ NATS

    async def _connect_later(self) -> None:
        assert self._connect_nats is not None
        try:
            nc = await self._connect_nats()  # retries until NATS answers ...
        except (OSError, TimeoutError, nats.errors.Error):
            return  # ... or the service stops
        self.nc = nc
        await self._subscribe()
        self.broker.set_live(self.live)
        self.broker.resync()
        log.info("web_live", prefix=self.subjects.prefix)

    async def _subscribe(self) -> None:
        await self._subscribe_events()
        await self.nc.subscribe(self.subjects.heartbeat(), cb=self.on_heartbeat)
        await self.nc.flush()

    async def _subscribe_events(self) -> None:
        """Subscribe to ``events.*`` for the next ``EVENTS_PER_FLUSH`` messages (NATS
        itself stops sending after them)."""
        left = EVENTS_PER_FLUSH  # this subscription's own count: a late message of an old one counts there

        async def on_event(msg: Any) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                self._events_spent = True
                self.broker.all_jobs_changed()  # NATS sends no more until the renewal
            elif left > 0:
                self.on_event(msg)

        self._events_spent = False
        sub = await self.nc.subscribe(self.subjects.events(), cb=on_event)
        try:
            await sub.unsubscribe(limit=EVENTS_PER_FLUSH)
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise

    async def _renew_events(self) -> None:
        """Before a flush: a spent events subscription is renewed (NATS has it, the flush's
        round trip, before the batch is taken)."""
        if not self._events_spent or not self.live:
            return
        try:
            await self._subscribe_events()
            await self.nc.flush()
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            log.warning("events_resubscribe_failed", error=repr(exc)[:300])
            self._events_spent = True  # again before the next flush; the Postgres poll covers meanwhile
            self.broker.all_jobs_changed()

    def on_event(self, msg: Any) -> None:
        """``events.<job>``: that job moved (the subject says which, by its stored id as one
        token: shared.subjects.job_token; the body is not needed). One JetStream sent out
        of a stream is dropped, as every handler drops it (``from_jetstream``)."""
        if from_jetstream(msg):
            return
        job_id = job_of_token(msg.subject[len(self.subjects.events("")):])
        if JOB_ID.fullmatch(job_id):
            self.broker.job_changed(job_id)

    async def on_heartbeat(self, msg: Any) -> None:
        if from_jetstream(msg):  # not a peer's own publish
            return
        _, change = self.view.receive(msg.subject, msg.data, log)
        if change.recorded:
            self.broker.peers_changed()

    async def cancel(self, job_id: str) -> tuple[str, str]:
        """Ask the router, as an operator, to cancel the job stored as ``job_id`` (any
        user's: ``alice:train-1``): ("outcome", one of CANCEL_OUTCOMES) or ("error", an
        error code)."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            return "error", "unavailable"
        body = json.dumps({"job_id": job_id, "by": CANCELLED_BY}).encode()
        try:
            reply = await nc.request(self.subjects.operator_cancel, body, timeout=self.settings.cancel_timeout_s)
            body = json.loads(reply.data)
        except (nats.errors.Error, TimeoutError, ValueError):
            return "error", "unavailable"
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return "error", str(body["error"].get("code", "internal"))
        if isinstance(body, dict) and body.get("outcome") in CANCEL_OUTCOMES:
            return "outcome", body["outcome"]
        return "error", "internal"

    async def output(self, job_id: str, epoch: int, task: int, name: str) -> tuple[str, bytes | str]:
        """One stored output file of the job stored as ``job_id`` (docs/design.md §3.5),
        read from its user's outputs bucket with the web's own read right: ("file",
        bytes), or ("error", "not_found" | "unavailable"). Only a file the job's
        ``job_outputs`` rows list as stored is read, bounded by its recorded size."""
        from irisfed.services.common.objects import ObjectStore, ObjectStoreError

        job = await self.store.job_get(job_id)
        rows = await self.store.job_outputs_list(job_id, epoch, task) if job is not None else []
        row = next((r for r in rows if r.name == name and r.stored), None)
        if job is None or row is None:
            return "error", "not_found"
        nc = self.nc
        if nc is None or not nc.is_connected:
            return "error", "unavailable"
        store = ObjectStore(nc, self.config.subject_prefix, user=job.user_id, peer=row.peer_id,
                            timeout_s=self.settings.output_timeout_s)
        try:
            return "file", await store.get_output(job_id, epoch, task, name, max_bytes=row.size)
        except ObjectStoreError as exc:
            log.warning("output_unavailable", job_id=job_id, epoch=epoch, task=task, error=str(exc))
            return "error", "unavailable"

    # ------------------------------------------------------------ Postgres

    async def _poll_loop(self) -> None:
        """Poll Postgres every ``poll_s`` while NATS is away, every ``live_poll_s`` while it is up."""
        last = float("-inf")
        while True:
            live = self.live
            if self.broker.set_live(live):
                log.warning("web_polling" if not live else "web_live", poll_s=self.settings.poll_s)
            now = self.clock.monotonic()
            if not live or now - last >= self.settings.live_poll_s:
                last = now
                await self._poll_safely()
            await asyncio.sleep(self.settings.poll_s)

    async def _poll_safely(self) -> None:
        try:
            await self.poll_once()
        except asyncio.CancelledError:
            raise
        except WAIT_OUT as exc:
            if self.db_state != "unavailable":
                log.warning("db_unavailable", error=str(exc)[:300])
            self.db_state = "unavailable"
        except Exception as exc:  # noqa: BLE001 - the loop never dies on one error
            log.error("poll_failed", error=repr(exc)[:500])
        else:
            if self.db_state == "unavailable":
                log.info("db_available")
            self.db_state = "ok"

    async def poll_once(self) -> None:
        """One look at Postgres: stored heartbeats into the view, new changelog rows to the broker."""
        rows = await self.store.peer_heartbeat_list()
        self.view.apply_rows(rows)
        heard = {r.peer_id: (r.run_id, r.seq) for r in rows}
        if heard != self._heard:
            self._heard = heard
            self.broker.peers_changed()
        if self._tail is None:
            self._tail = ChangeTail((await self.store.changelog_get_bounds()).last_seq or 0)
            return
        changes = await self.store.changelog_list_since(self._tail.since(), CHANGES_PER_POLL)
        moved = self._tail.new((c.seq, c.job_id) for c in changes)
        if len(changes) == CHANGES_PER_POLL:
            self.broker.all_jobs_changed()
        elif moved:
            self.broker.jobs_changed(moved)
