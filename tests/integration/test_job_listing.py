"""``job_listing`` (migration 0011): what the Jobs page searches, written once per job.

- the router's insert writes each new job's listing row in the same statement, from
  the job as inserted (id, submit time, labels, id and name as searchable text), and
  a duplicate submit writes none;
- no state change writes it again (that was the point: the search indexes are not
  paid for on every transition);
- an operator's DELETE or TRUNCATE of jobs takes the listing rows along;
- a job's id, submit time and spec never change under its listing row, and a second
  row for a listed job is refused, so no job is listed twice, skipped by the page's
  cursor or found by labels it does not have;
- only the router may add rows, nobody but the owner may change or remove them, nor
  switch off, replace or borrow the triggers and policies that guard them; the
  dashboard reads them, the tick and agents cannot;
- the page's text search matches the text it is given, never a LIKE pattern, and the
  pages neither repeat nor skip jobs, jobs sharing one submit time included;
- 0011 fills the table from the jobs already there, and its downgrade puts the three
  indexes back on ``jobs``.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.services.web.filters import JobFilter
from irisfed.shared.records import JobPageQuery
from tests.infra.db_roles import ROLES, as_role, refused
from tests.infra.factories import assign_jobs, insert_jobs, make_job, start_jobs
from tests.infra.waiting import wait_for

LISTING = "SELECT job_id, submitted_at, labels, search_text, xmin::text AS version FROM job_listing ORDER BY job_id"


async def _listing(pool) -> dict[str, dict]:
    return {r["job_id"]: dict(r) for r in await pool.fetch(LISTING)}


async def _walk(store: Store, jobs: JobFilter, size: int) -> list[str]:
    """Every page of the job list as the dashboard walks it (its cursor: the last row shown)."""
    seen: list[str] = []
    after = None
    for _ in range(1000):
        base = jobs.query(size + 1)
        rows = await store.job_list_page(JobPageQuery(
            state=base.state, owner_peer_id=base.owner_peer_id, labels=base.labels, text=base.text,
            after=after, limit=size + 1))
        seen += [r.job_id for r in rows[:size]]
        if len(rows) <= size:
            return seen
        after = (rows[size - 1].submitted_at, rows[size - 1].job_id)
    raise AssertionError(f"the walk never ended: {seen[:20]}")


async def _newest_first(pool, where: str = "true", *args) -> list[str]:
    return [r["job_id"] for r in await pool.fetch(
        f"SELECT job_id FROM jobs WHERE {where} ORDER BY submitted_at DESC, job_id DESC", *args)]


async def test_the_insert_lists_each_new_job_once_as_it_was_submitted(pool):
    store = Store(pool)
    named = make_job(name="résumé training", labels={"team": "speech", "run": "7"})
    bare = make_job()
    await insert_jobs(store, [named, bare])
    await insert_jobs(store, [named])  # a duplicate submit: no second row
    listed = await _listing(pool)
    assert set(listed) == {named.job_id, bare.job_id}
    assert listed[named.job_id]["search_text"] == f"{named.job_id} résumé training"
    assert listed[bare.job_id]["search_text"] == f"{bare.job_id} "
    assert listed[bare.job_id]["labels"] == {}
    assert await pool.fetchval("SELECT labels @> '{\"team\": \"speech\"}' FROM job_listing WHERE job_id = $1",
                               named.job_id)
    submitted = {r["job_id"]: r["submitted_at"] for r in await pool.fetch("SELECT job_id, submitted_at FROM jobs")}
    assert {job_id: row["submitted_at"] for job_id, row in listed.items()} == submitted


async def test_state_changes_never_write_the_listing_again(pool):
    store = Store(pool)
    job = make_job(labels={"team": "vision"})
    await insert_jobs(store, [job])
    before = await _listing(pool)
    await assign_jobs(store, [job], "gpu-west")
    await start_jobs(store, [job], "gpu-west")
    await store.job_finish_batch("gpu-west", [(job.job_id, 1, 0, False)])
    assert (await store.job_get(job.job_id)).state == "succeeded"
    assert await _listing(pool) == before  # same row version (xmin): never updated


async def test_the_page_finds_jobs_by_label_and_text_through_the_listing(pool):
    store = Store(pool)
    wanted = make_job(name="nightly-eval", labels={"team": "speech"})
    other = make_job(name="warmup", labels={"team": "vision"})
    await insert_jobs(store, [wanted, other])
    await assign_jobs(store, [wanted], "gpu-west")
    for query in (JobFilter(labels=(("team", "speech"),)).query(10), JobFilter(text="ightly-ev").query(10),
                  JobFilter(text="ightly-ev", state="assigned").query(10),
                  JobFilter(labels=(("team", "speech"),), peer="gpu-west").query(10)):
        rows = await store.job_list_page(query)
        assert [r.job_id for r in rows] == [wanted.job_id], query
        assert rows[0].state == "assigned" and rows[0].labels == {"team": "speech"}
    assert [r.job_id for r in await store.job_list_page(JobFilter().query(10))] == [other.job_id, wanted.job_id]
    assert [r.job_id for r in await store.job_list(None, 10)] == [other.job_id, wanted.job_id]
    assert [r.job_id for r in await store.job_list("queued", 10)] == [other.job_id]


async def test_delete_and_truncate_of_jobs_take_their_listing_rows(pool):
    store = Store(pool)
    gone, kept = make_job(), make_job()
    await insert_jobs(store, [gone, kept])
    assert await pool.execute("DELETE FROM jobs WHERE job_id = $1", gone.job_id) == "DELETE 1"
    assert set(await _listing(pool)) == {kept.job_id}
    await pool.execute("TRUNCATE jobs CASCADE")
    assert await _listing(pool) == {}


async def test_roles_on_the_listing(pool, roles, database_url):
    job = make_job()
    await insert_jobs(Store(pool), [job])
    forged = ("INSERT INTO job_listing (job_id, submitted_at, labels, search_text) "
              "VALUES ('forged', now(), '{}', 'forged')")
    for name, role in ROLES.items():
        conn = await asyncpg.connect(as_role(database_url, role))
        try:
            for sql in (f"UPDATE job_listing SET search_text = 'x' WHERE job_id = '{job.job_id}'",
                        f"DELETE FROM job_listing WHERE job_id = '{job.job_id}'", "TRUNCATE job_listing",
                        "DROP TRIGGER jobs_deleted_drop_listing ON jobs"):
                assert await refused(conn, sql), (name, sql)
            if name in ("agent", "tick"):  # neither needs it; an agent must not read other peers' job names
                assert await refused(conn, "SELECT 1 FROM job_listing LIMIT 1"), name
                assert await refused(conn, forged), name
            else:
                assert await conn.fetchval("SELECT count(*) FROM job_listing WHERE job_id = $1", job.job_id) == 1
                assert await refused(conn, forged) == (name == "web"), name
        finally:
            await conn.close()
    listed = await _listing(pool)
    assert listed[job.job_id]["search_text"] == f"{job.job_id} "


async def test_no_role_may_change_a_jobs_spec_or_submit_time_behind_its_listing_row(pool, conns):
    """The router and tick roles hold UPDATE on ``jobs``, and the listing keeps its own copy
    of a job's submit time and spec (name, labels): were either changed on ``jobs``, the
    page's cursor (the last row's ``jobs.submitted_at``) would skip every job in between
    (moving the newest job to 2000-01-01 makes a page-size-1 walk show it and stop), and a
    relabelled job would be found by its old label and not by its new one. A trigger
    refuses any statement setting either column, for every role and the owner; and a
    deleted job's listing row goes with it, so a resubmit is listed once."""
    store = Store(pool)
    made = []
    for i in range(4):  # one submit time each
        made.append(make_job(name=f"n{i}", labels={"team": "a"}))
        await insert_jobs(store, [made[-1]])
    newest, oldest = made[-1].job_id, made[0].job_id
    changes = [
        ("UPDATE jobs SET submitted_at = '2000-01-01' WHERE job_id = $1", newest),
        ("UPDATE jobs SET submitted_at = now() + interval '1 day', priority = 1 WHERE job_id = $1", newest),
        ("UPDATE jobs SET spec = jsonb_set(spec, '{labels}', '{\"team\": \"b\"}') WHERE job_id = $1", oldest),
        ("UPDATE jobs SET spec = spec || '{\"name\": \"renamed\"}' WHERE job_id = $1", oldest),
        ("UPDATE jobs SET spec = spec WHERE job_id = $1", oldest),
    ]
    for name in ("router", "tick"):
        for sql, job_id in changes:
            with pytest.raises(asyncpg.RestrictViolationError, match="never change"):
                await conns[name].execute(sql, job_id)
    for name in ("agent", "web"):  # no UPDATE on jobs at all
        for sql, job_id in changes:
            assert await refused(conns[name], sql, job_id), (name, sql)
    for sql, job_id in changes:  # nor the owner: nothing in irisfed sets them
        with pytest.raises(asyncpg.RestrictViolationError):
            await pool.execute(sql, job_id)
    # Updates that leave them alone still work (the tick's and router's own statements).
    assert await conns["tick"].execute("UPDATE jobs SET priority = 5 WHERE job_id = $1", newest) == "UPDATE 1"
    expected = [j.job_id for j in reversed(made)]
    assert await _walk(store, JobFilter(), 1) == expected
    assert await _walk(store, JobFilter(labels=(("team", "a"),)), 1) == expected
    assert await _walk(store, JobFilter(labels=(("team", "b"),)), 1) == []
    # Delete and resubmit: listed once.
    await pool.execute("DELETE FROM jobs WHERE job_id = $1", newest)
    assert await pool.fetchval("SELECT count(*) FROM job_listing WHERE job_id = $1", newest) == 0
    await insert_jobs(store, [make_job(job_id=newest)])
    assert await _walk(store, JobFilter(), 2) == expected


async def test_a_listing_row_the_router_forges_lists_no_job_twice_nor_by_false_labels(pool, conns):
    """The router role may INSERT listing rows (it writes one with each job). A second row
    for an existing job (another time, a label the job does not have) would list that job
    twice on every way in and let a search for the forged label find it: ``job_listing``
    is keyed by the job's id, so such a row is refused."""
    store = Store(pool)
    real = make_job(name="real", labels={"team": "a"})
    await insert_jobs(store, [real])
    router = conns["router"]
    forged = ("INSERT INTO job_listing (job_id, submitted_at, labels, search_text) "
              "VALUES ($1, $2, '{\"team\": \"secret\"}', $1 || ' secret-name')")
    # A second row for a listed job, at any time, its own included: refused (job_listing's key).
    submitted = await pool.fetchval("SELECT submitted_at FROM jobs WHERE job_id = $1", real.job_id)
    for at in (datetime.now(UTC) + timedelta(days=1), datetime(2000, 1, 1, tzinfo=UTC), submitted):
        with pytest.raises(asyncpg.UniqueViolationError):
            await router.execute(forged, real.job_id, at)
    for jobs in (JobFilter(), JobFilter(text="real"), JobFilter(text="re"), JobFilter(labels=(("team", "a"),))):
        assert await _walk(store, jobs, 1) == [real.job_id], jobs
    for jobs in (JobFilter(labels=(("team", "secret"),)), JobFilter(text="secret-name")):
        assert await _walk(store, jobs, 1) == [], jobs
    assert [r.job_id for r in await store.job_list(None, 10)] == [real.job_id]
    # The web role reads it and writes nothing.
    assert await refused(conns["web"], forged, real.job_id, datetime.now(UTC))


async def test_no_role_may_switch_off_replace_or_bypass_the_listings_guards(pool, conns):
    job = make_job(labels={"team": "a"})
    await insert_jobs(Store(pool), [job])
    before = await _listing(pool)
    guards = ("jobs_deleted_drop_listing", "jobs_truncated_drop_listing", "jobs_listed_never_change")
    for name, conn in conns.items():
        attempts = ["ALTER TABLE job_listing DISABLE ROW LEVEL SECURITY",
                    "ALTER TABLE job_listing NO FORCE ROW LEVEL SECURITY",
                    "DROP POLICY job_listing_router ON job_listing",
                    "CREATE POLICY mine ON job_listing FOR ALL TO PUBLIC USING (true) WITH CHECK (true)",
                    "DROP INDEX job_listing_newest",
                    "ALTER TABLE job_listing OWNER TO CURRENT_USER",
                    "CREATE TABLE public.job_listing_shadow (x int)",
                    "ALTER FUNCTION irisfed_job_finish_batch(text, text[], bigint[], integer[], boolean[]) "
                    "SECURITY INVOKER",
                    "ALTER FUNCTION irisfed_job_finish_batch(text, text[], bigint[], integer[], boolean[]) "
                    "RESET search_path",
                    "CREATE OR REPLACE FUNCTION public.irisfed_job_finish_batch(p_peer text, p_job_ids text[], "
                    "p_epochs bigint[], p_exit_codes integer[], p_cancelled boolean[]) "
                    "RETURNS TABLE (job_id text, state text, reason text) LANGUAGE sql AS $$ SELECT NULL::text, "
                    "NULL::text, NULL::text $$",
                    "DROP FUNCTION irisfed_job_finish_batch(text, text[], bigint[], integer[], boolean[])",
                    f"UPDATE job_listing SET labels = '{{}}' WHERE job_id = '{job.job_id}'",
                    f"DELETE FROM job_listing WHERE job_id = '{job.job_id}'",
                    "TRUNCATE job_listing"]
        for guard in guards:
            attempts += [f"ALTER TABLE jobs DISABLE TRIGGER {guard}", f"DROP TRIGGER {guard} ON jobs",
                         f"CREATE OR REPLACE FUNCTION public.{guard}() RETURNS trigger LANGUAGE plpgsql "
                         "AS $$ BEGIN RETURN NULL; END $$",
                         f"ALTER FUNCTION public.{guard}() SECURITY DEFINER"]
        for sql in attempts:
            assert await refused(conn, sql), (name, sql)
    assert await _listing(pool) == before
    assert {r["tgname"]: r["tgenabled"] for r in await pool.fetch(
        "SELECT tgname, tgenabled::text FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND tgname = ANY($1)",
        list(guards))} == dict.fromkeys(guards, "O")
    assert await pool.fetchval("SELECT bool_or(prosecdef) FROM pg_proc WHERE proname = ANY($1)", list(guards)) is False
    assert await pool.fetchval("SELECT prosecdef FROM pg_proc WHERE proname = 'irisfed_job_finish_batch'") is True


async def test_the_listing_trigger_functions_on_a_decoy_table_act_with_the_callers_rights(pool, conns):
    """A role may make a temp table and hang the new trigger functions on it: they run
    with that role's rights (none on job_listing beyond the router's INSERT), and their
    pinned search_path (pg_temp last) cannot be pointed at a temp ``job_listing``."""
    store = Store(pool)
    victim = make_job()
    await insert_jobs(store, [victim])
    before = await _listing(pool)
    at = await pool.fetchval("SELECT submitted_at FROM jobs WHERE job_id = $1", victim.job_id)
    for name, conn in conns.items():
        await conn.execute("CREATE TEMP TABLE decoy (job_id text, submitted_at timestamptz)")
        await conn.execute("CREATE TEMP TABLE job_listing (job_id text, submitted_at timestamptz)")
        await conn.execute("CREATE TRIGGER decoy AFTER DELETE ON decoy REFERENCING OLD TABLE AS deleted "
                           "FOR EACH STATEMENT EXECUTE FUNCTION public.jobs_deleted_drop_listing()")
        await conn.execute("CREATE TRIGGER decoy_truncate AFTER TRUNCATE ON decoy "
                           "FOR EACH STATEMENT EXECUTE FUNCTION public.jobs_truncated_drop_listing()")
        await conn.execute("INSERT INTO decoy VALUES ($1, $2)", victim.job_id, at)
        assert await refused(conn, "DELETE FROM decoy"), name
        assert await refused(conn, "TRUNCATE decoy"), name
    assert await _listing(pool) == before


HOSTILE_NAMES = {
    "pct": "100% done",
    "under": "a_b c",
    "back": "back\\slash\\",
    "quote": "it's \"quoted\"",
    "script": "<script>alert(1)</script>",
    "rtl": "evil\u202egnp.exe",
    "uni": "naïve-résumé ✓ 日本",
    "long": "L" * 250 + "-tail",  # the wire's longest name: 256
    "plain": "abXc abc",
    "pct2": "50%",
}
SEARCHES = ["%", "_", "\\", "%_", "100%", "a_b", "\\s", "h\\", "'", "\"quoted\"", "<script>", "</script>",
            "\u202e", "gnp.exe", "résumé", "✓", "日本", "L" * 200, "-tail", "b c", "X", "xc", "abc", "%d",
            "a%b", "a\\_b",
            # Each matches something only as a pattern (a_c: "abc"; X%c: "abXc"; b%c: "back\\slash"):
            "a_c", "X%c", "b%c"]


async def test_hostile_text_searches_find_exactly_the_jobs_containing_them(pool):
    store = Store(pool)
    jobs = {key: make_job(job_id=f"h-{key}", name=name, labels={"k": name, name[:200]: "v"})
            for key, name in HOSTILE_NAMES.items()}
    await insert_jobs(store, list(jobs.values()))
    await assign_jobs(store, [jobs["pct"], jobs["back"], jobs["rtl"]], "gpu-west")
    hay = {job.job_id: f"{job.job_id} {HOSTILE_NAMES[key]}" for key, job in jobs.items()}
    everything = await _newest_first(pool)
    for needle in SEARCHES:
        # Only ASCII letters differ by case here; ILIKE folds them, as lower() does.
        expected = [j for j in everything if needle.lower() in hay[j].lower()]
        assert bool(expected) == (needle not in ("%_", "%d", "a%b", "a\\_b", "a_c", "X%c", "b%c")), needle
        for jobs_filter in (JobFilter(text=needle), JobFilter(text=needle, state="queued"),
                            JobFilter(text=needle, peer="gpu-west"),
                            JobFilter(text=needle, labels=(("k", HOSTILE_NAMES["pct"]),))):
            walked = await _walk(store, jobs_filter, 2)
            want = [j for j in expected if j in await _newest_first(pool, *_where(jobs_filter))]
            assert walked == want, (needle, jobs_filter)
    # Each hostile label finds exactly its job.
    for key, name in HOSTILE_NAMES.items():
        assert await _walk(store, JobFilter(labels=(("k", name),)), 3) == [jobs[key].job_id], key
        assert await _walk(store, JobFilter(labels=((name[:200], "v"),)), 3) == [jobs[key].job_id], key


def _where(jobs: JobFilter) -> tuple:
    """The SQL condition (and its arguments) of ``jobs``'s state, peer and label filters."""
    clauses, args = ["true"], []
    if jobs.state:
        args.append(jobs.state)
        clauses.append(f"state = ${len(args)}")
    if jobs.peer:
        args.append(jobs.peer)
        clauses.append(f"owner_peer_id = ${len(args)}")
    for key, value in jobs.labels:
        args += [key, value]
        clauses.append(f"spec->'labels'->>${len(args) - 1} = ${len(args)}")
    return (" AND ".join(clauses), *args)


async def test_racing_duplicate_and_conflicting_submits_list_a_job_once(pool):
    store = Store(pool)
    first = make_job(job_id="race", name="first", labels={"v": "1"})
    held = await pool.acquire()
    try:
        tx = held.transaction()
        await tx.start()
        assert await Store(held).job_insert_batch([first]) == {"race"}
        # Another router inserts the same id (and, in the same batch, the same job twice)
        # while the first is uncommitted: it waits, then skips.
        racing = asyncio.ensure_future(insert_jobs(store, [
            make_job(job_id="race", name="second", labels={"v": "2"}), make_job(job_id="race", name="third")]))
        backend_waits = ("SELECT count(*) FROM pg_stat_activity "
                         "WHERE wait_event_type = 'Lock' AND datname = current_database()")

        async def waiting() -> bool:
            return await pool.fetchval(backend_waits) >= 1
        await wait_for(waiting, "the second insert to wait on the first")
        await tx.commit()
        await racing
    finally:
        await pool.release(held)
    await insert_jobs(store, [make_job(job_id="race", name="conflict")])
    await insert_jobs(store, [make_job(job_id="twice", name="a"), make_job(job_id="twice", name="b")])
    rows = await pool.fetch("SELECT job_id, search_text, labels::text FROM job_listing ORDER BY job_id")
    assert [tuple(r) for r in rows] == [("race", "race first", '{"v": "1"}'), ("twice", "twice a", "{}")]
    assert (await store.job_get("race")).spec["name"] == "first"


async def test_pages_neither_repeat_nor_skip_jobs_sharing_one_submit_time(pool):
    """One batch shares now(): ties are ordered by id, in the database's collation, on
    both sides of the cursor. Ids mix case, digits, '.', '-' and '_'."""
    store = Store(pool)
    stems = ["a", "A", "b", "B", "a-1", "a.1", "a_1", "a1", "Z", "z", "0", "9", "a-", "a.", "a_", "aa", "aA",
             "a-b", "a.b", "a_b", "x.y.z", "X-Y", "1-1", "1.1", "1_1"]
    batch = [make_job(job_id=f"s{stem}" if stem[0].isalnum() else stem, name=f"tie {i}",
                      labels={"tie": "yes", "odd": str(i % 2)}) for i, stem in enumerate(stems)]
    await insert_jobs(store, [make_job(name="tie before", labels={"tie": "yes"})])
    await insert_jobs(store, batch)
    await insert_jobs(store, [make_job(name="tie after", labels={"tie": "yes"})])
    await assign_jobs(store, batch[::3], "gpu-west")
    assert await pool.fetchval("SELECT count(DISTINCT submitted_at) FROM jobs") == 3
    cases = [(JobFilter(), "true"), (JobFilter(labels=(("tie", "yes"),)), "true"),
             (JobFilter(labels=(("odd", "1"),)), "spec->'labels'->>'odd' = '1'"),
             (JobFilter(text="tie"), "true"), (JobFilter(text="ti"), "true"),
             (JobFilter(text="1"), "(job_id || ' ' || (spec->>'name')) LIKE '%1%'"),
             (JobFilter(state="queued"), "state = 'queued'"),
             (JobFilter(peer="gpu-west"), "owner_peer_id = 'gpu-west'"),
             (JobFilter(peer="gpu-west", text="tie"), "owner_peer_id = 'gpu-west'")]
    for jobs, where in cases:
        expected = await _newest_first(pool, where)
        assert expected
        for size in (1, 2, 4, 7):
            walked = await _walk(store, jobs, size)
            assert walked == expected, (jobs, size)
    # Every job of the batch on the unfiltered walk, once; the CLI's list agrees.
    assert sorted(await _walk(store, JobFilter(), 3)) == sorted(await _newest_first(pool))
    assert [r.job_id for r in await store.job_list(None, 100)] == await _newest_first(pool)


async def test_0011_lists_the_jobs_already_there_and_its_downgrade_restores_the_indexes(empty_database_url):
    url = empty_database_url

    async def indexes(conn) -> set[str]:
        return {r["indexname"] for r in await conn.fetch(
            "SELECT indexname FROM pg_indexes WHERE tablename IN ('jobs', 'job_listing')")}

    await asyncio.to_thread(dbmod.migrate, url, "0010")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) VALUES "
                           "('old-1', '{\"name\": \"n1\", \"labels\": {\"a\": \"b\"}}', 'h', 'queued', 'queue'), "
                           "('old-2', '{}', 'h', 'succeeded', 'queue')")
        assert {"jobs_newest", "jobs_by_label"} <= await indexes(conn)
        await asyncio.to_thread(dbmod.migrate, url, "0011")
        assert [tuple(r) for r in await conn.fetch(
            "SELECT job_id, labels::text, search_text FROM job_listing ORDER BY job_id")] == [
            ("old-1", '{"a": "b"}', "old-1 n1"), ("old-2", "{}", "old-2 ")]
        found = await indexes(conn)
        assert {"job_listing_newest", "job_listing_by_label"} <= found
        assert not found & {"jobs_newest", "jobs_by_label", "jobs_by_text"}
        with_trigrams = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm')")
        assert ("job_listing_by_text" in found) == with_trigrams
        await asyncio.to_thread(dbmod.downgrade, url, "0010")
        found = await indexes(conn)
        assert {"jobs_newest", "jobs_by_label"} <= found and "job_listing_newest" not in found
        assert await conn.fetchval("SELECT to_regclass('job_listing')") is None
    finally:
        await conn.close()
