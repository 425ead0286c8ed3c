"""How an agent's fetch reads a window (``_window``, pure over a stand-in subscription):
the router's end and the store's chunks and status come in either order; the window is
over once both came, or once every byte the end names did; what cannot be the
workspace is refused at once."""

from __future__ import annotations

import json
from types import SimpleNamespace

import nats.errors
import pytest

from irisfed.services.common.objects import DigestMismatch, ObjectMissing, StoreUnavailable
from irisfed.services.peer_agent.workspaces import _window
from irisfed.shared.messages import FETCH_PART

DIGEST = "sha256:" + "a" * 64


class Inbox:
    """``next_msg`` hands out the messages given, in order; past them, a timeout."""

    def __init__(self, *messages) -> None:
        self.messages = list(messages)

    async def next_msg(self, timeout: float):
        if not self.messages:
            raise nats.errors.TimeoutError
        return self.messages.pop(0)


def end(size: int, digest: str = DIGEST, **extra) -> SimpleNamespace:
    body = {"job_id": "j", "digest": digest, "size": size, "sha256": "SHA-256=x", **extra}
    return SimpleNamespace(data=json.dumps(body).encode(), headers={FETCH_PART: "end"})


def refused(code: str, message: str) -> SimpleNamespace:
    body = {"error": {"code": code, "message": message}}
    return SimpleNamespace(data=json.dumps(body).encode(), headers={FETCH_PART: "end"})


def chunk(data: bytes, seq: int) -> SimpleNamespace:
    return SimpleNamespace(data=data, headers={"Nats-Sequence": str(seq)})


def status(code: str, pending: int = 0, last: int = 0) -> SimpleNamespace:
    headers = {"Status": code, "Description": "EOB" if code == "204" else "Message Not Found"}
    if code == "204":
        headers.update({"Nats-Num-Pending": str(pending), "Nats-Last-Sequence": str(last)})
    return SimpleNamespace(data=b"", headers=headers)


async def read(inbox: Inbox, size: int = 0, max_bytes: int = 100):
    got: list[bytes] = []
    answer = await _window(inbox, DIGEST, max_bytes, size, got.append, idle_s=0.01)
    return answer, b"".join(got)


@pytest.mark.parametrize("order", ["end first", "end between", "end last"])
async def test_the_end_and_the_chunks_come_in_any_order(order):
    chunks = [chunk(b"abc", 7), chunk(b"de", 9), status("204", pending=3, last=9)]
    at = {"end first": 0, "end between": 1, "end last": 3}[order]
    (fetched, left, next_seq, size), data = await read(Inbox(*chunks[:at], end(10), *chunks[at:]))
    assert (fetched.size, left, next_seq, size, data) == (10, 3, 10, 5, b"abcde")


async def test_every_byte_named_ends_the_window_without_waiting_for_its_status():
    (fetched, _, _, size), data = await read(Inbox(end(5), chunk(b"abcde", 1)))  # the status never comes
    assert (size, data, fetched.sha256) == (5, b"abcde", "SHA-256=x")


async def test_the_bytes_of_earlier_windows_count_toward_the_size():
    (_, _, next_seq, size), data = await read(Inbox(end(8), chunk(b"fgh", 12)), size=5)
    assert (size, next_seq, data) == (8, 13, b"fgh")


async def test_a_chunk_whose_writer_planted_an_end_or_a_status_is_still_a_chunk():
    """The job's own user writes its bucket, headers included: what the server adds to
    every chunk (its sequence) decides, not a planted end or status."""
    planted = SimpleNamespace(data=b"abc", headers={FETCH_PART: "end", "Status": "204", "Nats-Sequence": "4"})
    (fetched, left, next_seq, size), data = await read(Inbox(planted, end(3)))
    assert (fetched.size, size, next_seq, data) == (3, 3, 5, b"abc")


async def test_no_chunk_left_is_a_window_with_nothing_left():
    (_, left, _, size), data = await read(Inbox(end(10), status("404")), size=5)
    assert (left, size, data) == (0, 5, b"")


@pytest.mark.parametrize(("messages", "error", "words"), [
    ((end(3), chunk(b"abcd", 1)), DigestMismatch, "more than its 3 bytes"),
    ((chunk(b"x" * 101, 1), end(200)), DigestMismatch, "over the 100 bytes allowed"),
    ((status("503"),), StoreUnavailable, "the store answered 503"),
    ((end(3, digest="sha256:" + "b" * 64),), StoreUnavailable, "answered for another workspace"),
    ((SimpleNamespace(data=b"{", headers={FETCH_PART: "end"}),), StoreUnavailable, "not JSON"),
    ((SimpleNamespace(data=b'{"size": "x"}', headers={FETCH_PART: "end"}),), StoreUnavailable,
     "not a fetch's end"),
    ((refused("not_found", "fetch: workspace gone"),), ObjectMissing, "workspace gone"),
    ((refused("invalid_request", "fetch: over the cap"),), DigestMismatch, "over the cap"),
    ((refused("forbidden", "fetch: not assigned"),), StoreUnavailable, "not assigned"),
    ((chunk(b"ab", 1),), StoreUnavailable, "nothing came"),
    ((chunk(b"", 1),), StoreUnavailable, "an empty chunk"),
    ((SimpleNamespace(data=b"x", headers={"Nats-Sequence": "seven"}),), StoreUnavailable, "not a number"),
    ((end(9), SimpleNamespace(data=b"", headers={"Status": "204"})), StoreUnavailable, "missing or not a number"),
    ((SimpleNamespace(data=b"x", headers={}),), StoreUnavailable, "neither a chunk nor an end"),
])
async def test_what_cannot_be_the_workspace_is_refused_at_once(messages, error, words):
    with pytest.raises(error, match=words):
        await read(Inbox(*messages))


async def test_an_agent_fetches_a_few_workspaces_at_once_and_the_rest_wait(monkeypatch):
    """Each fetch has a window of chunks on its way into the agent's one connection, which
    nats-server drops past its pending cap: an agent asked for many workspaces at once
    fetches FETCHES_AT_ONCE of them and the others wait, all fetched in the end."""
    import asyncio

    from irisfed.services.peer_agent import run_files

    running, most, go = 0, 0, asyncio.Event()

    async def fetch(nc, subject, job, digest, max_bytes, sink):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await go.wait()
        running -= 1
        return f"SHA-256={digest}"
    monkeypatch.setattr(run_files, "fetch_through_router", fetch)
    files = run_files.RunFiles(None, SimpleNamespace(fetch=lambda peer: f"p.fetch.{peer}"), "gpu", None,
                               max_output_bytes=1, max_workspace_bytes=1, retry_pause_s=0)
    fetches = [asyncio.ensure_future(files.fetch_workspace(f"d{i}", "alice", (f"j{i}", 1), print)) for i in range(10)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert most == run_files.FETCHES_AT_ONCE == running
    go.set()
    assert await asyncio.gather(*fetches) == [f"SHA-256=d{i}" for i in range(10)]
    assert most == run_files.FETCHES_AT_ONCE


class Router:
    """A stand-in router and store over one inbox: the first ``busy`` requests are told
    `unavailable`, the next are answered with ``chunks`` as one window and the end."""

    def __init__(self, busy: int, chunks: list[bytes]) -> None:
        self.busy, self.chunks, self.asked = busy, chunks, []
        self.inbox = Inbox()

    def new_inbox(self) -> str:
        return "_INBOX.t"

    async def subscribe(self, inbox: str, pending_bytes_limit: int = 0):
        self.inbox.unsubscribe = self._nothing
        return self.inbox

    async def _nothing(self) -> None:
        return None

    async def publish(self, subject: str, body: bytes, reply: str) -> None:
        self.asked.append(json.loads(body))
        if len(self.asked) <= self.busy:
            self.inbox.messages.append(refused("unavailable", "fetch: gpu asked for more than 64 windows a second; "
                                                              "retry"))
            return
        size = sum(len(c) for c in self.chunks)
        self.inbox.messages += [chunk(c, i + 1) for i, c in enumerate(self.chunks)]
        self.inbox.messages += [status("204", pending=0, last=len(self.chunks)), end(size)]


async def test_a_busy_router_is_asked_again_after_a_pause(monkeypatch):
    from irisfed.services.peer_agent import workspaces

    monkeypatch.setattr(workspaces, "BUSY_PAUSE_S", 0)
    router, got = Router(busy=3, chunks=[b"ab", b"cd"]), []
    assert await workspaces.fetch_through_router(router, "p.fetch.gpu", ("j", 1), DIGEST, 100, got.append,
                                                 idle_s=0.01) == "SHA-256=x"
    assert b"".join(got) == b"abcd" and len(router.asked) == 4
    assert {request["from_seq"] for request in router.asked} == {0}  # the same window each time


async def test_a_router_busy_too_long_fails_the_fetch(monkeypatch):
    from irisfed.services.peer_agent import workspaces

    monkeypatch.setattr(workspaces, "BUSY_PAUSE_S", 0)
    monkeypatch.setattr(workspaces, "BUSY_TRIES", 3)
    router = Router(busy=10, chunks=[b"ab"])
    with pytest.raises(StoreUnavailable, match="more than 64 windows a second"):
        await workspaces.fetch_through_router(router, "p.fetch.gpu", ("j", 1), DIGEST, 100, print, idle_s=0.01)
    assert len(router.asked) == 3


def test_a_peers_windows_are_a_budget_that_refills_with_time():
    from irisfed.services.router.workspaces import WindowBudget

    now = [100.0]
    budget = WindowBudget(rate=2, burst=3, clock=lambda: now[0])
    assert [budget.take("gpu") for _ in range(4)] == [True, True, True, False]
    assert budget.take("cpu")  # each peer its own
    now[0] += 0.5  # one window back
    assert [budget.take("gpu") for _ in range(2)] == [True, False]
    now[0] += 60  # never more than the burst
    assert [budget.take("gpu") for _ in range(4)] == [True, True, True, False]
