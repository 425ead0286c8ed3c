"""The dashboard as the integration tests drive it: a started WebService on the test
session's Postgres and NATS, an HTTP client for it, and what they read off its pages."""

from __future__ import annotations

import re
from contextlib import AsyncExitStack, asynccontextmanager

import httpx

from irisfed.services.common.store import Store
from irisfed.services.web.service import WebService
from irisfed.services.web.settings import Secret, WebSettings
from tests.infra.factories import make_config

TOKEN = "operator-token-for-tests-0123456789"


@asynccontextmanager
async def running_web(pool, nc, prefix: str, listen: bool = False, users: list[dict] | None = None, **settings):
    """A started dashboard (``listen``: with its real HTTP server on a free port; ``users``:
    the config's ``[[users]]`` tables)."""
    values = {"operator_token": Secret(TOKEN), "port": 0, **settings}
    config = make_config(subject_prefix=prefix, **({"users": users} if users is not None else {}))
    web = WebService(config, Store(pool), nc, WebSettings(**values))
    await web.start(listen=listen)
    try:
        yield web
    finally:
        await web.close()


def client_for(web: WebService) -> httpx.AsyncClient:
    """An HTTP client talking to ``web``'s app in process (no socket)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=web.app), base_url="http://testserver")


async def ok_page(client: httpx.AsyncClient, path: str) -> str:
    """The HTML of page ``path``, which must answer 200."""
    page = await client.get(path)
    assert page.status_code == 200, (path, page.text[:500])
    return page.text


async def page_text(pool, nc, prefix: str, path: str, **web_settings) -> str:
    """The HTML of dashboard page ``path`` (it must answer 200), from a dashboard started
    for it (``running_web``'s settings)."""
    async with running_web(pool, nc, prefix, **web_settings) as web, client_for(web) as client:
        return await ok_page(client, path)


def assert_shows(html: str, *fragments: str) -> None:
    """Each of ``fragments`` is in ``html``, as written."""
    for fragment in fragments:
        assert fragment in html, f"{fragment!r} is not on the page"


def job_ids(html: str) -> list[str]:
    """The job ids of a page's job rows, in page order."""
    return re.findall(r'data-testid="job-row" data-job-id="([^"]+)"', html)


def user_ids(html: str) -> list[str]:
    """The user ids of the Users page's rows, in page order (as the HTML has them)."""
    return re.findall(r'data-testid="user-row" data-user-id="([^"]+)"', html)


def user_row(html: str, user_id: str) -> str:
    """The HTML of one row of the Users page."""
    return html.split(f'data-testid="user-row" data-user-id="{user_id}"', 1)[1].split("</tr>", 1)[0]


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


async def log_in(client: httpx.AsyncClient, token: str = TOKEN) -> httpx.Response:
    page = await client.get("/login")
    return await client.post("/login", data={"csrf": csrf_of(page.text), "token": token, "next": "/"})


async def open_stream(stack: AsyncExitStack, http: httpx.AsyncClient, url: str, address: str) -> httpx.Response:
    """A /events stream as the browser at ``address`` (through a local proxy: X-Forwarded-For)."""
    return await stack.enter_async_context(http.stream("GET", url, headers={"x-forwarded-for": address}))
