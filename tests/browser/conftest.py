"""The dashboard in a real browser: the session's headless Chromium (``chromium``,
tests/engines/fixtures.py) driven by Playwright over CDP, against a real federation
(router, tick, agents and ``irisfed web`` as subprocesses: the e2e ``federation``).

- ``page``: a fresh browser context and page per test. Every console error and
  uncaught page error is collected and fails the test at teardown (a CSP violation
  is a console error); ``watch.expect_status(path, status)`` declares a response
  the test provokes on purpose, whose "Failed to load resource" line is then not an
  error. A screenshot of the page as it ended is saved per test in
  ``tests/browser/artifacts/`` (gitignored).
- ``dashboard``: router, tick, agents ``home`` (cpu/memory) and ``gpu-west`` (with
  GPUs) advertising ``--resource`` shapes, and the dashboard on a free port with an
  operator token file; ``dashboard.url(path)``, ``dashboard.token``, ``dashboard.fed``.
  The federation's config has the ``[[users]]`` of ``federation_users`` (TOML; none
  unless a test module overrides that fixture).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import Page, async_playwright, expect

from irisfed.tooling.servers import free_port
from tests.e2e.conftest import Federation, federation  # noqa: F401 - the e2e fixture, for these tests too
from tests.infra.waiting import wait_for

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TOKEN = "browser-tests-operator-token-0123456789"
SHAPES = {
    "home": ["cpu=4", "memory_mb=8192"],
    "gpu-west": ["cpu=16", "memory_mb=65536", "gpu=2"],
}
# The dashboard's --refused-retry here (seconds).
REFUSED_RETRY_S = 2
# Waiting assertions retry up to this long: it bounds a hang on a slow shared machine.
expect.set_options(timeout=15_000)


def resource_flags(peer_id: str) -> list[str]:
    return [arg for shape in SHAPES.get(peer_id, []) for arg in ("--resource", shape)]


@dataclass
class Dashboard:
    base: str
    token: str
    fed: Federation

    def url(self, path: str = "/") -> str:
        return self.base + path


@pytest.fixture
def federation_users() -> str:
    """``[[users]]`` tables (TOML) for the federation's config, written before anything
    starts; a test module overrides this fixture to have users."""
    return ""


@pytest.fixture
async def dashboard(federation: Federation, tmp_path: Path, federation_users: str) -> Dashboard:  # noqa: F811
    if federation_users:
        federation.config_path.write_text(federation.config_path.read_text() + "\n" + federation_users)
    token_file = tmp_path / "web-operator-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    federation.start("router")
    federation.start("tick")
    for peer_id in SHAPES:
        federation.start(peer_id, *resource_flags(peer_id))
    # A page refused a live stream asks again after 2 s, not the default 30: the test of
    # that waits for the next try.
    federation.start("web", "--port", str(port), "--operator-token-file", str(token_file),
                     "--refused-retry", str(REFUSED_RETRY_S))
    base = f"http://127.0.0.1:{port}"

    async def healthy():
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                answer = await client.get(base + "/healthz")
        except httpx.HTTPError:
            return None
        return answer.status_code == 200 and answer.json().get("live") is True

    await federation.wait_router()
    for peer_id in SHAPES:
        await federation.wait_agent(peer_id)
    await wait_for(healthy, "the dashboard to answer, live over NATS")
    return Dashboard(base, TOKEN, federation)


@dataclass
class _Watch:
    """Errors the browser reported, and the error responses the test provokes on purpose."""

    problems: list[str] = field(default_factory=list)
    expected: list[tuple[str, int]] = field(default_factory=list)  # (path, status)

    def expect_status(self, path: str, status: int) -> None:
        """The test provokes ``status`` from ``path`` on purpose (Chromium logs a console
        error, "Failed to load resource", for every 4xx/5xx response, documents included)."""
        self.expected.append((path, status))

    def console_error(self, text: str, url: str) -> None:
        found = (re.fullmatch(r"Failed to load resource: the server responded with a status of (\d{3}).*", text)
                 or re.fullmatch(r"EventSource's response has a status (\d{3}) that is not 200\..*", text))
        if found and (urlsplit(url).path, int(found.group(1))) in self.expected:
            return
        self.problems.append(f"console error: {text} ({url})")


def _artifact_name(node: pytest.Item) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{Path(node.path).stem}__{node.name}")[:150] + ".png"


@pytest.fixture
def watch() -> _Watch:
    """What the browser reported during the test (``page`` fails the test on it)."""
    return _Watch()


@pytest.fixture
async def page(chromium, watch: _Watch, request: pytest.FixtureRequest) -> Page:
    """A page in a fresh context; fails the test on any console or page error."""
    async with async_playwright() as pw:
        browser = await pw.chromium.connect_over_cdp(chromium.endpoint)
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(15_000)

        context.on("console", lambda msg: watch.console_error(msg.text, msg.location.get("url", ""))
                   if msg.type == "error" else None)
        context.on("weberror", lambda e: watch.problems.append(f"page error: {e.error}"))
        tab = await context.new_page()
        try:
            yield tab
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            try:
                await tab.screenshot(path=str(ARTIFACTS / _artifact_name(request.node)), full_page=True)
            except Exception as exc:  # noqa: BLE001 - a screenshot is a convenience, never the verdict
                print(f"no screenshot: {exc!r}")
            await context.close()
    if watch.problems:
        pytest.fail("the browser reported errors:\n" + "\n".join(watch.problems), pytrace=False)


def update_screenshots() -> bool:
    return os.environ.get("IRISFED_UPDATE_SCREENSHOT") == "1"
