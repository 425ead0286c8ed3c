"""The Jobs page's search indexes live on a table written once per job, not on ``jobs``.

Every state change of a job (assign, start, finish: three per job, beside its insert)
writes a new version of its ``jobs`` row, and no such update can be HOT (``state``
and the owner are indexed), so each wrote an entry in every index of ``jobs`` again:
among them three that serve only the dashboard and look only at what never changes,
``jobs_newest`` (submitted_at, job_id) and the two GIN indexes (labels, and trigrams
of id and name, 0007). Measured at 500 submits/s through router, tick and agents
(docs/performance.md, Dispatch path): with those three dropped, Postgres spent 15%
less CPU per job and wrote ~30% less WAL. Here they are paid once, at submit: the
tick's assign costs ~25% less per job and a 100k × 100 tick run is 17-30% faster
(docs/performance.md, Tick).

``job_listing`` holds, per job, exactly what those indexes read: the id, the submit
time, the labels and the searchable text (id and name). The router writes its row
in the statement that inserts the job (shared/sql/jobs.sql,
``job_insert_batch``), from that insert's ``RETURNING``, so a job and its listing row
exist together or not at all, and nothing updates it afterwards (a job's id never
changes, 0010; its spec, submit time, labels and name never do). The page's ways in
that lead with those columns walk ``job_listing`` and join ``jobs`` by its key; the
ways that lead with state or owner stay on ``jobs`` (those columns change).

Keyed by ``job_id``: the router's insert is its only writer and inserts each job once,
so the key costs one index entry per job and refuses a second row for a job (a row
the router role forged for an existing job would otherwise list it twice, and under
labels it does not have). The page reads the table through
``job_listing_newest`` and the GIN indexes and joins ``jobs`` by that key alone (a
join on the submit time as well made Postgres misjudge the join and hash whole
tables: the first page took 190 ms on 100k jobs instead of 2). An operator's DELETE
or TRUNCATE of jobs takes the listing rows along (statement triggers, as 0009 and
0010 do for history).

What the listing copied never changes on ``jobs`` either: a statement that sets
``spec`` or ``submitted_at`` is refused, for every role (the router
and tick roles hold UPDATE on jobs since 0003; moving a job's submit time made the
page's cursor skip every job in between, and left its listing row behind when the job
was deleted, so a resubmit listed it twice; changing its labels or name made the
search find it by what it no longer has). Nothing in irisfed sets them; like 0010's
id trigger it fires only for statements naming those columns.
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
# 0007's trigram expression on jobs, for the downgrade.
JOBS_TEXT = "(job_id || ' ' || coalesce(spec->>'name', ''))"


def _trigram_index(name: str, table: str, expression: str) -> str:
    """CREATE INDEX for ``expression`` with trigrams when the server has pg_trgm (0007)."""
    return f"""
        DO $$ BEGIN
            IF EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm') THEN
                CREATE EXTENSION IF NOT EXISTS pg_trgm;
                EXECUTE 'CREATE INDEX {name} ON {table} USING gin ({expression.replace("'", "''")} gin_trgm_ops)';
            END IF;
        END $$
    """


def upgrade() -> None:
    op.execute("""
        CREATE TABLE job_listing (
            job_id        text PRIMARY KEY,
            submitted_at  timestamptz NOT NULL,
            labels        jsonb NOT NULL,
            search_text   text NOT NULL
        )
    """)
    op.execute("""
        INSERT INTO job_listing (job_id, submitted_at, labels, search_text)
        SELECT job_id, submitted_at, coalesce(spec->'labels', '{}'::jsonb),
               job_id || ' ' || coalesce(spec->>'name', '')
        FROM jobs
    """)
    op.execute("CREATE INDEX job_listing_newest ON job_listing (submitted_at DESC, job_id DESC)")
    op.execute("CREATE INDEX job_listing_by_label ON job_listing USING gin (labels jsonb_path_ops)")
    op.execute(_trigram_index("job_listing_by_text", "job_listing", "search_text"))
    for name in ("jobs_newest", "jobs_by_label", "jobs_by_text"):
        op.execute(f"DROP INDEX IF EXISTS {name}")

    # Only the router writes it (with the job, from its insert); the dashboard reads it.
    # The tick and agents never need it.
    op.execute("GRANT SELECT, INSERT ON job_listing TO irisfed_router")
    op.execute("GRANT SELECT ON job_listing TO irisfed_web")
    op.execute("ALTER TABLE job_listing ENABLE ROW LEVEL SECURITY")
    op.execute("CREATE POLICY job_listing_router ON job_listing TO irisfed_router USING (true) WITH CHECK (true)")
    op.execute("CREATE POLICY job_listing_web_read ON job_listing FOR SELECT TO irisfed_web USING (true)")

    op.execute(f"""
        CREATE FUNCTION jobs_deleted_drop_listing() RETURNS trigger
        LANGUAGE plpgsql {SEARCH_PATH}
        AS $fn$
        BEGIN
            -- By (submitted_at, job_id): a range of job_listing_newest per deleted job.
            DELETE FROM job_listing l USING deleted d
            WHERE l.submitted_at = d.submitted_at AND l.job_id = d.job_id;
            RETURN NULL;
        END $fn$
    """)
    op.execute("""
        CREATE TRIGGER jobs_deleted_drop_listing AFTER DELETE ON jobs
        REFERENCING OLD TABLE AS deleted
        FOR EACH STATEMENT EXECUTE FUNCTION jobs_deleted_drop_listing()
    """)
    op.execute(f"""
        CREATE FUNCTION jobs_truncated_drop_listing() RETURNS trigger
        LANGUAGE plpgsql {SEARCH_PATH}
        AS $fn$
        BEGIN
            TRUNCATE job_listing;
            RETURN NULL;
        END $fn$
    """)
    op.execute("""
        CREATE TRIGGER jobs_truncated_drop_listing AFTER TRUNCATE ON jobs
        FOR EACH STATEMENT EXECUTE FUNCTION jobs_truncated_drop_listing()
    """)
    op.execute(f"""
        CREATE FUNCTION jobs_listed_never_change() RETURNS trigger
        LANGUAGE plpgsql {SEARCH_PATH}
        AS $fn$
        BEGIN
            RAISE EXCEPTION 'a job''s spec and submit time never change (job_listing copied them)'
                USING ERRCODE = 'restrict_violation';
        END $fn$
    """)
    op.execute("""
        CREATE TRIGGER jobs_listed_never_change BEFORE UPDATE OF spec, submitted_at ON jobs
        FOR EACH STATEMENT EXECUTE FUNCTION jobs_listed_never_change()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_listed_never_change ON jobs")
    op.execute("DROP FUNCTION jobs_listed_never_change()")
    op.execute("DROP TRIGGER jobs_truncated_drop_listing ON jobs")
    op.execute("DROP FUNCTION jobs_truncated_drop_listing()")
    op.execute("DROP TRIGGER jobs_deleted_drop_listing ON jobs")
    op.execute("DROP FUNCTION jobs_deleted_drop_listing()")
    op.execute("DROP TABLE job_listing")
    op.execute("CREATE INDEX jobs_newest ON jobs (submitted_at DESC, job_id DESC)")
    op.execute("CREATE INDEX jobs_by_label ON jobs USING gin ((spec->'labels') jsonb_path_ops)")
    op.execute(_trigram_index("jobs_by_text", "jobs", JOBS_TEXT))
