"""The router looks a submit's workspace up in a task of its own: a slow or hung object
store holds up only the submits that name a workspace, never the others; a submit a
JetStream consumer delivered (its reply a ``$JS.ACK`` subject, as a real server sets it
even with no acks asked) is dropped unread (pure: the store's lookup is a function held
here, nothing is sent)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from irisfed.services.router import service as router_service
from irisfed.services.router.service import Router
from irisfed.shared.errors import InvalidRequest
from tests.infra.factories import make_config

DIGEST = "sha256:" + "a" * 64


def submit(**fields) -> SimpleNamespace:
    answers: list[bytes] = []

    async def respond(data: bytes) -> None:
        answers.append(data)
    body = {"command": ["true"], "job_id": f"j{len(fields)}", **fields}
    return SimpleNamespace(subject="irisfed.submit", data=json.dumps(body).encode(), reply="inbox.1",
                           respond=respond, answers=answers)


async def test_a_submit_waiting_on_the_store_does_not_hold_up_one_without_a_workspace():
    router = Router(make_config(), pool=None, nc=None)
    store_answers = asyncio.Event()
    asked = []

    async def check(workspace, user):
        asked.append((workspace.digest, user))
        await store_answers.wait()
    router.workspaces.check = check
    waiting = submit(workspace={"digest": DIGEST, "size": 10})
    await router.on_submit(waiting)  # returns at once: its lookup runs in a task
    plain = submit()
    await router.on_submit(plain)
    assert [p.job.job_id for p in list(router.queue._queue)] == ["j0"]  # the plain one, queued first
    await asyncio.sleep(0)  # the lookup's task runs, and waits on the store
    assert router.queue.qsize() == 1 and asked == [(DIGEST, "default")] and len(router._workspace_submits) == 1
    store_answers.set()
    await asyncio.gather(*router._workspace_submits)
    assert [p.job.job_id for p in list(router.queue._queue)] == ["j0", "j1"]
    await router.close()


async def test_a_refused_workspace_is_answered_and_queues_nothing():
    router = Router(make_config(), pool=None, nc=None)

    async def check(workspace, user):
        raise InvalidRequest(f"workspace: {workspace.digest} is not in the federation's object store")
    router.workspaces.check = check
    msg = submit(workspace={"digest": DIGEST, "size": 10})
    await router.on_submit(msg)
    await asyncio.gather(*router._workspace_submits)
    assert router.queue.empty()
    assert json.loads(msg.answers[0])["error"]["code"] == "invalid_request"
    await router.close()


async def test_past_the_bound_a_workspace_submit_is_told_to_retry(monkeypatch):
    monkeypatch.setattr(router_service, "WORKSPACE_SUBMITS_WAITING_AT_MOST", 1)
    router = Router(make_config(), pool=None, nc=None)
    never = asyncio.Event()

    async def check(workspace, user):
        await never.wait()
    router.workspaces.check = check
    await router.on_submit(submit(workspace={"digest": DIGEST, "size": 10}))
    second = submit(workspace={"digest": DIGEST, "size": 10}, name="x")
    await router.on_submit(second)
    answer = json.loads(second.answers[0])["error"]
    assert answer["code"] == "unavailable" and "waiting on the object store" in answer["message"]
    await router.close()


async def test_a_message_a_jetstream_consumer_delivered_is_dropped_unread():
    """A consumer delivers to any subject its creator names: a submit, cancel, assign or
    heartbeat arriving that way (its reply an ack subject) was no client's publish."""
    from irisfed.services.common.bus import from_jetstream

    router = Router(make_config(), pool=None, nc=None)
    forged = submit()
    forged.reply = "$JS.ACK.OBJ_irisfed-workspaces-alice.evil.1.1.1.1.0"
    await router.on_submit(forged)
    assert router.queue.empty() and forged.answers == []
    assert from_jetstream(forged) and not from_jetstream(submit())
    assert not from_jetstream(SimpleNamespace(reply=""))  # a plain publish: no reply at all
    await router.close()


async def test_a_direct_gets_answer_is_dropped_unread_whatever_its_reply():
    """A direct get is answered on any subject its asker names, with no reply subject
    and the stream's name in its headers: a submit or cancel that came that way is no
    client's, and is neither run nor answered."""
    from irisfed.services.common.bus import from_jetstream

    router = Router(make_config(), pool=None, nc=None)
    forged = submit()
    forged.reply, forged.headers = "", {"Nats-Stream": "OBJ_irisfed-workspaces-alice", "Nats-Sequence": "7"}
    await router.on_submit(forged)
    assert router.queue.empty() and forged.answers == []
    cancels = []

    async def cancel(*args, **kwargs):
        cancels.append(args)
    router.requests.cancel = cancel
    forged.subject = "irisfed.cancel"
    await router.requests.on_cancel(forged)
    await asyncio.sleep(0)
    assert cancels == [] and forged.answers == []
    assert from_jetstream(forged) and not from_jetstream(SimpleNamespace(reply="", headers={"X": "1"}))
    assert from_jetstream(SimpleNamespace(reply="", headers={"Status": "404"}))  # a get that found nothing
    await router.close()


def fetch(peer: str, reply: str = "_INBOX_agent-gpu-west.x") -> SimpleNamespace:
    return SimpleNamespace(subject=f"irisfed.fetch.{peer}", data=b'{"job_id": "j", "epoch": 1}', reply=reply,
                           headers=None)


async def test_an_agents_fetches_past_the_bound_are_told_to_retry_and_others_go_on():
    """At most FETCHES_PER_PEER of one peer's fetches at once: a peer asking for more
    (or a hostile agent flooding) is told `unavailable`, another peer is not held up."""
    router = Router(make_config(), pool=None, nc=None)
    never = asyncio.Event()
    relayed, ended = [], []

    async def answer(peer, data, reply):
        relayed.append(peer)
        await never.wait()

    async def end(reply, body):
        ended.append(json.loads(body)["error"])
    router.relay.answer, router.relay.end = answer, end
    for _ in range(router_service.FETCHES_PER_PEER + 2):
        await router.on_fetch(fetch("gpu-west"))
    await router.on_fetch(fetch("tpu-east", reply="_INBOX_agent-tpu-east.y"))
    await asyncio.sleep(0)
    assert relayed.count("gpu-west") == router_service.FETCHES_PER_PEER and relayed.count("tpu-east") == 1
    assert [e["code"] for e in ended] == ["unavailable"] * 2 and "in progress; retry" in ended[0]["message"]
    for ignored in (fetch("nobody"), fetch("gpu-west", reply="irisfed.assign.gpu-west"),
                    fetch("gpu-west", reply="$O.irisfed-workspaces.C.x"), fetch("gpu-west", reply=""),
                    fetch("gpu-west", reply="_INBOX.>"), fetch("gpu-west", reply="_INBOX_agent-gpu-west.*"),
                    fetch("gpu-west", reply="_INBOX.a b"), fetch("gpu-west", reply="_INBOX"),
                    fetch("gpu-west", reply="_INBOX..x"), fetch("gpu-west", reply="_INBOX_agent-tpu-east.x"),
                    fetch("gpu-west", reply="_INBOX_user-alice.x"), fetch("gpu-west", reply="_INBOX_router.x")):
        # Not a peer, or a reply subject that is not one plain inbox of the asking agent's
        # (the store would send the chunks wherever it names): dropped.
        await router.on_fetch(ignored)
    assert len(ended) == 2 and relayed.count("gpu-west") == router_service.FETCHES_PER_PEER
    await router.close()


def test_any_header_the_server_adds_marks_a_message_as_jetstreams():
    """A stored header that the server appends to can swallow its ``Nats-Stream`` line:
    every ``Nats-`` header counts, and an unreadable header (``guard_headers``) too."""
    from irisfed.services.common.bus import from_jetstream
    from irisfed.shared.nats_urls import MALFORMED_HEADERS

    glued = {"X": "abNats-Stream: OBJ_irisfed-workspaces-alice", "Nats-Sequence": "3"}
    for headers in (glued, {"Nats-Time-Stamp": "x"}, dict(MALFORMED_HEADERS)):
        assert from_jetstream(SimpleNamespace(reply="", headers=headers)), headers
    for headers in (None, {}, {"traceparent": "00-1-2-01"}):
        assert not from_jetstream(SimpleNamespace(reply="", headers=headers)), headers


async def test_a_header_no_one_can_read_becomes_a_status_instead_of_an_error():
    from irisfed.shared.nats_urls import MALFORMED_HEADERS, guard_headers

    class Client:
        async def _process_headers(self, headers):
            return {"ok": headers.decode()}

    nc = Client()
    guard_headers(nc)
    assert await nc._process_headers(b"fine") == {"ok": "fine"}
    assert await nc._process_headers(b"\xff") == MALFORMED_HEADERS
