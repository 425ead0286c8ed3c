"""A tick pass reads the claim, the users with queued work, the counts and (where
they apply) usage and victims in one round trip, guessing the queue's users and top
band from the pass before. These check the guess is never trusted past what the
listing says: new users are claimed, a band that rose reads its victims, and a
queue whose shape held costs one claim."""

from __future__ import annotations

from irisfed.services.common.store import Store
from irisfed.services.tick.service import QueueShape, Tick
from tests.infra.factories import advertise, insert_jobs, make_config, user_job

USERS = [{"id": "alice", "max_band": "production"}, {"id": "bob", "max_band": "production"}]


async def users_tick(pool, slots: int) -> tuple[Store, Tick]:
    """gpu-west advertising ``slots``, and a tick (with its view) of a federation of USERS."""
    store = Store(pool)
    await advertise(store, "gpu-west", slots=slots)
    tick = Tick(make_config(users=USERS), pool, None)
    await tick.refresh_view()
    return store, tick


def counting_claims(tick: Tick) -> list[tuple[str, ...]]:
    """Every claim the tick opens, as the users it claims for."""
    claims: list[tuple[str, ...]] = []
    claim = tick._claim

    async def counted(bound, cursor):
        claims.append(tuple(sorted(cursor)))
        return await claim(bound, cursor)

    tick._claim = counted
    return claims


async def placed_with_one_claim(store: Store, tick: Tick, job) -> None:
    """``job`` submitted, the next pass places it and claims once, for its user alone."""
    claims = counting_claims(tick)
    await insert_jobs(store, [job])
    result = await tick.run_once()
    assert [job_id for job_id, _, _ in result.assigned] == [job.job_id]
    assert claims == [(job.user_id,)]


async def test_users_new_since_the_last_pass_are_claimed_in_the_same_pass(pool):
    store, tick = await users_tick(pool, slots=50)
    await insert_jobs(store, [user_job("alice", f"a{i}") for i in range(3)])
    first = await tick.run_once()
    assert len(first.assigned) == 3
    assert tick.queue_shape.users == ("alice",)
    claims = counting_claims(tick)
    await insert_jobs(store, [user_job("alice", "a9"), user_job("bob", "b0"), user_job("bob", "b1")])
    second = await tick.run_once()
    assert sorted(job_id for job_id, _, _ in second.assigned) == ["alice:a9", "bob:b0", "bob:b1"]
    # The guess (alice alone) was claimed, then all of them once the listing said so.
    assert claims == [("alice",), ("alice", "bob")]
    assert tick.queue_shape == QueueShape(("alice", "bob"), 1, True)


async def test_a_queue_whose_shape_held_costs_one_claim(pool):
    store, tick = await users_tick(pool, slots=50)
    await insert_jobs(store, [user_job("alice", "x0")])
    await tick.run_once()
    await placed_with_one_claim(store, tick, user_job("alice", "x1"))


async def test_a_band_that_rose_since_the_last_pass_reads_its_victims(pool):
    store, tick = await users_tick(pool, slots=1)
    await insert_jobs(store, [user_job("alice", "low", band="batch")])
    assert [j for j, _, _ in (await tick.run_once()).assigned] == ["alice:low"]
    assert tick.queue_shape.top_band == 0  # batch: nothing below it, no victims read
    await insert_jobs(store, [user_job("bob", "high", band="production")])
    result = await tick.run_once()
    # Guessed batch (no victims); the listing said production: victims read, one preempted.
    assert [v.job_id for v in result.preempted] == ["alice:low"]
    assert [j for j, _, _ in result.assigned] == ["bob:high"]


async def test_an_emptied_queue_leaves_no_claim_open(pool):
    store, tick = await users_tick(pool, slots=5)
    await insert_jobs(store, [user_job("alice", "only")])
    await tick.run_once()
    result = await tick.run_once()  # guesses alice; the listing says nobody
    assert result.assigned == []
    locks = await pool.fetchval("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                                "WHERE a.state = 'idle in transaction'")
    assert locks == 0


async def test_a_pass_over_an_empty_queue_keeps_the_guess_for_the_next_submit(pool):
    """Every freed slot wakes a pass that finds nothing queued; the next submit's pass
    must still claim in its first round trip, not guess "nobody" and claim again."""
    store, tick = await users_tick(pool, slots=5)
    await insert_jobs(store, [user_job("alice", "first")])
    await tick.run_once()
    assert (await tick.run_once()).assigned == []  # the queue is empty
    assert tick.queue_shape.users == ("alice",)
    await placed_with_one_claim(store, tick, user_job("alice", "next"))


async def test_idle_passes_read_no_victims_and_no_usage(pool):
    """A busy federation with nothing queued: past the first, its passes read neither
    what may be preempted nor what each user holds (both may be many rows), however the
    last queue looked."""
    store, tick = await users_tick(pool, slots=1)
    await insert_jobs(store, [user_job("alice", "low", band="batch")])
    await tick.run_once()
    await insert_jobs(store, [user_job("bob", "high", band="production")])
    assert [v.job_id for v in (await tick.run_once()).preempted] == ["alice:low"]
    await pool.execute("UPDATE jobs SET state = 'failed', epoch = epoch + 1 WHERE state = 'queued'")
    await tick.run_once()  # the first pass with nothing queued still goes by the last queue's shape
    reads = []
    for name in ("job_list_preemptible", "job_live_usage_by_user"):
        read = getattr(tick.store, name)

        async def counted(*args, read=read, name=name):
            reads.append(name)
            return await read(*args)
        setattr(tick.store, name, counted)
    for _ in range(3):
        assert (await tick.run_once()).assigned == []  # the queue is empty: idle passes
    assert reads == []


async def test_victims_are_read_only_where_a_lower_band_is_live(pool):
    store, tick = await users_tick(pool, slots=1)
    reads = []
    preemptible = tick.store.job_list_preemptible

    async def counted(band, peers):
        reads.append(band)
        return await preemptible(band, peers)

    tick.store.job_list_preemptible = counted
    # Interactive work (the default band) with nothing below it live: nothing to read, and
    # the waiting job still says why it preempts nothing.
    await insert_jobs(store, [user_job("alice", "i0"), user_job("alice", "i1")])
    await tick.run_once()
    await tick.run_once()
    assert reads == []
    waiting = await store.job_get("alice:i1")
    assert waiting.reason.endswith("cannot preempt: no job of a lower band runs on a backend that could hold it")
