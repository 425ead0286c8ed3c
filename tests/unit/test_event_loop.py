"""Which event loop a service process runs on (``--event-loop``; docs/decisions.md)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from irisfed.services.common.runtime import event_loop_factory, run_service
from irisfed.services.common.startup import main
from irisfed.shared.errors import ConfigError


def test_by_default_services_run_on_uvloop():
    assert event_loop_factory() is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop


def test_asyncio_can_be_chosen_instead():
    assert event_loop_factory("asyncio") is asyncio.new_event_loop


def test_without_uvloop_auto_falls_back_and_an_explicit_choice_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what an install without it looks like to import
    assert event_loop_factory("auto") is asyncio.new_event_loop
    with pytest.raises(ConfigError, match=r"--event-loop uvloop\).*not installed"):
        event_loop_factory("uvloop")


@pytest.mark.parametrize("bad", ["", "UVLOOP", "trio", "uvloop "])
def test_an_unknown_loop_is_refused_naming_the_flag_and_the_value(bad):
    with pytest.raises(ConfigError, match=r"--event-loop.*auto, uvloop, asyncio.*got") as caught:
        event_loop_factory(bad)
    assert repr(bad) in str(caught.value)


def test_a_service_with_an_unknown_loop_stops_before_connecting_anything(capsys):
    # No servers exist for this test: the refusal must come before any connection attempt.
    code = main("router", ["--event-loop", "trio", "--database-url", "postgresql://nowhere.invalid/x",
                           "--nats-url", "nats://nowhere.invalid:4222"])
    assert code == 2
    assert "--event-loop" in capsys.readouterr().err


@pytest.mark.parametrize("factory, kind", [(uvloop.new_event_loop, uvloop.Loop),
                                           (asyncio.new_event_loop, asyncio.AbstractEventLoop)])
def test_run_service_runs_main_on_the_loop_it_is_given(factory, kind):
    seen = []

    async def service(stop: asyncio.Event) -> None:
        seen.append(asyncio.get_running_loop())

    assert run_service(service, factory) == 0
    assert isinstance(seen[0], kind)
    assert isinstance(seen[0], uvloop.Loop) == (factory is uvloop.new_event_loop)
