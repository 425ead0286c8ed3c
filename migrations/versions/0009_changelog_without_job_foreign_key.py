"""The changelog keeps no foreign key to ``jobs``: the tick's assign is cheaper per job.

``federation_changelog.job_id REFERENCES jobs ON DELETE CASCADE`` (0001) checked, for
every changelog row, that its job exists: a key-share lock of the job's row, taken
right after the same statement wrote that row (7-16 ms per 1,000-job assign, a
quarter of it: docs/performance.md, Tick). The check can never fail for the rows
irisfed writes: every changelog row is inserted from the ``RETURNING`` of the
statement that inserts or updates its job (shared/sql/jobs.sql and the
agents' functions of 0004; tests/integration/test_changelog_follows_jobs.py checks
each), and only the router, the tick and those functions may insert one (0003,
0004). What the key still did is its ``ON DELETE CASCADE``: no service may delete a
job, but an operator (the owner) may, and the job's history went with it. A trigger
on ``jobs`` does that now, once per DELETE statement, so inserts and updates pay
nothing for it.

``federation_sync_state`` keeps its key: agents write their sync state directly
(``sync_state_upsert``), not from a statement that wrote the job, so the key is
what refuses a row for a job that does not exist; and no tick statement writes
sync state. It also keeps ``TRUNCATE jobs`` from leaving history behind (a
truncate must name the referencing table or CASCADE).
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE federation_changelog DROP CONSTRAINT federation_changelog_job_id_fkey")
    op.execute("""
        CREATE FUNCTION jobs_deleted_drop_history() RETURNS trigger
        LANGUAGE plpgsql SET search_path = pg_catalog, public, pg_temp
        AS $fn$
        BEGIN
            DELETE FROM federation_changelog c USING deleted d WHERE c.job_id = d.job_id;
            RETURN NULL;
        END $fn$
    """)
    op.execute("""
        CREATE TRIGGER jobs_deleted_drop_history AFTER DELETE ON jobs
        REFERENCING OLD TABLE AS deleted
        FOR EACH STATEMENT EXECUTE FUNCTION jobs_deleted_drop_history()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_deleted_drop_history ON jobs")
    op.execute("DROP FUNCTION jobs_deleted_drop_history()")
    op.execute("ALTER TABLE federation_changelog ADD CONSTRAINT federation_changelog_job_id_fkey "
               "FOREIGN KEY (job_id) REFERENCES jobs (job_id) ON DELETE CASCADE")
