"""History stays with its job: a job's id never changes, and ``TRUNCATE jobs`` takes history along.

0009 dropped the changelog's foreign key to ``jobs`` and kept its ``ON DELETE
CASCADE`` as a trigger, but the key did two more things
(tests/integration/test_changelog_follows_jobs.py):

- Its default ``ON UPDATE NO ACTION`` refused changing a job's id while history named
  it. The router and tick roles hold UPDATE on ``jobs`` (0003): after 0009 either
  could rename a queued job, leaving its history behind for an id no job has and a
  job with no history. Nothing in irisfed changes a job's id, so a statement that
  sets ``job_id`` is refused, for every role; it costs other updates nothing (the
  trigger fires only for statements naming the column).
- ``TRUNCATE jobs CASCADE`` (the owner's) truncated the changelog too; after 0009 it
  left every history row behind. An ``AFTER TRUNCATE`` trigger truncates it again.
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"


def upgrade() -> None:
    op.execute(f"""
        CREATE FUNCTION jobs_id_never_changes() RETURNS trigger
        LANGUAGE plpgsql {SEARCH_PATH}
        AS $fn$
        BEGIN
            RAISE EXCEPTION 'a job''s id never changes (its history and sync state name it)'
                USING ERRCODE = 'restrict_violation';
        END $fn$
    """)
    op.execute("""
        CREATE TRIGGER jobs_id_never_changes BEFORE UPDATE OF job_id ON jobs
        FOR EACH STATEMENT EXECUTE FUNCTION jobs_id_never_changes()
    """)
    op.execute(f"""
        CREATE FUNCTION jobs_truncated_drop_history() RETURNS trigger
        LANGUAGE plpgsql {SEARCH_PATH}
        AS $fn$
        BEGIN
            TRUNCATE federation_changelog;
            RETURN NULL;
        END $fn$
    """)
    op.execute("""
        CREATE TRIGGER jobs_truncated_drop_history AFTER TRUNCATE ON jobs
        FOR EACH STATEMENT EXECUTE FUNCTION jobs_truncated_drop_history()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_truncated_drop_history ON jobs")
    op.execute("DROP FUNCTION jobs_truncated_drop_history()")
    op.execute("DROP TRIGGER jobs_id_never_changes ON jobs")
    op.execute("DROP FUNCTION jobs_id_never_changes()")
