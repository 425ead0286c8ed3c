"""The dashboard's routes, and what every response carries.

Pages render whole, or only their live fragment when htmx asks (``HX-Request``:
the page re-fetches it on a live-update event). Every response, errors and static
files included, carries the Content-Security-Policy and its companions (the outer
``_Secured`` wrapper sees every response start, even Starlette's own 500), and a
``Server-Timing`` header with the time the app spent on it (``_Timed``). Behind a
reverse proxy (``--root-path /prefix``) requests are accepted with or without the
prefix (the proxy may strip it or not) and every link, form, static and stream URL
is built from it.

Routes: ``/`` (federation), ``/jobs``, ``/jobs/{job_id}`` (a stored id: ``alice:train-1``
for a user's job), ``POST /jobs/{job_id}/cancel``, ``/users``, ``/api/users``, ``/charts``,
``/api/charts``, ``/events`` (server-sent events), ``/login``, ``POST /logout``,
``/healthz``, ``/static/...``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from irisfed.services.common.log import EventLogger
from irisfed.services.web import present
from irisfed.services.web.dashboard import JOB_ID, Dashboard
from irisfed.services.web.filters import MAX_LABELS, STATES, FilterError, parse_filters
from irisfed.services.web.live import Refused
from irisfed.services.web.reads import job_page, job_story
from irisfed.services.web.security import (
    CSRF_FIELD,
    LOGIN_CSRF_COOKIE,
    SECURITY_HEADERS,
    SESSION_COOKIE,
    login_csrf_valid,
    new_nonce,
    safe_next,
    same_secret,
)
from irisfed.shared.arrays import counts_words
from irisfed.shared.bands import band_name
from irisfed.shared.dependencies import CONDITION_WORDS
from irisfed.shared.errors import ErrorCode, Unavailable
from irisfed.shared.fair_share import federation_totals
from irisfed.shared.messages import CANCEL_OUTCOMES
from irisfed.shared.resources import size_text
from irisfed.shared.run_contract import contract_text, grace_until, runs_text
from irisfed.shared.users import DEFAULT_USER, user_job_id

log = EventLogger("web")

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
MAX_FORM_BYTES = 8 * 1024
CANCEL_ERRORS = {
    ErrorCode.NOT_FOUND.value: "the router knows no such job",
    ErrorCode.INVALID_REQUEST.value: "the router refused the request as invalid",
    ErrorCode.FORBIDDEN.value: "the router refused it as not allowed",
    ErrorCode.UNAVAILABLE.value: "no router answered (NATS or the router is unreachable); try again",
    ErrorCode.INTERNAL.value: "the router failed to answer; try again",
}


# ---------------------------------------------------------------- every response


class _OnResponseStart:
    """Middleware that edits every HTTP response's headers as it starts: ``starting``
    is called when a request reaches the app and returns what to do to its headers.
    Anything but HTTP passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def starting(self, scope: Scope) -> Callable[[MutableHeaders], None]:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        edit = self.starting(scope)

        async def edited(message: Message) -> None:
            if message["type"] == "http.response.start":
                edit(MutableHeaders(scope=message))
            await send(message)

        await self.app(scope, receive, edited)


class _Secured(_OnResponseStart):
    """Adds the security headers to every response, and ``Cache-Control``: pages are
    never stored (they hold CSRF tokens), static files are revalidated."""

    def starting(self, scope: Scope) -> Callable[[MutableHeaders], None]:
        static = "/static/" in scope.get("path", "")

        def secured(headers: MutableHeaders) -> None:
            for name, value in SECURITY_HEADERS:
                headers[name] = value
            if "cache-control" not in headers:
                headers["cache-control"] = "no-cache" if static else "no-store"

        return secured


class _Timed(_OnResponseStart):
    """``Server-Timing: app;dur=<ms>`` on every response: from the request reaching the
    app to its response starting (for a page: its reads and its rendering), so a client
    or ``irisfed bench`` can tell the server's time from the network's."""

    def starting(self, scope: Scope) -> Callable[[MutableHeaders], None]:
        started = time.perf_counter()

        def timed(headers: MutableHeaders) -> None:
            spent_ms = (time.perf_counter() - started) * 1e3
            headers.append("server-timing", f"app;dur={spent_ms:.2f}")

        return timed


class _Rooted:
    """Serves under ``root`` whether or not the proxy in front stripped it."""

    def __init__(self, app: ASGIApp, root: str) -> None:
        self.app = app
        self.root = root

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.root and scope["type"] in ("http", "websocket"):
            path, raw = scope["path"], scope.get("raw_path") or scope["path"].encode()
            if not (path == self.root or path.startswith(self.root + "/")):
                path, raw = self.root + path, self.root.encode() + raw
            scope = {**scope, "path": path, "raw_path": raw, "root_path": self.root}
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- helpers


def _version(folder: Path) -> str:
    """A digest of the static files: their URLs change when they do."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


async def read_form(request: Request) -> dict[str, str] | None:
    """A small urlencoded form's fields (first value of each), None when it is too big or
    not text. Read by hand: Starlette's parser has no size limit for urlencoded bodies."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_FORM_BYTES):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    if not request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        return {}
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        return None
    fields: dict[str, str] = {}
    for key, value in pairs:
        fields.setdefault(key, value)
    return fields


def _client(request: Request) -> str:
    return request.client.host if request.client else "-"


# ---------------------------------------------------------------- the app


class Pages:
    """The routes, over one ``Dashboard`` (dashboard.py: the ``WebService``'s store, views, broker
    and settings)."""

    def __init__(self, web: Dashboard) -> None:
        self.web = web
        self.root = web.settings.root_path
        self.version = _version(STATIC)
        # auto_reload off: the templates are the package's own and never change while it
        # runs (on, every render stats each template file).
        self.env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
                               finalize=present.visible, trim_blocks=True, lstrip_blocks=True, auto_reload=False)
        self.env.globals.update(
            u=self.u, static=self.static, job_url=self.job_url, fmt_age=present.fmt_age,
            fmt_time=present.fmt_time, band_name=band_name, runs_text=runs_text, grace_until=grace_until,
            contract_text=contract_text, condition_words=CONDITION_WORDS, rows_html=present.JobRows(self.job_url),
            states=STATES,
            is_terminal=present.is_terminal,
            peer_ids=web.config.peer_ids, cancel_outcomes=CANCEL_OUTCOMES,
            user_ids=sorted({DEFAULT_USER, *web.config.user_ids}),
            refused_retry_ms=round(web.settings.refused_retry_s * 1000),  # app.js reads it from <body>
        )
        # A refused live stream: when to try again (app.js polls meanwhile), whole seconds.
        self.refused_retry_after = str(math.ceil(web.settings.refused_retry_s))
        self.env.filters.update(cut=present.text, command_line=present.command_line, labels=present.label_pairs,
                                size=size_text)

    # ------------------------------------------------------------ URLs

    def u(self, path: str) -> str:
        return self.root + path

    def static(self, name: str) -> str:
        return f"{self.root}/static/{name}?v={self.version}"

    def job_url(self, job_id: str) -> str:
        return f"{self.root}/jobs/{present.path_part(job_id)}"

    # ------------------------------------------------------------ rendering

    def operator(self, request: Request) -> str | None:
        """The operator's session cookie when it is valid (None: a viewer)."""
        signer = self.web.signer
        session = request.cookies.get(SESSION_COOKIE)
        if signer is None or not signer.session_valid(session, time.time()):
            return None
        return session

    def render(self, request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
        session = self.operator(request)
        context = {
            "page": values.pop("page", ""),
            "live": self.web.broker.live,
            "operator": session is not None,
            "operator_enabled": self.web.signer is not None,
            "csrf": self.web.signer.csrf_for(session) if session and self.web.signer else "",
            **values,
        }
        html = self.env.get_template(template).render(context)
        return HTMLResponse(html, status_code=status, headers={"vary": "HX-Request"})

    @staticmethod
    def fragment(request: Request) -> bool:
        return request.headers.get("hx-request") == "true"

    def problem(self, request: Request, status: int, title: str, message: str) -> HTMLResponse:
        return self.render(request, "problem.html", status, page="", title=title, message=message)

    # ------------------------------------------------------------ pages

    async def federation(self, request: Request) -> Response:
        web = self.web
        queue = await web.federation.queue.get()
        totals = await web.federation.totals.get()
        peers = present.peer_cards(web.view.peers(), web.clock.monotonic())
        template = "_federation.html" if self.fragment(request) else "federation.html"
        return self.render(request, template, page="federation", peers=peers, queue=queue, totals=totals)

    async def jobs(self, request: Request) -> Response:
        fragment = self.fragment(request)
        try:
            chosen = parse_filters(request.query_params.multi_items())
        except FilterError as exc:
            typed = {k: present.text(v, 300) for k, v in request.query_params.multi_items()}
            form = {"state": typed.get("state", ""), "peer": typed.get("peer", ""), "user": typed.get("user", ""),
                    "text": typed.get("text", ""),
                    "labels": [present.text(v, 300) for k, v in request.query_params.multi_items()
                               if k == "label"][:MAX_LABELS]}
            return self.render(request, "_jobs.html" if fragment else "jobs.html", 400, page="jobs",
                               error=str(exc), form=form, rows=[], next_url="", live_url="", filtered=True)
        page = await job_page(self.web.store, chosen, self.web.settings.page_size)
        form = {"state": chosen.state, "peer": chosen.peer, "user": chosen.user, "text": chosen.text,
                "labels": [f"{k}={v}" for k, v in chosen.labels]}
        next_url = self.u("/jobs") + chosen.query_string(page.next_after) if page.next_after else ""
        return self.render(request, "_jobs.html" if fragment else "jobs.html", page="jobs", error="", form=form,
                           rows=page.rows, next_url=next_url, first_url=self.u("/jobs") + chosen.query_string(),
                           live_url=self.u("/jobs") + chosen.query_string(chosen.after),
                           paged=chosen.after is not None, filtered=chosen.active)

    async def job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        if not JOB_ID.fullmatch(job_id):
            return self.problem(request, 404, "No such job", "That is not a job id.")
        story = await job_story(self.web.store, job_id, self.web.settings.log_tail_bytes, self.web.log_stores)
        if story is None:
            elements = (await self.web.store.job_array_elements([job_id])).get(job_id)
            if elements:  # an array's id (§3.8): its jobs, each linked
                counts = Counter(state for _, state in elements)
                return self.render(request, "array.html", page="jobs", array_id=job_id, elements=elements,
                                   counts=counts_words(counts))
            return self.problem(request, 404, "No such job", f"There is no job {job_id}.")
        outcome = request.query_params.get("cancel", "")
        failure = request.query_params.get("cancel_error", "")
        notice = (f"Cancel: {CANCEL_OUTCOMES[outcome]}." if outcome in CANCEL_OUTCOMES
                  else f"Cancel failed: {CANCEL_ERRORS[failure]}." if failure in CANCEL_ERRORS else "")
        job = story.job
        template = "_job.html" if self.fragment(request) else "job.html"
        output_urls = [self.u(present.output_path(job.job_id, o.epoch, o.task_index, o.name)) for o in story.outputs]
        return self.render(request, template, page="jobs", story=story, job=job, notice=notice, output_urls=output_urls,
                           sent_id=user_job_id(job.job_id), spec=present.spec_view(job.spec),
                           steps=present.timeline(story.history),
                           why=present.explained(story.odd_explanation if story.odd_explanation is not None
                                                 else job.explanation, story.history))

    async def cancel(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        form = await read_form(request)
        if form is None:
            return self.problem(request, 413, "Request too large", "The form was too large.")
        session = self.operator(request)
        signer = self.web.signer
        if session is None or signer is None or not signer.csrf_valid(session, form.get(CSRF_FIELD)):
            log.warning("cancel_refused", client=_client(request), logged_in=session is not None)
            return self.problem(request, 403, "Not allowed",
                                "Only a logged-in operator may cancel, from the job's own page.")
        if not JOB_ID.fullmatch(job_id):
            return self.problem(request, 404, "No such job", "That is not a job id.")
        kind, value = await self.web.cancel(job_id)
        log.info("cancel_requested", job_id=job_id, result=f"{kind}:{value}", client=_client(request))
        query = urlencode({"cancel" if kind == "outcome" else "cancel_error": value})
        return RedirectResponse(f"{self.job_url(job_id)}?{query}", status_code=303)

    async def output(self, request: Request) -> Response:
        """One stored output file of a run, as a download (never shown inline), for a
        logged-in operator: outputs are the users' data, a viewer sees names and sizes."""
        if self.operator(request) is None:
            return self.problem(request, 403, "Not allowed", "Only a logged-in operator may download outputs.")
        job_id, name = request.path_params["job_id"], request.path_params["name"]
        epoch, task = request.path_params["epoch"], request.path_params["task"]
        if not JOB_ID.fullmatch(job_id):
            return self.problem(request, 404, "No such job", "That is not a job id.")
        kind, value = await self.web.output(job_id, epoch, task, name)
        if kind == "error":
            return (self.problem(request, 404, "No such output", "That job's run stored no such file.")
                    if value == "not_found" else
                    self.problem(request, 503, "Store unavailable", "The object store did not answer; try again."))
        log.info("output_downloaded", job_id=job_id, epoch=epoch, task=task, client=_client(request))
        return Response(value, media_type="application/octet-stream", headers={
            "content-disposition": present.attachment(name), "x-content-type-options": "nosniff",
            "cache-control": "no-store"})

    async def _users(self) -> tuple[list[present.UserRow], dict[str, int]]:
        """Every user's row (its live usage against its quota, its weighted dominant share
        of what the reachable peers advertise), and those totals."""
        web = self.web
        usage = await web.federation.users.get()
        totals = federation_totals(web.view.peers(), web.clock.monotonic())
        return present.user_rows(web.config.users, usage.held, usage.counts, totals), totals

    async def users(self, request: Request) -> Response:
        rows, totals = await self._users()
        template = "_users.html" if self.fragment(request) else "users.html"
        return self.render(request, template, page="users", users=rows, totals=present.amounts(totals))

    async def users_data(self, request: Request) -> Response:
        rows, totals = await self._users()
        return JSONResponse(present.users_document(rows, totals))

    async def charts(self, request: Request) -> Response:
        return self.render(request, "charts.html", page="charts")

    async def charts_data(self, request: Request) -> Response:
        return JSONResponse(await self.web.charts.get())

    async def events(self, request: Request) -> Response:
        broker, client = self.web.broker, _client(request)
        viewer = broker.join(client)
        if viewer is None:
            # The page then refreshes itself every little while instead (app.js).
            if broker.refusal(client) is Refused.CLIENT_FULL:
                log.warning("events_refused", client=client, open=broker.viewers_per_client)
                return Response(f"too many live streams from your address (at most {broker.viewers_per_client}); "
                                "close a tab or two: this page refreshes itself meanwhile\n", 429,
                                media_type="text/plain", headers={"retry-after": self.refused_retry_after})
            return Response("too many live viewers; the page refreshes itself meanwhile\n", 503,
                            media_type="text/plain", headers={"retry-after": self.refused_retry_after})
        return StreamingResponse(self.web.broker.stream(viewer, self.web.settings.keepalive_s),
                                 media_type="text/event-stream", headers={"x-accel-buffering": "no"})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "live": self.web.broker.live, "database": self.web.db_state})

    # ------------------------------------------------------------ operators

    def _cookie_flags(self, request: Request) -> dict[str, Any]:
        return {"httponly": True, "samesite": "strict", "secure": request.url.scheme == "https",
                "path": self.root or "/"}

    def _login_page(self, request: Request, status: int = 200, error: str = "") -> Response:
        token = new_nonce()
        target = safe_next(request.query_params.get("next"), self.root)
        response = self.render(request, "login.html", status, page="login", login_csrf=token, next=target,
                               error=error)
        response.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, **self._cookie_flags(request))
        return response

    async def login_form(self, request: Request) -> Response:
        return self._login_page(request)

    async def login(self, request: Request) -> Response:
        form = await read_form(request)
        if form is None:
            return self.problem(request, 413, "Request too large", "The form was too large.")
        if not login_csrf_valid(request.cookies.get(LOGIN_CSRF_COOKIE), form.get(CSRF_FIELD)):
            return self.problem(request, 403, "Not allowed", "The login form expired; open it again.")
        token = self.web.settings.operator_token
        signer = self.web.signer
        if token is None or signer is None:
            return self._login_page(request, 404, "Operator actions are off: no operator token is configured.")
        if not self.web.login_throttle.allow(time.monotonic()):
            return self._login_page(request, 429, "Too many failed logins; wait a minute.")
        if not same_secret(form.get("token", "").strip(), token.reveal()):
            self.web.login_throttle.failed(time.monotonic())
            log.warning("login_failed", client=_client(request))
            return self._login_page(request, 403, "That is not the operator token.")
        log.info("login", client=_client(request))
        response = RedirectResponse(safe_next(form.get("next"), self.root), status_code=303)
        flags = self._cookie_flags(request)
        response.set_cookie(SESSION_COOKIE, signer.new_session(time.time()),
                            max_age=int(self.web.settings.session_ttl_s), **flags)
        response.delete_cookie(LOGIN_CSRF_COOKIE, path=flags["path"])
        return response

    async def logout(self, request: Request) -> Response:
        form = await read_form(request)
        session = self.operator(request)
        signer = self.web.signer
        if form is None or session is None or signer is None or not signer.csrf_valid(session, form.get(CSRF_FIELD)):
            return self.problem(request, 403, "Not allowed", "Log out from a page of this dashboard.")
        response = RedirectResponse(self.u("/"), status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=self.root or "/", httponly=True, samesite="strict")
        return response

    # ------------------------------------------------------------ errors

    async def not_found(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            return self.problem(request, 405, "Not allowed", "That method is not allowed here.")
        return self.problem(request, 404, "Not found", "There is no such page.")

    async def unavailable(self, request: Request, exc: Exception) -> Response:
        return self.problem(request, 503, "Database unavailable",
                            "Postgres did not answer; this page will work again when it does.")

    async def failed(self, request: Request, exc: Exception) -> Response:
        log.error("page_failed", path=request.url.path[:200], error=repr(exc)[:500])
        return HTMLResponse("<!doctype html><title>irisfed: error</title><p>Something went wrong; "
                            "the dashboard's log says what.</p>", status_code=500)


def build_app(web: Dashboard) -> ASGIApp:
    """The ASGI app of ``web``: routes, static files, and the wrappers every response passes."""
    pages = Pages(web)
    routes = [
        Route("/", pages.federation),
        Route("/jobs", pages.jobs),
        Route("/jobs/{job_id}", pages.job),
        Route("/jobs/{job_id}/cancel", pages.cancel, methods=["POST"]),
        Route("/jobs/{job_id}/outputs/{epoch:int}/{task:int}/{name:path}", pages.output),
        Route("/users", pages.users),
        Route("/api/users", pages.users_data),
        Route("/charts", pages.charts),
        Route("/api/charts", pages.charts_data),
        Route("/events", pages.events),
        Route("/login", pages.login_form, methods=["GET"]),
        Route("/login", pages.login, methods=["POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/healthz", pages.healthz),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={
        404: pages.not_found, 405: pages.not_found, Unavailable: pages.unavailable, Exception: pages.failed,
    })
    return _Rooted(_Secured(_Timed(app)), web.settings.root_path)
