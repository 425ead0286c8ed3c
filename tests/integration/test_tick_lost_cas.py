"""A placement whose compare-and-set loses gives its room back within the same tick run.

The tick claims with ``FOR UPDATE SKIP LOCKED``, so in the running system a CAS loses
only when the row changed under a concurrent writer the lock did not cover. Here a real
Postgres trigger makes the assignment of one job skip its row (``RETURN NULL`` in a
``BEFORE UPDATE`` trigger: the UPDATE matches it and changes nothing), which is what a
lost CAS looks like to the tick: the row is not in ``job_assign_batch``'s RETURNING.
"""

from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick, TickSettings
from tests.infra.factories import advertise_resources, insert_jobs, make_config, make_job

LOSE_ASSIGNMENT_OF = """
CREATE FUNCTION lose_assignment() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.job_id = '{job_id}' AND NEW.state = 'assigned' THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER lose_assignment BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION lose_assignment();
"""


async def _run_tick(store: Store) -> list[tuple[str, str]]:
    # One job per batch, so every later batch is placed after the lost one was released.
    tick = Tick(make_config(), store, None, TickSettings(batch_size=1))
    await tick.refresh_view()
    result = await tick.run_once()
    return [(job_id, peer) for job_id, peer, _ in result.assigned]


async def test_a_lost_compare_and_set_gives_its_gpus_back_to_the_next_jobs_in_the_same_run(pool):
    store = Store(pool)
    await advertise_resources(store, "gpu-west", {"cpu": 16, "memory_mb": 65536, "gpu": 2})
    lost, second, third = (make_job(resources={"gpu": 1}, priority=p) for p in (9, 5, 1))
    await insert_jobs(store, [lost, second, third])
    await pool.execute(LOSE_ASSIGNMENT_OF.format(job_id=lost.job_id))
    try:
        assigned = await _run_tick(store)
    finally:
        await pool.execute("DROP TRIGGER lose_assignment ON jobs; DROP FUNCTION lose_assignment()")

    # Had the lost job's GPU stayed counted, the second job would have taken the last
    # one and the third would have waited for the next run.
    assert assigned == [(second.job_id, "gpu-west"), (third.job_id, "gpu-west")]
    row = await store.job_get(lost.job_id)
    assert (row.state, row.epoch, row.owner_peer_id) == ("queued", 0, None)
    logged = await pool.fetchval("SELECT count(*) FROM federation_changelog WHERE job_id = $1 AND to_state = 'assigned'",
                                 lost.job_id)
    assert logged == 0
    # The next run (trigger gone) finds no room left for it: the two live jobs hold both GPUs.
    assert await _run_tick(store) == []
    assert await store.job_live_usage() == ({("gpu-west", "main"): 2},
                                            {("gpu-west", "main"): {"cpu": 2.0, "gpu": 2.0}})
