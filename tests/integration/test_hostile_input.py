"""Hostile input on every request subject of a real router (real NATS, real Postgres).

Every body gets an error reply of the documented shape, the router keeps
serving, and nothing is written.
"""

from __future__ import annotations

import asyncio
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from irisfed.services.common.bus import connect_client
from irisfed.services.router.service import Router
from irisfed.shared.messages import JOB_ID_PATTERN, MAX_BODY_BYTES, SubmitRequest, decode_request
from tests.infra.factories import make_config

ERROR_CODES = {"invalid_request", "conflict", "unknown_peer", "unavailable", "not_found"}
PEERS = {"home", "gpu-west", "tpu-east"}


def assert_error(reply: dict, codes=ERROR_CODES) -> None:
    assert set(reply) == {"error"}, reply
    assert set(reply["error"]) == {"code", "message"}
    assert reply["error"]["code"] in codes
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=25)
not_a_command = json_values.filter(
    lambda v: not (isinstance(v, list) and v and all(isinstance(x, str) for x in v) and v[0].strip()))
bad_job_ids = st.text(max_size=200).filter(lambda s: not re.match(JOB_ID_PATTERN, s))
bad_ops = st.text(max_size=12).filter(
    lambda s: s not in {"eq", "ne", "exists", "not_exists", "gt", "ge", "lt", "le", "in"})
unknown_pins = st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True).filter(lambda s: s not in PEERS)

def _not_a_valid_submit(data: bytes) -> bool:
    """Random bytes can spell a valid submit (one is as short as ``{"command":["!"]}``)."""
    try:
        decode_request(SubmitRequest, data)
    except Exception:  # noqa: BLE001 - any refusal is what we want here
        return True
    return False


hostile_submits = st.one_of(
    st.binary(max_size=300).filter(_not_a_valid_submit),
    st.builds(lambda v: {"command": v}, not_a_command),
    st.builds(lambda v, k: {"command": ["x"], k: v}, json_values,
              st.text(min_size=1, max_size=12).filter(lambda k: k not in {
                  "command", "job_id", "name", "env", "constraints", "cluster_pin", "priority",
                  "max_retries", "deadline_s", "labels", "resources", "preferences"})),
    st.builds(lambda n: {"command": ["x"] * n}, st.integers(257, 2000)),
    st.builds(lambda n: {"command": ["x" * n]}, st.integers(4097, 20_000)),
    st.builds(lambda d: '{"command": ["x"], "env": ' + "[" * d + "]" * d + "}", st.integers(50, 3000)),
    st.builds(lambda op, v: {"command": ["x"], "constraints": [{"key": "k", "op": op, "value": v}]},
              bad_ops, json_values),
    st.builds(lambda v: {"command": ["x"], "constraints": [{"key": "k", "op": "gt", "value": v}]},
              st.text(min_size=1, max_size=10).filter(lambda s: _not_number(s))),
    st.builds(lambda v: {"command": ["x"], "constraints": [{"key": "k", "op": "in", "value": v}]},
              json_scalars),
    st.builds(lambda j: {"command": ["x"], "job_id": j}, bad_job_ids),
    st.builds(lambda p: {"command": ["x"], "cluster_pin": p}, unknown_pins),
    st.builds(lambda n: {"command": ["x"], "name": "n" * n}, st.integers(MAX_BODY_BYTES, MAX_BODY_BYTES * 2)),
    st.builds(lambda t, where: where(t + "\x00"), st.text(max_size=10), st.sampled_from([
        lambda t: {"command": ["x", t]}, lambda t: {"command": ["x"], "env": {"K": t}},
        lambda t: {"command": ["x"], "labels": {t: "v"}}, lambda t: {"command": ["x"], "name": t}])),
)


def _not_number(text: str) -> bool:
    try:
        float(text)
        return False
    except ValueError:
        return True


def _encode(body) -> bytes:
    if isinstance(body, bytes):
        return body
    return body.encode() if isinstance(body, str) else json.dumps(body).encode()


def _refused_writing_nothing(router, verb: str, body, codes: set[str]) -> None:
    """``body`` sent to ``verb`` is answered with an error of one of ``codes``; nothing is written."""
    assert_error(router.request(verb, _encode(body)), codes)
    assert router.rows() == 0


@given(body=hostile_submits)
@settings(max_examples=150)
def test_hostile_submits_get_errors_and_write_nothing(router, body):
    _refused_writing_nothing(router, "submit", body, {"invalid_request", "unknown_peer"})


hostile_cancels = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda v: {"job_id": v}, json_values.filter(lambda v: not isinstance(v, str))),
    st.builds(lambda j: {"job_id": j}, bad_job_ids),
    st.builds(lambda j: {"job_id": "ok", "extra": j}, json_values),
    st.builds(lambda j: {"job_id": j}, st.from_regex(r"[a-z][a-z0-9]{0,20}", fullmatch=True)),
)


@given(body=hostile_cancels)
@settings(max_examples=100)
def test_hostile_cancels_get_errors_and_write_nothing(router, body):
    _refused_writing_nothing(router, "cancel", body, {"invalid_request", "not_found"})


def test_router_keeps_serving_after_abuse(router):
    for body in (b"\xff\xfe", b"{" * 10_000, b"x" * (MAX_BODY_BYTES + 1), b"null"):
        assert_error(router.request("submit", body))
    ok = router.request("submit", json.dumps({"command": ["true"], "job_id": "fine"}).encode())
    assert ok["job_id"] == "fine" and ok["disposition"] in {"queue", "reject", "local"}
    assert router.rows() == 2  # the one good job and its changelog row


def test_a_nul_submit_never_fails_the_batch_it_arrives_with(router):
    # Postgres cannot store NUL: were it let through, the whole group-commit batch
    # (other producers' jobs) would fail with it.
    async def burst() -> list[dict]:
        bodies = [json.dumps({"command": ["true"], "job_id": f"ok-{i}"}).encode() for i in range(20)]
        bodies.insert(10, json.dumps({"command": ["echo", "a\x00b"], "job_id": "nul"}).encode())
        replies = await asyncio.gather(*(router.client.request(f"{router.prefix}.submit", b, timeout=10)
                                         for b in bodies))
        return [json.loads(r.data) for r in replies]

    replies = router.run(burst())
    assert_error(replies.pop(10), {"invalid_request"})
    assert all(r.get("state") in {"queued", "assigned", "rejected"} for r in replies), replies
    assert router.rows() == 40  # 20 jobs and their changelog rows; nothing of the NUL one


async def test_a_producer_cannot_squat_the_ids_the_router_will_generate(pool, servers, subject_prefix):
    """A generated id must not be guessable from an earlier one. Were it the time, a tag
    fixed per router process and a counter, one reply would tell a producer every id the
    router will make in the next seconds; submitting those ids first (as its own job_ids)
    would make every other producer's submit in that window fail with ``conflict`` for an
    id it never chose (and the same guesses would name other producers' jobs for ``cancel``)."""
    from irisfed.shared.ids import ALPHABET, TIME_CHARS

    def base32(value: int) -> str:
        return "".join(ALPHABET[(value >> (5 * i)) & 31] for i in reversed(range(TIME_CHARS)))

    service_nc, client = await connect_client(servers.nats_url), await connect_client(servers.nats_url)
    router = Router(make_config(subject_prefix=subject_prefix), pool, service_nc)
    await router.start()

    async def submit(body: dict) -> dict:
        reply = await client.request(f"{subject_prefix}.submit", json.dumps(body).encode(), timeout=10)
        return json.loads(reply.data)

    try:
        mine = (await submit({"command": ["true"], "cluster_pin": "home"}))["job_id"]
        made_ms = sum(ALPHABET.index(c) << (5 * i) for i, c in enumerate(reversed(mine[:TIME_CHARS])))
        rest = mine[TIME_CHARS:]  # the tag and the counter: the same for the next ids, but the count 0
        guesses = [base32(ms) + rest[:-3] + "000" for ms in range(made_ms + 1500, made_ms + 6000)]
        for start in range(0, len(guesses), 250):
            await asyncio.gather(*(submit({"job_id": g, "command": ["squat"], "cluster_pin": "home"})
                                   for g in guesses[start:start + 250]))
        async def victim() -> dict:
            # A producer retries ``unavailable`` (the README's advice): under a loaded
            # full run the router may shed a submit right after the squatter's burst.
            # What this test is about is ``conflict``, which is never retried.
            for attempt in range(5):
                reply = await submit({"command": ["echo", "victim"], "cluster_pin": "home"})
                if reply.get("error", {}).get("code") != "unavailable":
                    return reply
                await asyncio.sleep(0.2 * (attempt + 1))
            return reply

        victims = []
        for _ in range(20):  # other producers, in the window the squatter covered
            victims.append(await victim())
            await asyncio.sleep(0.1)
        assert [v.get("error") for v in victims] == [None] * 20, victims
        assert all(not v["duplicate"] for v in victims)
        assert len({v["job_id"] for v in victims}) == 20
    finally:
        await router.close()
        await service_nc.close()
        await client.close()
