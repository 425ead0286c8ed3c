"""The unit layer starts no process and opens no network socket.

``pytest -m unit`` is the layer that runs anywhere, at once, with the network away
(``unshare -n``): every unit test is guarded so that starting a process or creating
an IPv4/IPv6 socket fails it with a message saying where such a test belongs. AF_UNIX
sockets stay allowed (asyncio's event loop wakes itself through a socketpair).

The guard is a Python audit hook (it sees ``subprocess``, ``os.fork``/``posix_spawn``/
``exec``/``system`` and every ``socket.socket``, however it is reached) plus wrappers
where no audit event is raised: asyncio's subprocess helpers (uvloop spawns through
libuv) and ``_posixsubprocess.fork_exec`` (multiprocessing's spawn and forkserver
start their children through it). It is on while a unit module is imported and from
the start of a test's setup to the end of its teardown, so a session fixture that
starts servers (``servers``) fails the unit test that asks for it. A refusal the code
under test swallows (``except Exception``) still fails the test when it ends.
What it cannot see: a process or socket made in C without Python (ctypes calls into
libc, libuv's own sockets under uvloop); running the layer under ``unshare -n``
(README, Test layers) is what covers those.

Libraries that probe the host when first imported are imported here, before any test
runs, so no test fails for being the first to import them: urllib3 opens (and closes)
an IPv6 socket to learn whether the host has IPv6.
"""

from __future__ import annotations

import _posixsubprocess
import asyncio
import asyncio.subprocess
import contextlib
import importlib
import socket
import sys
from pathlib import Path

import pytest

for _probing in ("urllib3.util.connection",):
    with contextlib.suppress(ImportError):
        importlib.import_module(_probing)

NETWORK_FAMILIES = {int(socket.AF_INET), int(socket.AF_INET6)}
PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
                  "os.system", "pty.spawn"}
WHERE = "a test that needs it belongs in tests/integration (or tests/e2e when it runs services)"


class UnitLayerViolation(RuntimeError):
    """A unit test started a process or created a network socket."""


class _Guard:
    def __init__(self) -> None:
        self.active = False
        self.violations: list[str] = []

    def refuse(self, what: str) -> None:
        message = f"unit tests start no process and open no network socket: {what}; {WHERE}"
        self.violations.append(message)
        raise UnitLayerViolation(message)

    def audit(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "socket.__new__":
            family = args[1]  # -1 wraps a descriptor made elsewhere (socket(fileno=...)): nothing new opens
            if family in NETWORK_FAMILIES:
                self.refuse(f"socket({socket.AddressFamily(family).name})")
        elif event in PROCESS_EVENTS:
            self.refuse(f"{event}{_shown(args)}")


def _shown(args: tuple) -> str:
    text = repr(args[:2])
    return text if len(text) <= 200 else text[:200] + "...)"


GUARD = _Guard()
sys.addaudithook(GUARD.audit)  # audit hooks cannot be removed: it acts only while GUARD.active


def _refusing(name: str):
    async def refused(*args, **kwargs):
        GUARD.refuse(f"asyncio.{name}{_shown(args)}")

    return refused


FAILED_BEFORE = pytest.StashKey[bool]()
_fork_exec = _posixsubprocess.fork_exec


def _guarded_fork_exec(*args, **kwargs):
    if GUARD.active:
        GUARD.refuse(f"_posixsubprocess.fork_exec{_shown(args)}")
    return _fork_exec(*args, **kwargs)


_posixsubprocess.fork_exec = _guarded_fork_exec


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Importing a unit module runs under the guard too (a socket opened at import)."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    GUARD.active = True
    try:
        report = yield
    finally:
        GUARD.active = False
    if GUARD.violations and report.passed:
        report.outcome, report.longrepr = "failed", "\n".join(dict.fromkeys(GUARD.violations))
    GUARD.violations.clear()
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """On before any fixture of the test is set up, session ones included."""
    GUARD.violations.clear()
    GUARD.active = True


UNIT_DIR = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """Off before teardown when the next test is not a unit test (or there is none):
    then fixtures of wider scope end too (the session's servers and engines), and
    stopping them is not this test's doing."""
    if nextitem is None or UNIT_DIR not in Path(nextitem.path).parents:
        GUARD.active = False


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    GUARD.active = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and report.when in ("setup", "call"):
        item.stash[FAILED_BEFORE] = True  # it says why already: the guard adds no second error
    return report


@pytest.fixture(autouse=True)
def no_process_or_network(request, monkeypatch):
    """Every unit test's own code runs with asyncio's subprocess helpers refused too;
    what the guard refused and the code swallowed fails the test when it ends."""
    for name in ("create_subprocess_exec", "create_subprocess_shell"):
        monkeypatch.setattr(asyncio, name, _refusing(name))
        monkeypatch.setattr(asyncio.subprocess, name, _refusing(name))
    yield
    if GUARD.violations and not request.node.stash.get(FAILED_BEFORE, False):
        pytest.fail("\n".join(dict.fromkeys(GUARD.violations)), pytrace=False)
