"""Dry runs (``dry_run: true``, docs/design.md §3.3) on real Postgres and nats-server:
the answer is what the submit would answer now, plus where the tick would place the
job and whom it would preempt — and nothing is written, published or locked."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from irisfed.client import DryRunReply, ForbiddenError, SyncClient
from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick
from irisfed.shared.messages import SubmitReply
from irisfed.shared.users import split_job_id
from tests.infra.factories import advertise, make_config, running_job
from tests.infra.routers import RouterThread
from tests.infra.waiting import wait_for

USERS = [{"id": "alice", "quota": {"slots": 2, "gpu": 1}}, {"id": "bob", "max_band": "production"}]
# Heartbeats stay fresh for the whole test however slow the machine: reachability is not what is tested.
CONFIG = {"users": USERS, "heartbeat_ttl_s": 600}
GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
ROUTED = ("job_id", "disposition", "state", "peer_id", "reason", "verdicts", "duplicate")


@contextlib.contextmanager
def _federation(database_url: str, servers, gpu_slots: int = 1, tpu_slots: int = 1,
                home: bool = True) -> Iterator[tuple[RouterThread, Store]]:
    """A router whose view has home (cpu, LOCAL work) and two GPU peers, gpu-west and
    tpu-east; closed at the end."""
    with RouterThread(database_url, servers.nats_url, **CONFIG) as router:
        store = Store(router.pool)
        if home:
            router.run(advertise(store, "home", slots=8, ttl_s=600, device_type="cpu"))
        router.run(advertise(store, "gpu-west", slots=gpu_slots, ttl_s=600, device_type="gpu"))
        router.run(advertise(store, "tpu-east", slots=tpu_slots, ttl_s=600, device_type="gpu"))
        router.run(router.router.refresh_view())
        yield router, store


def _tick(router: RouterThread):
    """One tick pass on the router's loop and pool, as a deployed tick would run it."""
    async def once():
        tick = Tick(make_config(subject_prefix=router.prefix, **CONFIG), router.pool, None)
        await tick.refresh_view()
        return await tick.run_once()
    return router.run(once())


def _started(router: RouterThread, store: Store, peer: str, band: str) -> str:
    """A job of ``band`` of the default user, running on ``peer``'s backend main; its id.
    Each is started in a transaction of its own, so each later one started more recently."""
    return router.run(running_job(store, peer, band=band))


def test_dry_runs_answer_as_the_submit_would_and_write_and_publish_nothing(database_url, servers):
    with _federation(database_url, servers) as (router, store):
        heard: list[str] = []

        async def spy() -> None:
            async def note(msg) -> None:
                heard.append(msg.subject[len(router.prefix) + 1:])
            await router.client.subscribe(f"{router.prefix}.>", cb=note)
            await router.client.flush()

        router.run(spy())
        cases = [  # (subject, body): each dry run, then the same submit for real under the same id
            ("submit.alice", {"job_id": "l1", "command": ["true"]}),  # LOCAL, within alice's quota
            ("submit.alice", {"job_id": "l2", "command": ["true"]}),  # LOCAL, her last slot
            ("submit.alice", {"job_id": "l3", "command": ["true"]}),  # LOCAL, over her quota now: queued
            ("submit.bob", {"job_id": "q1", "command": ["true"], "constraints": GPU}),  # QUEUE
            ("submit", {"job_id": "q2", "command": ["true"], "constraints": GPU, "band": "batch"}),  # QUEUE, default user
            ("submit.bob", {"job_id": "r1", "command": ["true"],
                            "constraints": [{"key": "device_type", "op": "eq", "value": "tpu"}]}),  # REJECT
            ("submit.alice", {"job_id": "r2", "command": ["true"], "resources": {"gpu": 2}}),  # over her whole quota
            ("submit.bob", {"job_id": "e1", "command": ["true"], "cluster_pin": "nowhere"}),  # unknown_peer
            ("submit.bob", {"job_id": "e2", "command": [""]}),  # invalid_request
        ]
        answers = {}
        for subject, body in cases:
            before = router.written()
            dry = router.ask(subject, {**body, "dry_run": True})
            assert router.written() == before, body
            real = router.ask(subject, body)
            if "error" in real:
                assert dry == real, body  # the same error, word for word
                continue
            assert dry["dry_run"] is True and "dry_run" not in real
            # The dry run created nothing: the real submit is the first, not a duplicate.
            assert real["duplicate"] is False, body
            assert {k: dry[k] for k in ROUTED} == {k: real[k] for k in ROUTED}, body
            answers[body["job_id"]] = dry
        assert [answers[i]["state"] for i in ("l1", "l2", "l3", "q1", "q2", "r1", "r2")] == [
            "assigned", "assigned", "queued", "queued", "queued", "rejected", "rejected"]
        assert answers["l1"]["placement"] == {"peer_id": "home", "backend": "main", "preempts": []}
        quota = "quota: this job's 1 slots would take alice over its quota of 2 slots"
        assert (answers["l3"]["placement"], answers["l3"]["waiting"], answers["l3"]["waiting_code"],
                answers["l3"]["reason"]) == (None, quota, "quota", quota)
        assert answers["q1"]["placement"]["peer_id"] in ("gpu-west", "tpu-east")
        assert answers["q2"]["band"] == "batch" and answers["q1"]["band"] == "interactive"
        assert answers["r1"]["placement"] is None and answers["r1"]["waiting"] == ""
        assert answers["r2"]["reason"] == "quota: the job asks 2 gpu; user alice's quota allows 1 in all"

        # NATS keeps one connection's messages in order: once a last real job's event is
        # heard, anything a dry run had published was heard before it.
        router.ask("submit", {"job_id": "barrier", "command": ["true"], "constraints": GPU})

        async def barrier_heard() -> bool:
            return "events.barrier" in heard

        router.run(wait_for(barrier_heard, "the last real job's event"))
        published = Counter(s for s in heard if not s.startswith("submit"))
        real_ids = ["alice:l1", "alice:l2", "alice:l3", "bob:q1", "q2", "bob:r1", "alice:r2", "barrier"]
        assert published == Counter({**{f"events.{i}": 1 for i in real_ids},
                                     **{f"uevents.{user}.{bare}": 1 for user, bare in map(split_job_id, real_ids)},
                                     "assign.home": 2, "tick.wake": 4}), published


def test_a_dry_run_takes_no_quota_lock(database_url, servers):
    """alice has a quota, so her real LOCAL submit waits for her quota lock; a dry run
    must answer while another writer (a hung tick, say) holds that lock."""
    with _federation(database_url, servers) as (router, _):
        held: dict = {}

        async def lock() -> None:
            conn = held["conn"] = await router.pool.acquire()
            held["tx"] = conn.transaction()
            await held["tx"].start()
            await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('irisfed.quota.alice', 0))")

        async def unlock() -> None:
            await held["tx"].rollback()
            await router.pool.release(held["conn"])

        router.run(lock())
        try:
            before = router.written()
            dry = router.ask("submit.alice", {"job_id": "l1", "command": ["true"], "dry_run": True})
            assert dry.get("placement") == {"peer_id": "home", "backend": "main", "preempts": []}, dry
            assert router.written() == before
        finally:
            router.run(unlock())
        # The lock is alice's quota lock indeed: with it free the real submit goes through.
        assert router.ask("submit.alice", {"job_id": "l1", "command": ["true"]})["state"] == "assigned"


def test_a_dry_run_names_the_free_peer_the_tick_then_uses(database_url, servers):
    with _federation(database_url, servers, home=False) as (router, store):
        # gpu-west is full of work of bob's own band (nothing to preempt); tpu-east is free.
        busy = _started(router, store, "gpu-west", "interactive")
        body = {"job_id": "j1", "command": ["true"], "constraints": GPU}
        dry = router.ask("submit.bob", {**body, "dry_run": True})
        assert (dry["disposition"], dry["state"], dry["waiting"]) == ("queue", "queued", "")
        assert dry["placement"] == {"peer_id": "tpu-east", "backend": "main", "preempts": []}
        assert router.ask("submit.bob", body)["state"] == "queued"
        result = _tick(router)
        assert [(job_id, peer) for job_id, peer, _ in result.assigned] == [("bob:j1", "tpu-east")]
        assert result.preempted == []
        assert router.run(store.job_get("bob:j1")).backend == "main"
        assert router.run(store.job_get(busy)).state == "running"


def test_a_dry_run_in_a_full_federation_names_the_victim_the_tick_preempts(database_url, servers):
    with _federation(database_url, servers, home=False) as (router, store):
        older = _started(router, store, "gpu-west", "batch")
        newer = _started(router, store, "tpu-east", "batch")  # the most recently started: the one to go
        body = {"job_id": "j1", "command": ["true"], "constraints": GPU}
        before = router.written()
        dry = router.ask("submit.bob", {**body, "dry_run": True})
        assert dry["placement"] == {"peer_id": "tpu-east", "backend": "main", "preempts": [newer]}, dry
        # A production job would stop the same one; a batch job may stop nobody and waits.
        production = router.ask("submit.bob", {**body, "band": "production", "dry_run": True})
        assert production["placement"] == dry["placement"] and production["band"] == "production"
        batch = router.ask("submit.bob", {**body, "band": "batch", "dry_run": True})
        assert batch["placement"] is None and batch["waiting"].startswith("matching peers are full")
        assert {v["peer_id"] for v in batch["waiting_verdicts"]} >= {"gpu-west", "tpu-east"}
        # Nothing was preempted, nor written.
        assert router.written() == before
        assert [router.run(store.job_get(j)).state for j in (older, newer)] == ["running", "running"]
        assert router.run(store.job_get(newer)).epoch == 1
        # The real submit and a tick pass do what the dry run said.
        assert router.ask("submit.bob", body)["state"] == "queued"
        result = _tick(router)
        assert [(job_id, peer) for job_id, peer, _ in result.assigned] == [("bob:j1", "tpu-east")]
        assert [(v.job_id, v.preemptor) for v in result.preempted] == [(newer, "bob:j1")]
        assert router.run(store.job_get("bob:j1")).backend == "main"
        assert router.run(store.job_get(older)).state == "running"


def test_a_dry_run_with_nothing_lower_to_preempt_says_why_it_would_wait(database_url, servers):
    with _federation(database_url, servers, home=False) as (router, store):
        for peer in ("gpu-west", "tpu-east"):
            _started(router, store, peer, "interactive")
        dry = router.ask("submit.bob", {"job_id": "j1", "command": ["true"], "constraints": GPU, "dry_run": True})
        assert dry["placement"] is None
        assert dry["waiting"] == ("matching peers are full; waiting for a free slot; cannot preempt: "
                                  "no job of a lower band runs on a backend that could hold it")


def test_a_dry_run_over_the_users_quota_waits_on_it_and_preempts_nobody(database_url, servers):
    with _federation(database_url, servers) as (router, store):
        for peer in ("gpu-west", "tpu-east"):
            _started(router, store, peer, "batch")
        body = {"job_id": "g1", "command": ["true"], "constraints": GPU}
        # With room in her quota, alice's job would preempt a batch job.
        assert router.ask("submit.alice", {**body, "dry_run": True})["placement"]["preempts"]
        for job_id in ("l1", "l2"):  # her two slots, taken by LOCAL jobs on home
            assert router.ask("submit.alice", {"job_id": job_id, "command": ["true"]})["state"] == "assigned"
        dry = router.ask("submit.alice", {**body, "dry_run": True})
        assert (dry["state"], dry["placement"], dry["waiting_code"]) == ("queued", None, "quota")
        assert dry["waiting"] == "quota: this job's 1 slots would take alice over its quota of 2 slots"


def test_a_dry_run_of_an_existing_id_answers_as_its_resubmission(database_url, servers):
    with _federation(database_url, servers) as (router, _):
        body = {"job_id": "e1", "command": ["true"], "constraints": GPU}
        real = router.ask("submit.bob", body)
        before = router.written()
        dry = router.ask("submit.bob", {**body, "dry_run": True})
        assert {k: dry[k] for k in ROUTED} == {**{k: real[k] for k in ROUTED}, "duplicate": True}
        assert (dry["placement"], dry["waiting"]) == (None, "")  # it exists: nothing more would be placed
        other = router.ask("submit.bob", {**body, "command": ["false"], "dry_run": True})
        assert other == {"error": {"code": "conflict",
                                   "message": "job_id 'e1' already names a job with a different spec"}}
        # Ids are the user's own: alice's e1 is another (new) job.
        assert router.ask("submit.alice", {**body, "dry_run": True})["duplicate"] is False
        assert router.written() == before


def test_the_client_asks_for_bands_and_dry_runs(database_url, servers):
    with _federation(database_url, servers) as (router, store):
        with SyncClient.connect(servers.nats_url, prefix=router.prefix, user="bob") as client:
            before = router.written()
            plan = client.submit(["true"], job_id="c1", constraints=["device_type=gpu"], band="production",
                                 dry_run=True)
            assert isinstance(plan, DryRunReply) and plan.band == "production"
            assert plan.placement is not None and plan.placement.peer_id in ("gpu-west", "tpu-east")
            assert router.written() == before
            reply = client.submit(["true"], job_id="c1", constraints=["device_type=gpu"], band="production",
                                  max_preemptions=3)
            assert isinstance(reply, SubmitReply) and (reply.state, reply.duplicate) == ("queued", False)
            row = router.run(store.job_get("bob:c1"))
            assert row.band == 2 and row.spec["max_preemptions"] == 3
        with SyncClient.connect(servers.nats_url, prefix=router.prefix, user="alice") as client:
            try:
                client.submit(["true"], band="production", dry_run=True)
            except ForbiddenError as exc:
                assert exc.message == "user alice may submit at most band interactive; this job asks production"
            else:
                raise AssertionError("alice may not ask for production")
