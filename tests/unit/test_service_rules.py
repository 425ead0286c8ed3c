"""Rules the services share or start with, with no server: settings checked when built,
the one retry rule for infrastructure failures, what a cancel does, the injected clock."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from irisfed.services.common.startup import ProcessSettings, service_parser
from irisfed.services.peer_agent.settings import AgentSettings, BackendSpec
from irisfed.services.router import flags as router_flags
from irisfed.services.router.service import ROUTER_SPARE_CONNECTIONS, Router, RouterSettings
from irisfed.services.tick.plan import recover_from_lost_peer
from irisfed.services.tick.service import Tick, TickSettings
from irisfed.shared.clock import SYSTEM_CLOCK, ManualClock, as_clock
from irisfed.shared.errors import ConfigError
from irisfed.shared.fencing import epoch_after
from irisfed.shared.lifecycle import JobState
from irisfed.shared.retry import after_infra_failure
from tests.infra.factories import make_config

# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(("build", "named"), [
    (lambda: RouterSettings(writers=0), "writers (--writers)"),
    (lambda: RouterSettings(max_queue=-1), "max_queue (--max-queue)"),
    (lambda: RouterSettings(max_batch=0), "max_batch"),
    (lambda: RouterSettings(submit_timeout_s=0), "submit_timeout_s (--submit-timeout)"),
    (lambda: RouterSettings(view_refresh_s=-1.0), "view_refresh_s"),
    (lambda: TickSettings(batch_size=0), "batch_size (--batch-size)"),
    (lambda: TickSettings(recover_batch_size=0), "recover_batch_size"),
    (lambda: AgentSettings("", (BackendSpec("main"),)), "peer_id (--peer-id)"),
    (lambda: AgentSettings("p", ()), "at least one backend"),
    (lambda: AgentSettings("p", (BackendSpec("a"), BackendSpec("a"))), "names must differ"),
    (lambda: AgentSettings("p", (BackendSpec("a"),), heartbeat_interval_s=0), "heartbeat_interval_s"),
    (lambda: AgentSettings("p", (BackendSpec("a"),), reconcile_interval_s=float("nan")), "reconcile_interval_s"),
    (lambda: AgentSettings("p", (BackendSpec("a"),), kill_grace_s=-1), "kill_grace_s"),
    (lambda: BackendSpec("a", slots=-1), "slots (--slots)"),
    (lambda: BackendSpec("a", kind="teleport"), "kind (--backend)"),
    (lambda: ProcessSettings(db_pool=0), "db_pool (--db-pool)"),
    (lambda: ProcessSettings(db_timeout_s=-1.0), "db_timeout_s (--db-timeout)"),
    (lambda: ProcessSettings(db_timeout_s=float("inf")), "db_timeout_s (--db-timeout)"),
    (lambda: ProcessSettings(metrics_port=0), "metrics_port (--metrics-port)"),
    (lambda: ProcessSettings(metrics_port=65536), "metrics_port (--metrics-port)"),
    (lambda: ProcessSettings(metrics_port=True), "metrics_port (--metrics-port)"),
    (lambda: ProcessSettings(metrics_host=""), "metrics_host (--metrics-host)"),
])
def test_settings_that_cannot_work_are_refused_when_built(build, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        build()


def _router_flags(*argv: str) -> argparse.Namespace:
    return service_parser("router").parse_args(list(argv))


@pytest.mark.parametrize(("argv", "least", "given"), [
    (["--writers", "16"], 18, 10),  # the default pool
    (["--writers", "8", "--db-pool", "9"], 10, 9),
    (["--db-pool", "5"], 6, 5),  # the default writers
])
def test_a_router_whose_writers_would_hold_every_pool_connection_is_refused(argv, least, given):
    # Each writer keeps a connection for good: with no spare, cancels and the peer view
    # wait out --db-timeout, and writers short of one fail their batch after 2 s.
    with pytest.raises(ConfigError, match=rf"needs --db-pool of at least {least} .*got {given}$"):
        router_flags.settings(_router_flags(*argv), None)


def test_a_router_with_room_beside_its_writers_starts():
    assert router_flags.settings(_router_flags("--writers", "8", "--db-pool", "10"), None).writers == 8
    assert router_flags.settings(_router_flags(), None) == RouterSettings()
    ProcessSettings().__post_init__()  # the defaults pass their own checks
    assert RouterSettings().writers + ROUTER_SPARE_CONNECTIONS <= ProcessSettings().db_pool


def test_defaults_are_valid_and_field_names_stay():
    assert RouterSettings() == RouterSettings(writers=4, max_batch=1000, view_refresh_s=None, max_queue=10_000,
                                              submit_timeout_s=2.0)
    assert TickSettings() == TickSettings(batch_size=1000, recover_batch_size=1000)
    settings = AgentSettings("p", (BackendSpec("main"),))
    assert (settings.work_root, settings.heartbeat_interval_s, settings.heartbeat_ttl_s,
            settings.reconcile_interval_s, settings.kill_grace_s, settings.simulated_duration_s,
            settings.report_linger_s) == (Path(".irisfed/work"), 2.0, 6.0, 2.0, 30.0, 0.0, 0.01)
    assert BackendSpec("main") == BackendSpec("main", "subprocess", {}, 4)


# ---------------------------------------------------------------- retries


@pytest.mark.parametrize(("attempts", "max_retries", "retrying"), [
    (0, 0, False), (1, 0, False), (1, 1, True), (2, 1, False), (3, 5, True),
])
def test_infrastructure_failures_are_retried_while_retries_remain(attempts, max_retries, retrying):
    failure = after_infra_failure(attempts, max_retries)
    assert failure.retrying is retrying
    assert failure.to_state is (JobState.QUEUED if retrying else JobState.FAILED)
    assert epoch_after(JobState.RUNNING, failure.to_state, 7) == (8 if retrying else 7)
    assert failure.owner_after("p") == (None if retrying else "p")


def test_a_lost_peer_follows_the_same_rule():
    assert recover_from_lost_peer(JobState.ASSIGNED, "p", 5, 0).to_state is JobState.QUEUED  # never started
    retried = recover_from_lost_peer(JobState.RUNNING, "p", 1, 1)
    assert (retried.to_state, retried.avoid_owner, retried.reason) == (
        JobState.QUEUED, True, "peer lost: p unreachable while running it; retrying elsewhere")
    failed = recover_from_lost_peer(JobState.RUNNING, "p", 2, 1)
    assert (failed.to_state, failed.avoid_owner, failed.reason) == (
        JobState.FAILED, False, "peer lost: p unreachable while running it; no retries left")
    for state in (JobState.ASSIGNED, JobState.RUNNING):  # a cancel stored while p was away: never requeued
        killed = recover_from_lost_peer(state, "p", 1, 5, cancel_requested=True)
        assert (killed.to_state, killed.avoid_owner, killed.reason) == (
            JobState.KILLED, False, "cancelled while its owner p was unreachable")


# ---------------------------------------------------------------- clock


def test_services_read_the_injected_clock():
    clock = ManualClock()
    tick = Tick(make_config(), pool=None, nc=None, clock=clock)
    router = Router(make_config(), pool=None, nc=None, clock=clock)
    assert tick.clock is clock and router.clock is clock
    assert tick.view.clock() == router.view.clock() == clock.monotonic()
    clock.advance(5)
    assert tick.view.clock() == 1005.0 and clock.now().isoformat() == "2026-01-01T00:00:05+00:00"


def test_the_default_clock_is_the_systems_and_a_bare_callable_is_its_monotonic_reading():
    assert as_clock(None) is SYSTEM_CLOCK and SYSTEM_CLOCK.monotonic is time.monotonic
    assert SYSTEM_CLOCK.now().tzinfo is not None
    legacy = as_clock(lambda: 42.0)
    assert legacy.monotonic() == 42.0 and legacy.now().tzinfo is not None
