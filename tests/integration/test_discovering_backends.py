"""Backends still discovering what their engine offers, against real Postgres and NATS:
a peer's own role writing a forged ``discovering`` flag into its heartbeat row, a
discovering backend's hostile name on the Federation page, and a real PeerAgent whose
engine raises, hangs, or answers once and then fails. Until an engine answers, its
backend is heard but offered nothing; after, its last answer holds; and the agent
heartbeats throughout."""

from __future__ import annotations

import asyncio
import json

import msgspec

from irisfed.services.common.peer_view import PeerView
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.backends import Discovered
from irisfed.services.peer_agent.backends.simulated import SimulatedBackend
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.shared.messages import BackendAd, Capacity, Heartbeat, decode_internal, encoder
from irisfed.shared.placement import assign_queued
from irisfed.shared.rooms import QueuedJob
from tests.infra.factories import advertise, make_config
from tests.infra.web import client_for, running_web

WAIT_S = 30  # the longest any step may wait before the test fails (never a timing assertion)


def _row(discovering) -> str:
    return json.dumps([{"name": "slurm", "attributes": {}, "capacity": {"total": 8, "free": 8},
                        "discovering": discovering}])


async def test_a_peers_own_row_with_a_forged_discovering_flag(pool, gpu):
    """Written by the peer's own role: a non-boolean flag skips the row (the peer is not
    heard through it); a real ``true`` is heard, and nothing is placed on it."""
    admin = Store(pool)
    await advertise(admin, "tpu-east", slots=3)
    await gpu.execute(
        "INSERT INTO peer_heartbeat (peer_id, run_id, seq, backends, ttl_s, sent_at, received_at, expires_at) "
        "VALUES ('gpu-west', 'r', 1, $1::jsonb, 1, now(), now(), now() + interval '1 day')", _row("true"))
    for seq, forged in enumerate(["true", 1, None, "yes"], start=1):
        await gpu.execute("UPDATE peer_heartbeat SET seq = $1, backends = $2::jsonb", seq, _row(forged))
        view = PeerView(make_config())
        view.apply_rows(await admin.peer_heartbeat_list())
        assert view.reachable_ids() == ["tpu-east"], forged
    await gpu.execute("UPDATE peer_heartbeat SET seq = 9, backends = $1::jsonb", _row(True))
    view = PeerView(make_config())
    view.apply_rows(await admin.peer_heartbeat_list())
    assert "gpu-west" in view.reachable_ids()
    jobs = [QueuedJob("j1", 0, (), pinned_peer_id="gpu-west"), QueuedJob("j2", 0, (), resources={"cpu": 1})]
    placed, waiting = assign_queued(jobs, view.peers(), {}, view.clock())
    assert [p.peer_id for p in placed] == ["tpu-east"] and placed[0].job_id == "j2"
    assert [v.code for v in waiting[0].verdicts if v.peer_id == "gpu-west"] == ["discovering"]


HOSTILE = '<script>alert(1)</script>[bold]x[/]\x1b[31m\u202e'


async def test_a_discovering_backends_hostile_name_on_the_federation_page(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        ad = BackendAd(HOSTILE, {"k": ["<b>v</b>"]}, Capacity(8, 8), {}, discovering=True)
        body = encoder.encode(Heartbeat("gpu-west", 1, web.clock.now(), 6.0, [ad], run_id="r"))
        page = ""
        for _ in range(WAIT_S * 10):
            await nats_client.publish(web.config.subjects.heartbeat("gpu-west"), body)
            await nats_client.flush()
            page = (await client.get("/")).text
            if 'data-testid="discovering"' in page:
                break
            await asyncio.sleep(0.1)
        assert 'data-testid="discovering"' in page
        assert "<script>alert" not in page and "<b>v</b>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;[bold]x[/]\\x1b[31m\\u202e" in page
        assert "\x1b" not in page and "\u202e" not in page


class EngineDouble(SimulatedBackend):
    """An engine backend whose ``discover`` the test drives: raise, hang or answer."""

    discovers = True

    def __init__(self) -> None:
        super().__init__()
        self.mode = "raise"
        self.answer = Discovered({"device_type": ["gpu"]}, {"gpu": (4.0, 3.0)})
        self.calls = 0
        self.asked = asyncio.Event()
        self.pending = 0  # discover calls started and not yet over (answered, raised or cancelled)

    async def discover(self) -> Discovered | None:
        self.calls += 1
        self.asked.set()
        self.pending += 1
        try:
            if self.mode == "raise":
                raise RuntimeError("engine away")
            if self.mode == "hang":
                await asyncio.Event().wait()
            return self.answer
        finally:
            self.pending -= 1


async def _heartbeats(nc, subject: str) -> tuple[asyncio.Queue, object]:
    heard: asyncio.Queue[Heartbeat] = asyncio.Queue()

    async def on(msg) -> None:
        await heard.put(decode_internal(Heartbeat, msg.data))

    sub = await nc.subscribe(subject, cb=on)
    await nc.flush()
    return heard, sub


async def _next(heard: asyncio.Queue, count: int) -> list[Heartbeat]:
    return [await asyncio.wait_for(heard.get(), WAIT_S) for _ in range(count)]


def _agent(pool, nc, tmp_path, prefix: str, *names: str) -> tuple[PeerAgent, list[EngineDouble]]:
    specs = tuple(BackendSpec(name, "simulated", {}, 4) for name in names)
    agent = PeerAgent(make_config(subject_prefix=prefix), pool, nc,
                      AgentSettings(peer_id="gpu-west", backends=specs, work_root=tmp_path / "work",
                                    heartbeat_interval_s=0.05, heartbeat_ttl_s=1.0, reconcile_interval_s=0.5))
    doubles = []
    for name in names:
        doubles.append(EngineDouble())
        agent.backends[name] = doubles[-1]
    return agent, doubles


async def test_an_engine_that_fails_hangs_then_answers_once_then_fails(pool, nats_client, subject_prefix, tmp_path):
    agent, (engine,) = _agent(pool, nats_client, tmp_path, subject_prefix, "slurm")
    heard, sub = await _heartbeats(nats_client, agent.subjects.heartbeat("gpu-west"))
    await agent.start()
    try:
        # Raising forever: discovering, and the agent keeps heartbeating.
        beats = await _next(heard, 4)
        assert engine.calls >= 1
        assert all(b.backends[0].discovering is True and b.backends[0].resources == {} for b in beats)
        # Hanging forever: still discovering, still heartbeating while a call is stuck.
        engine.mode = "hang"
        engine.asked.clear()
        await asyncio.wait_for(engine.asked.wait(), WAIT_S)
        calls = engine.calls
        beats = await _next(heard, 4)
        assert all(b.backends[0].discovering is True for b in beats)
        assert engine.calls >= calls  # still asked (each call gives up after two intervals)
        # The first answer replaces it with the engine's shape (once the stuck call gave up).
        engine.mode = "answer"
        for _ in range(WAIT_S * 20):
            (beat,) = await _next(heard, 1)
            if not beat.backends[0].discovering:
                break
        backend = beat.backends[0]
        assert backend.discovering is False
        assert backend.attributes == {"device_type": ["gpu"]}
        assert {k: (v.total, v.free) for k, v in backend.resources.items()} == {"gpu": (4.0, 3.0)}
        # Failing (then hanging) afterwards keeps its last answer, and the heartbeats go on.
        engine.mode = "raise"
        calls = engine.calls
        beats = await _next(heard, 6)
        assert engine.calls > calls
        engine.mode = "hang"
        beats += await _next(heard, 6)
        assert all(b.backends[0].discovering is False and b.backends[0].attributes == {"device_type": ["gpu"]}
                   for b in beats)
        (row,) = [r for r in await Store(pool).peer_heartbeat_list() if r.peer_id == "gpu-west"]
        assert row.backends[0]["discovering"] is False
        assert msgspec.convert(row.backends, list[BackendAd])[0].attributes == {"device_type": ["gpu"]}
    finally:
        await sub.unsubscribe()
        await agent.close()


async def test_one_hung_engine_does_not_hold_back_another_engines_discovery(pool, nats_client, subject_prefix,
                                                                          tmp_path):
    """docs/engines.md: discovery at start is bounded by two heartbeat intervals. Were
    engines asked one after another, N hung engines would keep the agent silent for 2N
    intervals (two Slurm partitions: 4 intervals, more than the default 3-interval TTL)
    and every engine behind a hung one would stay discovering as long: they are asked
    at once."""
    agent, (first, second) = _agent(pool, nats_client, tmp_path, subject_prefix, "a", "b")
    first.mode = "hang"
    second.mode = "answer"
    seen_first_pending: list[int] = []
    answer = second.discover

    async def second_discover():
        seen_first_pending.append(first.pending)
        return await answer()

    second.discover = second_discover
    await agent.discover()
    # The second engine was asked while the first was still hung: not after it gave up.
    assert seen_first_pending == [1]
    assert agent.discovered == {"b": second.answer}
    ads = {ad.name: ad.discovering for ad in agent.advertisement()}
    assert ads == {"a": True, "b": False}
    await agent.close()
