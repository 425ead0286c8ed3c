"""Attack pass, round 13: ``job_listing`` (0011) and the agents' finish rewritten (0012).

Each restricted login role (a peer's agent, router, tick, web) tries to forge,
duplicate, change, hide or remove listing rows, to switch off or replace the new
triggers and functions, and to borrow the new trigger functions on a table of its
own; the agent's finish gets other peers' jobs, stale epochs, jobs that are not
running, NULLs, duplicates and ragged arrays. Hostile names and labels go through
every way into the Jobs page (a router SIGKILLed mid-insert: round 12's test, which
now checks listing rows too); pages are walked
across many jobs sharing one submit time; 0011 and 0012 go up, down and up with
jobs in place.

Found and fixed (0011, jobs.sql):
- the router and tick roles hold UPDATE on ``jobs`` (0003), and moving a job's
  ``submitted_at`` or changing its ``spec`` left the listing's copy behind: the page's
  cursor (the last row's ``jobs.submitted_at``) then skipped every job in between, a
  DELETE left the listing row behind so a resubmit listed the job twice, and a label
  search found a job by labels it no longer had. 0011 now refuses statements setting
  either column (as 0010 does for the id);
- the router role may INSERT listing rows (it writes them with each job), and one it
  forged for an existing job listed that job twice. ``job_listing`` is now keyed by
  the job's id, so a second row for a job is refused.
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
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import assign_jobs, insert_jobs, make_job, running_job
from tests.infra.waiting import wait_for
from tests.integration.conftest import ROLES
from tests.integration.test_attack_round12 import REFUSED
from tests.integration.test_db_roles import as_role
from tests.integration.test_web_pages import client_for, job_ids, running_web

LISTING = "SELECT job_id, submitted_at, labels::text, search_text FROM job_listing ORDER BY job_id"
FINISH = "SELECT job_id, state FROM irisfed_job_finish_batch($1, $2, $3, $4, $5)"
START = "SELECT job_id FROM irisfed_job_start_batch($1, $2, $3, $4, $5)"


async def _refused(conn: asyncpg.Connection, sql: str, *args) -> bool:
    try:
        await conn.execute(sql, *args)
    except REFUSED:
        return True
    return False


async def _listing(pool) -> list[tuple]:
    return [tuple(r) for r in await pool.fetch(LISTING)]


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


# ------------------------------------------------------------------ 1. restricted roles


async def test_no_role_may_change_a_jobs_spec_or_submit_time_behind_its_listing_row(pool, conns):
    """FOUND: before the fix both UPDATEs went through for router and tick ("UPDATE 1"):
    moving the newest job to 2000-01-01 made a page-size-1 walk show that job and stop
    (3 jobs skipped); after a DELETE its listing row stayed and a resubmit was listed
    twice; relabelled, it was still found by its old label and not by its new one."""
    store = Store(pool)
    made = []
    for i in range(4):  # one submit time each
        made.append(make_job(name=f"n{i}", labels={"team": "a"}))
        await insert_jobs(store, [made[-1]])
    newest, oldest = made[-1].job_id, made[0].job_id
    attacks = [
        ("UPDATE jobs SET submitted_at = '2000-01-01' WHERE job_id = $1", newest),
        ("UPDATE jobs SET submitted_at = now() + interval '1 day', priority = 1 WHERE job_id = $1", newest),
        ("UPDATE jobs SET spec = jsonb_set(spec, '{labels}', '{\"team\": \"b\"}') WHERE job_id = $1", oldest),
        ("UPDATE jobs SET spec = spec || '{\"name\": \"renamed\"}' WHERE job_id = $1", oldest),
        ("UPDATE jobs SET spec = spec WHERE job_id = $1", oldest),
    ]
    for name in ("router", "tick"):
        for sql, job_id in attacks:
            with pytest.raises(asyncpg.RestrictViolationError, match="never change"):
                await conns[name].execute(sql, job_id)
    for name in ("agent", "web"):  # no UPDATE on jobs at all
        for sql, job_id in attacks:
            assert await _refused(conns[name], sql, job_id), (name, sql)
    for sql, job_id in attacks:  # nor the owner: nothing in irisfed sets them
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
    """FOUND: before the fix a forged row (an existing job's id, another time, a label
    the job does not have) made every way in list that job twice, and a search for the
    forged label found it. job_listing is now keyed by job id."""
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
    assert await _refused(conns["web"], forged, real.job_id, datetime.now(UTC))


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
            assert await _refused(conn, sql), (name, sql)
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
        assert await _refused(conn, "DELETE FROM decoy"), name
        assert await _refused(conn, "TRUNCATE decoy"), name
    assert await _listing(pool) == before


async def test_only_agents_run_the_finish_and_only_for_their_own_peer(pool, conns):
    admin = Store(pool)
    mine = await running_job(admin, "gpu-west")
    args = (["x"], [1], [0], [False])
    for name in ("router", "tick", "web"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conns[name].fetch(FINISH, "gpu-west", [mine], [1], [0], [False])
    for peer in ("tpu-east", None, "", "GPU-WEST", "gpu-west "):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conns["agent"].fetch(FINISH, peer, *args)
    assert (await admin.job_get(mine)).state == "running"
    # 0012 replaced the body only: who may run it is 0004's (not PUBLIC, the agents).
    acl = await pool.fetchval("SELECT proacl::text FROM pg_proc WHERE proname = 'irisfed_job_finish_batch'")
    entries = acl.strip("{}").split(",")
    assert any(e.startswith("irisfed_agent=X/") for e in entries), acl
    assert not any(e.startswith(("=", "irisfed_router", "irisfed_tick", "irisfed_web")) for e in entries), acl


async def test_the_finish_moves_only_the_peers_running_jobs_at_their_epoch(pool, conns):
    """Others' jobs, stale or future epochs, jobs not running (queued, assigned, finished),
    ids that do not exist, NULLs, duplicates and ragged arrays, as the start function is
    tested in round 12: only what is really this peer's running run at its epoch moves,
    once, and history says exactly that."""
    admin, agent = Store(pool), conns["agent"]
    ok = await running_job(admin, "gpu-west")
    dup = await running_job(admin, "gpu-west")
    cancelled = await running_job(admin, "gpu-west")
    nulled = await running_job(admin, "gpu-west")
    theirs = await running_job(admin, "tpu-east")
    queued, assigned = make_job(), make_job()
    await insert_jobs(admin, [queued, assigned])
    await assign_jobs(admin, [assigned], "gpu-west")
    done = await running_job(admin, "gpu-west")
    assert await admin.job_finish_batch("gpu-west", [(done, 1, 0, False)])
    await admin.job_request_cancel(cancelled)
    rows = "SELECT job_id, state, epoch, exit_code, reason FROM jobs"
    before = {r["job_id"]: tuple(r) for r in await pool.fetch(rows)}

    # Nothing of these moves: stale and future epochs, not running, not theirs, ghosts, NULLs.
    for ids, epochs in (([ok], [0]), ([ok], [2]), ([ok], [None]), ([queued.job_id], [0]),
                        ([assigned.job_id], [1]), ([done], [1]), ([theirs], [1]), (["ghost"], [1]),
                        ([None], [1]), ([ok, ok], [None, 7])):
        assert await agent.fetch(FINISH, "gpu-west", ids, epochs, [0] * len(ids), [False] * len(ids)) == [], ids
    assert await agent.fetch(FINISH, "gpu-west", None, None, None, None) == []
    assert await agent.fetch(FINISH, "gpu-west", [], [], [], []) == []
    # Epochs shorter than ids: unnest pads NULL epochs, which match nothing (as the start's).
    assert await agent.fetch(FINISH, "gpu-west", [theirs, ok], [1], [0, 0], [False, False]) == []
    # A NULL exit code fails the whole call (reason is NOT NULL), as 0004's did: nothing moves.
    with pytest.raises(asyncpg.NotNullViolationError):
        await agent.fetch(FINISH, "gpu-west", [ok, nulled], [1, 1], [0], [False, False])
    after = {r["job_id"]: tuple(r) for r in await pool.fetch(rows)}
    assert after == before

    # A duplicate with different endings: one move, and the row, reply and history agree.
    moved = await agent.fetch(FINISH, "gpu-west", [dup, dup, ok, cancelled, nulled], [1, 1, 1, 1, 1],
                              [0, 5, 0, 0, 3], [False, True, False, None, None])
    assert sorted(r["job_id"] for r in moved) == sorted([dup, ok, cancelled, nulled])
    states = {r["job_id"]: r["state"] for r in moved}
    row = await admin.job_get(dup)
    assert (row.state, row.exit_code, row.reason) in {("succeeded", 0, "exit code 0"),
                                                     ("killed", 5, "cancelled by request")}
    assert states[dup] == row.state
    assert (states[ok], states[cancelled], states[nulled]) == ("succeeded", "killed", "failed")
    for job_id in (dup, ok, cancelled, nulled):
        history = await admin.changelog_list_for_job(job_id)
        assert [(c.from_state, c.to_state, c.actor, c.epoch) for c in history][-1] == (
            "running", states[job_id], "gpu-west", 1)
        assert len(history) == 4
    # A second report moves nothing and writes nothing.
    assert await agent.fetch(FINISH, "gpu-west", [dup, ok], [1, 1], [0, 0], [False, False]) == []
    assert len(await admin.changelog_list_for_job(ok)) == 4
    # The start refuses the same junk the same way (round 12's comparison).
    assert await agent.fetch(START, "gpu-west", [ok, theirs, queued.job_id], [1, 1, 0], None, None) == []
    assert [r["job_id"] for r in await agent.fetch(START, "gpu-west", [assigned.job_id], [1], None, None)] == [
        assigned.job_id]
    await assert_changelog_replays(admin)


async def test_a_cancel_committed_while_the_finish_waits_makes_it_killed(pool, database_url, roles):
    """0012 decides in the UPDATE's SET: when the finish waited on the row a cancel
    held, it re-reads the committed row and the stored cancel wins (0004 decided in a
    join of its own snapshot, before the wait)."""
    admin = Store(pool)
    job_id = await running_job(admin, "gpu-west")
    agent = await asyncpg.connect(as_role(database_url, ROLES["agent"]))
    held = await pool.acquire()
    try:
        cancel = held.transaction()
        await cancel.start()
        assert await held.execute("UPDATE jobs SET cancel_requested = true, cancel_requested_at = now() "
                                  "WHERE job_id = $1", job_id) == "UPDATE 1"
        backend = await agent.fetchval("SELECT pg_backend_pid()")
        finishing = asyncio.ensure_future(agent.fetch(FINISH, "gpu-west", [job_id], [1], [0], [False]))

        async def waiting() -> bool:
            return await pool.fetchval("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                                       backend)
        await wait_for(waiting, "the finish to wait on the row the cancel holds")
        await cancel.commit()
        assert [tuple(r) for r in await finishing] == [(job_id, "killed")]
    finally:
        await pool.release(held)
        await agent.close()
    row = await admin.job_get(job_id)
    assert (row.state, row.reason, row.exit_code) == ("killed", "cancelled by request", 0)


# ------------------------------------------------------------------ 2. hostile names and labels

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


async def test_the_jobs_page_shows_hostile_names_found_by_search_escaped(pool, nats_client, subject_prefix):
    store = Store(pool)
    job = make_job(job_id="h-script", name="<script>alert(1)</script> 100%_x",
                   labels={"t": "<b>x</b>", "\u202e": "\"'"})
    other = make_job(job_id="h-other", name="script alert 1000 x")
    await insert_jobs(store, [job, other])
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        for query in ("text=%3Cscript%3E", "text=100%25_", "text=%25_x", "label=t%3D%3Cb%3Ex%3C%2Fb%3E",
                      "label=%E2%80%AE%3D%22%27"):
            page = await client.get("/jobs?" + query)
            assert page.status_code == 200, query
            assert job_ids(page.text) == ["h-script"], query
            assert "<script>alert" not in page.text and "<b>x</b>" not in page.text
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert job_ids((await client.get("/jobs?text=%25")).text) == ["h-script"]
        assert sorted(job_ids((await client.get("/jobs?text=script")).text)) == ["h-other", "h-script"]


# ------------------------------------------------------------------ 3. consistency


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


# ------------------------------------------------------------------ 4. migrations


async def test_0011_and_0012_go_down_and_up_with_jobs_in_place(empty_database_url):
    url = empty_database_url
    await asyncio.to_thread(dbmod.migrate, url, "0010")
    pool = await dbmod.connect(url, max_size=2, check=False)
    try:
        # Jobs as 0010 wrote them: with and without names and labels, one running.
        await pool.execute(
            "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, owner_peer_id, epoch) VALUES "
            "('named', '{\"name\": \"100%_x\", \"labels\": {\"team\": \"a\"}}', 'h', 'queued', 'queue', NULL, 0), "
            "('bare', '{}', 'h', 'succeeded', 'queue', NULL, 0), "
            "('labelled', '{\"labels\": {\"k\": \"<v>\"}}', 'h', 'running', 'queue', 'gpu-west', 1), "
            "('nulls', '{\"name\": null, \"labels\": null}', 'h', 'running', 'queue', 'gpu-west', 1)")

        async def finish_function() -> tuple:
            return tuple(await pool.fetchrow(
                "SELECT prosrc, proconfig::text, prosecdef, proowner, proacl::text FROM pg_proc "
                "WHERE proname = 'irisfed_job_finish_batch'"))

        async def listing() -> list[tuple]:
            return [tuple(r) for r in await pool.fetch(
                "SELECT job_id, submitted_at, labels::text, search_text FROM job_listing ORDER BY job_id")]

        await asyncio.to_thread(dbmod.migrate, url, "0011")
        as_0004 = await finish_function()
        listed = await listing()
        assert [(r[0], r[2], r[3]) for r in listed] == [
            ("bare", "{}", "bare "), ("labelled", '{"k": "<v>"}', "labelled "),
            ("named", '{"team": "a"}', "named 100%_x"),
            ("nulls", "null", "nulls ")]
        await asyncio.to_thread(dbmod.migrate, url, "0012")
        as_0012 = await finish_function()
        assert as_0012[0] != as_0004[0] and as_0012[1:] == as_0004[1:]
        await asyncio.to_thread(dbmod.downgrade, url, "0011")
        assert await finish_function() == as_0004  # byte for byte, and the same rights
        await asyncio.to_thread(dbmod.downgrade, url, "0010")
        assert await pool.fetchval("SELECT to_regclass('job_listing')") is None
        assert await pool.fetchval("SELECT count(*) FROM pg_proc WHERE proname = 'jobs_listed_never_change'") == 0
        assert await pool.execute("UPDATE jobs SET spec = spec WHERE job_id = 'bare'") == "UPDATE 1"
        await asyncio.to_thread(dbmod.migrate, url, "0012")
        assert await finish_function() == as_0012
        assert await listing() == listed  # the same rows again, from the same jobs
        moved = await pool.fetch("SELECT job_id, state FROM irisfed_job_finish_batch('gpu-west', "
                                 "ARRAY['labelled', 'nulls'], ARRAY[1, 1]::bigint[], ARRAY[0, 2], ARRAY[false, false])")
        assert sorted(tuple(r) for r in moved) == [("labelled", "succeeded"), ("nulls", "failed")]
        await asyncio.to_thread(dbmod.downgrade, url, "0010")
        await asyncio.to_thread(dbmod.migrate, url)
        assert [(r[0], r[2], r[3]) for r in await listing()] == [(r[0], r[2], r[3]) for r in listed]
    finally:
        await pool.close()
