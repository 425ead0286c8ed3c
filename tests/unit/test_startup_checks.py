"""Every service checks its process flags when it starts (``--db-pool``, ``--db-timeout``,
``--metrics-port``, ``--metrics-host``; the router's ``--writers`` with its pool).

A value that cannot work is a ConfigError naming the setting and its flag, raised
before anything connects. ``--db-pool`` is bounded by Postgres's own ceiling on
``max_connections``: asyncpg builds one holder per pool slot before it connects, so a
huge pool would hang the service for ever while it grew. That ceiling also bounds
``--writers`` through the router's ``--db-pool >= --writers + 2``. The same flags given
to the real commands are tests/e2e/test_service_flag_refusals_e2e.py."""

from __future__ import annotations

import argparse

import pytest

from irisfed.services.common import metrics
from irisfed.services.common.startup import (
    DB_POOL_MAX,
    ProcessSettings,
    process_settings,
    service_parser,
)
from irisfed.services.router import flags as router_flags
from irisfed.shared.errors import ConfigError
from irisfed.shared.settings import require_count

POSTGRES_MAX_BACKENDS = 0x3FFFF  # src/include/postmaster/postmaster.h: max_connections' ceiling


def test_the_pool_ceiling_is_postgres_own():
    assert DB_POOL_MAX == POSTGRES_MAX_BACKENDS
    assert ProcessSettings(db_pool=DB_POOL_MAX).db_pool == DB_POOL_MAX
    assert ProcessSettings(db_pool=1).db_pool == 1
    for bad in (DB_POOL_MAX + 1, 10**30, 0, -1, True, 10.0, "10", None):
        with pytest.raises(ConfigError, match=r"^service setting db_pool \(--db-pool\) must be a whole number "
                                              r"1\.\.262143, got "):
            ProcessSettings(db_pool=bad)


def test_require_count_without_a_ceiling_says_what_it_said():
    require_count("x", "n", 10**30)  # no ceiling: any whole number >= least
    with pytest.raises(ConfigError, match=r"^x setting n \(--n\) must be a whole number >= 1, got 0$"):
        require_count("x", "n", 0, flag="--n")
    with pytest.raises(ConfigError, match=r"^x setting n must be a whole number 2\.\.5, got 6$"):
        require_count("x", "n", 6, least=2, most=5)
    require_count("x", "n", 5, least=2, most=5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1e-9, True, "15", None])
def test_db_timeout_that_cannot_work_is_refused(value):
    with pytest.raises(ConfigError, match=r"^service setting db_timeout_s \(--db-timeout\) must be a number"):
        ProcessSettings(db_timeout_s=value)


@pytest.mark.parametrize("value", [0, 0.0, -0.0, 1e300, 15])
def test_db_timeout_edges_that_work_are_taken(value):
    assert ProcessSettings(db_timeout_s=value).db_timeout_s == value


def _router_args(*argv: str) -> argparse.Namespace:
    return service_parser("router").parse_args(list(argv))


def test_huge_writers_with_a_pool_to_match_are_stopped_by_the_pool_ceiling():
    args = _router_args("--writers", str(10**30), "--db-pool", str(10**30 + 2))
    assert router_flags.settings(args, None).writers == 10**30  # the writers rule alone lets it by
    with pytest.raises(ConfigError, match="db_pool"):
        process_settings(args)  # and run() checks this first
    top = _router_args("--writers", str(DB_POOL_MAX - 2), "--db-pool", str(DB_POOL_MAX))
    assert process_settings(top).db_pool == DB_POOL_MAX
    assert router_flags.settings(top, None).writers == DB_POOL_MAX - 2


def test_no_environment_variable_feeds_the_process_flags(monkeypatch):
    for name in ("IRISFED_DB_POOL", "IRISFED_DB_TIMEOUT", "IRISFED_METRICS_PORT", "IRISFED_METRICS_HOST",
                 "IRISFED_WRITERS"):
        monkeypatch.setenv(name, "0")
    args = _router_args()
    assert process_settings(args) == ProcessSettings()
    assert router_flags.settings(args, None).writers == 4


def test_no_metrics_port_serves_nothing():
    metrics.serve(None, "")  # nothing to bind: not even the host is looked at
