"""The Python client (irisfed.client) against a real federation: real router, tick and
agents as processes, the session's real NATS (with auth: the producer and operator
users) and Postgres."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from irisfed.client import (
    Client,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    Retry,
    SyncClient,
    UnknownPeerError,
)
from irisfed.shared.messages import CancelReply, JobEvent, SubmitReply
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e


def _connect(federation, role: str = "producer", *, nats_url: str | None = None, **options):
    return Client.connect(nats_url or federation.nats_url_for(role), federation.database_url,
                          prefix=federation.prefix, **options)


def _gated(gate) -> list[str]:
    """A command that runs until ``gate`` exists, then succeeds."""
    return ["sh", "-c", f'while [ ! -e "{gate}" ]; do sleep 0.05; done; echo done']


async def _jobs(federation) -> list:
    return await federation.store.job_list(limit=1000)


async def test_submit_duplicate_conflict_reject_and_errors(federation):
    await federation.start_federation(("home", "--resource", "cpu=4"),
                                      ("gpu-west", "--resource", "cpu=16", "--resource", "gpu=2"))
    async with _connect(federation) as client:  # the producer user: submit and cancel only
        reply = await client.submit(["echo", "hi"], job_id="client-1", labels={"team": "vision"})
        assert isinstance(reply, SubmitReply)
        assert (reply.job_id, reply.disposition, reply.peer_id, reply.duplicate) == ("client-1", "local", "home", False)

        again = await client.submit(["echo", "hi"], job_id="client-1", labels={"team": "vision"})
        assert again.duplicate and (again.job_id, again.disposition, again.peer_id) == ("client-1", "local", "home")

        with pytest.raises(ConflictError) as conflict:
            await client.submit(["echo", "something else"], job_id="client-1")
        assert conflict.value.code == "conflict" and "client-1" in conflict.value.message

        rejected = await client.submit(["true"], resources={"gpu": 64})  # a reject is an answer
        assert rejected.disposition == "reject" and rejected.state == "rejected"
        verdicts = {v.peer_id: v for v in rejected.verdicts}
        assert verdicts["gpu-west"].code == "insufficient_resources"
        assert "gpu: asked 64, at most 2" in verdicts["gpu-west"].detail
        assert verdicts["tpu-east"].code == "unreachable"  # in the config, not running

        with pytest.raises(UnknownPeerError):
            await client.submit(["true"], cluster_pin="nowhere")
        queued = await client.submit(["true"], constraints=["device_type=gpu", "device_variant=in:h100,b200"])
        assert queued.disposition == "queue" and len(queued.job_id) == 20  # made by the client

        before = len(await _jobs(federation))
        with pytest.raises(InvalidRequestError):  # refused here: nothing sent, nothing written
            await client.submit(["true"], priority=10**9)
        assert len(await _jobs(federation)) == before

        # The producer may not listen to events: wait reads Postgres, every poll_interval.
        final = await client.wait("client-1", timeout=120)
        assert isinstance(final, JobEvent) and (final.state, final.exit_code, final.peer_id) == ("succeeded", 0, "home")
        job = await client.get("client-1")
        assert job.terminal and job.state == "succeeded" and job.spec["labels"] == {"team": "vision"}
        assert [e.state for e in [e async for e in client.watch(rejected.job_id)]] == ["rejected"]
        with pytest.raises(NotFoundError):
            await client.get("no-such-job")
        with pytest.raises(NotFoundError):
            await client.wait("no-such-job")


async def test_cancel_wait_and_a_timeout(federation, tmp_path):
    await federation.start_federation("home")
    async with _connect(federation, "operator") as client:
        reply = await client.submit(_gated(tmp_path / "never"), job_id="to-cancel")
        async with asyncio.timeout(120), contextlib.aclosing(client.watch(reply.job_id)) as events:
            async for event in events:
                if event.state == "running":
                    break
        with pytest.raises(TimeoutError, match="still running"):
            await client.wait(reply.job_id, timeout=0.5)  # it cannot end: its gate never opens
        cancelled = await client.cancel(reply.job_id)
        assert isinstance(cancelled, CancelReply) and cancelled.outcome == "kill_sent"
        assert (await client.cancel(reply.job_id)).outcome in ("already_requested", "already_finished")
        final = await client.wait(reply.job_id, timeout=120)
        assert final.state == "killed"
        job = await client.get(reply.job_id)
        assert job.state == "killed" and job.cancel_requested
        with pytest.raises(NotFoundError):
            await client.cancel("no-such-job")


async def test_watch_sees_the_end_that_happened_while_nats_was_cut(federation, tmp_path):
    await federation.start_federation("home")
    proxy = federation.supervisor.proxy(federation.nats_url)  # the client's NATS only; the session's stays up
    gate = tmp_path / "go"
    # No polling: only an event or a reconnect makes the watch read Postgres again.
    async with _connect(federation, "operator", nats_url=proxy.url_for(federation.nats_url_for("operator")),
                        poll_interval=3600) as client:
        reply = await client.submit(_gated(gate), job_id="through-a-cut")
        events: list[JobEvent] = []

        async def follow() -> None:
            async for event in client.watch(reply.job_id):
                events.append(event)

        watching = asyncio.create_task(follow())

        async def running():
            return any(e.state == "running" for e in events)

        await wait_for(running, "the watch to see the job running")
        proxy.cut()
        gate.touch()
        await federation.wait_state(reply.job_id, "succeeded")
        await asyncio.sleep(0)
        assert not watching.done() and events[-1].state == "running"  # its event was lost in the cut
        proxy.restore()
        await asyncio.wait_for(watching, timeout=120)  # the reconnect made it read Postgres
    states = [e.state for e in events]
    assert states[-1] == "succeeded" and events[-1].exit_code == 0
    assert "running" in states and len(states) == len(set(states))  # each change once, in order


async def test_no_router_is_retried_with_the_same_job_id_until_one_answers(federation):
    retried = asyncio.Event()
    retries: list[str] = []

    def on_retry(attempt, error, delay) -> None:
        retries.append(error.code)
        retried.set()

    async with _connect(federation, retry=Retry(attempts=10_000, base_s=0.05, cap_s=0.5),
                        on_retry=on_retry) as client:
        submitting = asyncio.create_task(client.submit(["echo", "hi"]))
        await asyncio.wait_for(retried.wait(), timeout=60)  # nobody listens on submit yet
        await federation.start_federation("home")
        reply = await asyncio.wait_for(submitting, timeout=120)
    assert set(retries) == {"unavailable"}
    jobs = await _jobs(federation)
    assert [j.job_id for j in jobs] == [reply.job_id]


async def test_lost_answers_are_retried_and_make_one_job(federation):
    await federation.start_federation("home")
    proxy = federation.supervisor.proxy(federation.nats_url)
    retried = asyncio.Event()
    async with _connect(federation, nats_url=proxy.url_for(federation.nats_url_for("producer")), timeout=1.0,
                        retry=Retry(attempts=10_000, base_s=0.05, cap_s=0.2),
                        on_retry=lambda *_: retried.set()) as client:
        proxy.stall()  # NATS hangs: every try times out, and is held, not lost
        submitting = asyncio.create_task(client.submit(["echo", "once"]))
        await asyncio.wait_for(retried.wait(), timeout=60)
        proxy.restore()  # every held try reaches the router: the same job_id each time
        reply = await asyncio.wait_for(submitting, timeout=120)
    jobs = await _jobs(federation)
    assert [j.job_id for j in jobs] == [reply.job_id]
    assert (await federation.wait_state(reply.job_id, "succeeded")).job_id == reply.job_id


async def test_sync_client_works_where_an_event_loop_already_runs(federation):
    """Like a notebook cell: blocking calls made on a thread whose loop is running."""
    await federation.start_federation("home")
    with SyncClient.connect(federation.nats_url_for("operator"), federation.database_url,
                            prefix=federation.prefix) as client:
        reply = client.submit(["echo", "hello"], job_id="sync-1")
        assert reply.disposition == "local"
        states = [event.state for event in client.watch("sync-1")]
        assert states[-1] == "succeeded"
        assert client.wait("sync-1", timeout=60).exit_code == 0
        assert client.get("sync-1").peer_id == "home"
        assert client.cancel("sync-1").outcome == "already_finished"
        with pytest.raises(ConflictError):
            client.submit(["echo", "bye"], job_id="sync-1")
