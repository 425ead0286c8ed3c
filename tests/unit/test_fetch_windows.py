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
])
async def test_what_cannot_be_the_workspace_is_refused_at_once(messages, error, words):
    with pytest.raises(error, match=words):
        await read(Inbox(*messages))
