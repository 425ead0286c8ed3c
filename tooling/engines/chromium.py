"""A headless Chromium for browser tests, started once per test session (docs/design.md §7).

``start_chromium(folder)`` runs the system's Chromium (Debian's ``chromium``
package; never a downloaded browser) headless, in its own process group, with its
own profile folder and a DevTools port on 127.0.0.1, and returns a ``Chromium``
once the DevTools endpoint answers. Tests drive it with Playwright for Python
through ``playwright.chromium.connect_over_cdp(chromium.endpoint)``: a connection
(and a fresh browser context) per test is cheap; the browser process is the
session's. ``Chromium.stop()`` stops its process group by id.
``chromium_available()`` says why it cannot.

Flags: ``--no-sandbox`` because tests run as root here (Chromium refuses to
sandbox as root); ``--disable-dev-shm-usage`` for small /dev/shm in containers;
no first-run, no extensions, no background networking (the machine has no
internet; the pages under test are served on 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from irisfed.tooling.engines.procs import Availability, EngineError, GroupProcess, spawn, wait_until
from irisfed.tooling.servers import free_port

INSTALL_HINT = "apt-get install -y chromium"
# Debian's package puts it here; CHROMIUM_PATH overrides.
CANDIDATES = ("chromium", "chromium-browser")
START_TIMEOUT_S = 60.0


def chromium_path() -> str | None:
    given = os.environ.get("CHROMIUM_PATH")
    if given:
        return given if os.access(given, os.X_OK) else None
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


def chromium_available() -> Availability:
    if chromium_path() is None:
        return Availability(False, f"Chromium not installed: {INSTALL_HINT}")
    try:
        import playwright  # noqa: F401 - the driver the tests use
    except ImportError:
        return Availability(False, "Playwright for Python not installed: pip install -e '.[dev]'")
    return Availability(True)


@dataclass
class Chromium:
    """A running headless Chromium and its DevTools endpoint (``http://127.0.0.1:PORT``)."""

    endpoint: str
    process: GroupProcess | None = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(signal.SIGTERM)
            self.process = None


def _version(endpoint: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{endpoint}/json/version", timeout=2) as answer:
            return json.load(answer)
    except (OSError, ValueError):
        return None


def start_chromium(folder: Path, timeout: float = START_TIMEOUT_S) -> Chromium:
    available = chromium_available()
    if not available:
        raise EngineError(available.reason)
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    process = spawn("chromium", [
        chromium_path(), "--headless=new", f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={folder / 'profile'}", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
        "--no-first-run", "--no-default-browser-check", "--disable-extensions",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--metrics-recording-only", "--mute-audio", "about:blank",
    ], folder / "chromium.log")
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _version(endpoint), "Chromium's DevTools endpoint", timeout, [process])
    except BaseException:
        process.stop(signal.SIGTERM)
        raise
    return Chromium(endpoint, process)
