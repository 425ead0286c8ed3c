"""Producers replaying the same submit (same job_id, same body) before, during and
after a Postgres failover (the primary SIGKILLed, Patroni promoting the synchronous
standby): one job_id is one job whatever happens (invariant 2), every answer after
the first acknowledgement says ``duplicate: true``, nothing acknowledged is lost
(invariant 13), and no job runs twice under one epoch nor more times than its
attempts (a replay never starts another run).

The jobs run real processes (the ``subprocess`` backend): each run appends a line
with its epoch to a file named after its job, so runs are counted where they happen,
not from what Postgres says. Some jobs are short (ended before the failover), some run
through it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import asyncpg
import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.federation import Peer
from irisfed.tooling.invariants import assert_changelog_replays
from tests.e2e.conftest import Federation
from tests.infra.ha import fresh_federation, retrying
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

REQUEST_TIMEOUT_S = 5.0  # above the router's ~4 s answer bound
REPLAY_EVERY_S = 0.3
SHORT, LONG, LATE = 12, 12, 12  # jobs ended before the fault, running through it, first sent during it


@pytest.fixture
async def replay_world(patroni, tmp_path, servers, subject_prefix, nats_client):
    peers = [Peer("home", {"device_type": "cpu"}, slots=64, backend="subprocess")]
    async with fresh_federation(patroni, tmp_path, servers, subject_prefix, nats_client, "replay", peers) as fed:
        runs = tmp_path / "runs"
        runs.mkdir()
        yield fed, patroni, runs


class Replayer:
    """One job_id's producer: the same body every REPLAY_EVERY_S until told to stop;
    every answer kept, in order, with the time its request was sent."""

    def __init__(self, fed: Federation, job_id: str, body: dict) -> None:
        self.fed = fed
        self.job_id = job_id
        self.body = body
        self.answers: list[tuple[float, dict | None]] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            self.answers.append((sent, await self.fed.request("submit", self.body, timeout=REQUEST_TIMEOUT_S)))
            await asyncio.sleep(REPLAY_EVERY_S)

    def acks(self) -> list[tuple[float, dict]]:
        return [(t, a) for t, a in self.answers if a is not None and "error" not in a]

    def errors(self) -> set[str]:
        return {a["error"]["code"] for _, a in self.answers if a is not None and "error" in a}


def _body(job_id: str, runs: Path, seconds: float) -> dict:
    line = f'echo "$IRISFED_EPOCH" >> {runs / job_id}; sleep {seconds}'
    return {"job_id": job_id, "command": ["sh", "-c", line]}


async def test_replayed_submits_across_a_failover_are_one_job_each_and_never_run_twice(replay_world):
    fed, cluster, runs = replay_world
    fed.start("router")
    fed.start("tick")
    fed.start("home")
    await fed.wait_router()
    await fed.wait_agent("home")
    tag = uuid.uuid4().hex[:4]
    short = [Replayer(fed, f"s{tag}-{i}", _body(f"s{tag}-{i}", runs, 0.1)) for i in range(SHORT)]
    long = [Replayer(fed, f"l{tag}-{i}", _body(f"l{tag}-{i}", runs, 25)) for i in range(LONG)]
    late = [Replayer(fed, f"z{tag}-{i}", _body(f"z{tag}-{i}", runs, 0.1)) for i in range(LATE)]
    tasks = [asyncio.ensure_future(r.run()) for r in short + long]
    try:
        # Before: every job acknowledged, the short ones ended, the long ones running.
        await wait_for(lambda: _all(r.acks() for r in short + long), "every replayed job acknowledged", timeout=60)

        async def short_ended_long_running():
            rows = {r.job_id: r.state for r in await fed.store.job_list_states()}
            return all(rows.get(r.job_id) in TERMINAL_STATES for r in short) and \
                all(rows.get(r.job_id) == "running" for r in long)
        await wait_for(short_ended_long_running, "the short jobs to end and the long ones to run", timeout=60)

        old = await asyncio.to_thread(cluster.kill_leader)
        tasks += [asyncio.ensure_future(r.run()) for r in late]  # first sent while there is no primary
        await asyncio.to_thread(cluster.wait_leader, 120.0, old)
        promoted = time.monotonic()
        # After: every replayer acknowledged again on the new primary (three times each).
        await wait_for(lambda: _all(sum(1 for t, _ in r.acks() if t > promoted) >= 3 for r in short + long + late),
                       "three acknowledgements of every job on the new primary", timeout=120)
    finally:
        for r in short + long + late:
            r.stop.set()
        await asyncio.gather(*tasks)

    everyone = short + long + late
    for r in everyone:
        assert r.errors() <= {"unavailable"}, (r.job_id, r.errors())
        acks = r.acks()
        assert acks, r.job_id
        # Once acknowledged, every later answer is a duplicate of that job.
        later = [a for _, a in acks[1:] if a.get("duplicate") is not True]
        assert not later, f"{r.job_id}: answered as new after its first acknowledgement: {later[:3]}"
        assert len({a["job_id"] for _, a in acks}) == 1, (r.job_id, {a["job_id"] for _, a in acks})
        first = r.answers[0][1]
        if first is not None and "error" not in first:  # nothing before it could have written the job
            assert first.get("duplicate") is not True, (r.job_id, first)

    # One row per job_id, all on the new primary.
    rows = {r.job_id: r for r in await retrying(fed.store.job_list_states)}
    assert all(r.job_id in rows for r in everyone), sorted(r.job_id for r in everyone if r.job_id not in rows)

    async def ended():
        states = {r.job_id: r.state for r in await retrying(fed.store.job_list_states)}
        return all(states.get(r.job_id) in TERMINAL_STATES for r in everyone)
    await wait_for(ended, "every job to end", timeout=180)
    conn = await asyncpg.connect(cluster.url(fed.database_url.rsplit("/", 1)[1].split("?")[0]))
    try:
        counts = {row["job_id"]: row["n"] for row in await conn.fetch(
            "SELECT job_id, count(*) AS n FROM jobs GROUP BY job_id")}
        attempts = {row["job_id"]: row["attempts"] for row in await conn.fetch("SELECT job_id, attempts FROM jobs")}
    finally:
        await conn.close()
    assert {j: n for j, n in counts.items() if n != 1} == {}

    # Runs, counted where they happen: never two under one epoch, never more than attempts,
    # and a job that ended before the fault ran exactly once.
    for r in everyone:
        path = runs / r.job_id
        epochs = path.read_text().split() if path.exists() else []
        assert epochs, f"{r.job_id} never ran"
        assert len(epochs) == len(set(epochs)), f"{r.job_id} ran twice under one epoch: {epochs}"
        assert len(epochs) <= attempts[r.job_id], (r.job_id, epochs, attempts[r.job_id])
    for r in short:
        epochs = (runs / r.job_id).read_text().split()
        assert len(epochs) == 1, f"{r.job_id} (ended before the fault) ran again after replays: {epochs}"
    await retrying(lambda: assert_changelog_replays(fed.store))


async def _all(values) -> bool:
    return all(values)
