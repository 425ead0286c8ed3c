"""Bands at the router (docs/design.md §3.3), on real Postgres and nats-server: each job
keeps its band, a band above the user's max_band is refused as `forbidden` and writes
nothing, and a band is part of what a job is (its spec hash)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from irisfed.services.common.store import Store
from tests.infra.factories import advertise
from tests.infra.routers import RouterThread

USERS = [{"id": "alice"}, {"id": "bob", "max_band": "production"}, {"id": "carol", "max_band": "batch"}]


@contextlib.contextmanager
def _router(database_url: str, servers) -> Iterator[tuple[RouterThread, Store]]:
    """A router of ``USERS`` whose view has home (cpu); closed at the end."""
    with RouterThread(database_url, servers.nats_url, users=USERS) as router:
        store = Store(router.pool)
        router.run(advertise(store, "home", slots=8, device_type="cpu"))
        router.run(router.router.refresh_view())
        yield router, store


def test_each_job_keeps_its_band(database_url, servers):
    with _router(database_url, servers) as (router, store):
        for subject, job_id, band in (("submit.bob", "b0", "batch"), ("submit.bob", "b1", None),
                                      ("submit.bob", "b2", "production"), ("submit.bob", "b3", "interactive"),
                                      ("submit.carol", "c0", "batch"), ("submit.alice", "a0", "batch"),
                                      ("submit", "d1", None)):
            body = {"job_id": job_id, "command": ["true"], **({"band": band} if band else {})}
            reply = router.ask(subject, body)
            assert reply["job_id"] == job_id and reply["state"] == "assigned" and "dry_run" not in reply, reply
        stored = {job_id: router.run(store.job_get(job_id)).band
                  for job_id in ("bob:b0", "bob:b1", "bob:b2", "bob:b3", "carol:c0", "alice:a0", "d1")}
        assert stored == {"bob:b0": 0, "bob:b1": 1, "bob:b2": 2, "bob:b3": 1, "carol:c0": 0, "alice:a0": 0, "d1": 1}


def test_a_band_above_the_users_max_band_is_forbidden_and_writes_nothing(database_url, servers):
    with _router(database_url, servers) as (router, store):
        before = router.written()
        for subject, body, message in (
                ("submit.alice", {"job_id": "p", "command": ["true"], "band": "production"},
                 "user alice may submit at most band interactive; this job asks production"),
                ("submit", {"job_id": "p", "command": ["true"], "band": "production"},
                 "user default may submit at most band interactive; this job asks production"),
                ("submit.carol", {"job_id": "p", "command": ["true"]},
                 "user carol may submit at most band batch; this job asks interactive "
                 "(the default band when none is given)"),
                ("submit.carol", {"job_id": "p", "command": ["true"], "band": "interactive"},
                 "user carol may submit at most band batch; this job asks interactive "
                 "(the default band when none is given)"),
                # A dry run is refused the same way.
                ("submit.alice", {"job_id": "p", "command": ["true"], "band": "production", "dry_run": True},
                 "user alice may submit at most band interactive; this job asks production")):
            assert router.ask(subject, body) == {"error": {"code": "forbidden", "message": message}}
        assert router.written() == before
        assert all(router.run(store.job_get(job_id)) is None for job_id in ("alice:p", "p", "carol:p"))
        # The same ids within the users' bands are accepted: nothing was left half-written.
        assert router.ask("submit.alice", {"job_id": "p", "command": ["true"]})["state"] == "assigned"
        assert router.ask("submit.carol", {"job_id": "p", "command": ["true"], "band": "batch"})["duplicate"] is False


def test_an_unknown_band_is_an_invalid_request_and_writes_nothing(database_url, servers):
    with _router(database_url, servers) as (router, _):
        before = router.written()
        for extra in ({"band": "urgent"}, {"band": "PRODUCTION"}, {"band": 2}, {"max_preemptions": -1},
                      {"band": "urgent", "dry_run": True}, {"dry_run": "yes"}):
            reply = router.ask("submit.bob", {"job_id": "x", "command": ["true"], **extra})
            assert reply["error"]["code"] == "invalid_request", (extra, reply)
        assert "band" in router.ask("submit.bob", {"command": ["true"], "band": "urgent"})["error"]["message"]
        assert router.written() == before


def test_resubmitting_under_another_band_is_a_conflict(database_url, servers):
    with _router(database_url, servers) as (router, store):
        first = router.ask("submit.bob", {"job_id": "same", "command": ["true"]})
        assert first["duplicate"] is False
        # The default band spelled out is the same job.
        again = router.ask("submit.bob", {"job_id": "same", "command": ["true"], "band": "interactive"})
        assert again == {**first, "duplicate": True}
        for extra in ({"band": "batch"}, {"band": "production"}, {"max_preemptions": 5}):
            reply = router.ask("submit.bob", {"job_id": "same", "command": ["true"], **extra})
            assert reply["error"] == {"code": "conflict",
                                      "message": "job_id 'same' already names a job with a different spec"}, extra
        assert router.run(store.job_get("bob:same")).band == 1
