"""Jobs that wait for other jobs (docs/design.md §3.8).

- ``job_dependencies``: one row per edge, (``job_id`` waits for ``needs``, on
  ``condition`` ``ok`` | ``any`` | ``failed``), written with the job at submit; the
  index on ``needs`` finds a job's dependents when it ends.
- ``jobs.deps_pending``: how many of a queued job's dependencies have not ended yet.
  The tick claims only queued jobs with none (``jobs_queued_by_user`` is rebuilt with
  ``deps_pending = 0`` in its predicate), so waiting jobs cost a tick pass nothing.
- ``irisfed_dependencies_settle`` (an AFTER UPDATE trigger on ``jobs.state``, for
  every writer alike: agents' finishes, the router's cancels, the tick's recoveries
  and deadlines): when a job ends, each dependent still queued is either one
  dependency closer (the condition met) or ends ``unschedulable`` at once, the reason
  naming the dependency and how it ended, with its changelog row; that end settles
  its own dependents the same way, so a broken chain ends whole. Only a job's
  dependents are touched, through the index, in two set-based statements: nothing
  polls the waiting jobs. When some are released, it notifies channel
  ``irisfed_released`` (delivered at commit), on which ticks listen to place them now
  rather than at their next interval.
- A submit locks its dependencies (``FOR SHARE``) while it counts the ended ones and
  writes its edges: an end racing it waits for the submit's commit and then finds
  the new edges, or committed first and is counted as ended — never stranded.
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
TERMINAL = "('succeeded', 'failed', 'killed', 'rejected', 'unschedulable')"
QUEUED_BY_USER = "jobs (user_id, (-band), (-priority), submitted_at, job_id)"


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN deps_pending integer NOT NULL DEFAULT 0 CHECK (deps_pending >= 0)")
    op.execute("""
        CREATE TABLE job_dependencies (
            job_id     text NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            needs      text NOT NULL,
            condition  text NOT NULL CHECK (condition IN ('ok', 'any', 'failed')),
            PRIMARY KEY (job_id, needs)
        )
    """)
    op.execute("CREATE INDEX job_dependencies_by_needs ON job_dependencies (needs)")
    op.execute("GRANT SELECT, INSERT ON job_dependencies TO irisfed_router")
    op.execute("GRANT SELECT ON job_dependencies TO irisfed_tick, irisfed_web")
    op.execute("DROP INDEX jobs_queued_by_user")
    op.execute(f"CREATE INDEX jobs_queued_by_user ON {QUEUED_BY_USER} WHERE state = 'queued' AND deps_pending = 0")
    op.execute(f"""
        CREATE FUNCTION irisfed_dependencies_settle() RETURNS trigger
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        DECLARE
            released integer;
            shown constant text := CASE WHEN position(':' IN NEW.job_id) > 0
                                        THEN substr(NEW.job_id, position(':' IN NEW.job_id) + 1)
                                        ELSE NEW.job_id END;
        BEGIN
            -- Met: each such dependent one closer, in one statement over the index on needs.
            WITH met AS (
                UPDATE jobs SET deps_pending = jobs.deps_pending - 1, updated_at = now()
                FROM job_dependencies d
                WHERE d.needs = NEW.job_id AND jobs.job_id = d.job_id AND jobs.state = 'queued'
                  AND jobs.deps_pending > 0
                  AND (d.condition = 'any' OR (d.condition = 'ok') = (NEW.state = 'succeeded'))
                RETURNING jobs.deps_pending
            )
            SELECT count(*) INTO released FROM met WHERE met.deps_pending = 0;
            -- Broken: each such dependent ends unschedulable, with its changelog row (and
            -- its own dependents settle the same way, from this trigger on that row).
            WITH moved AS (
                UPDATE jobs SET state = 'unschedulable', updated_at = now(), finished_at = now(),
                                deps_pending = 0,
                                reason = 'dependency ' || shown || ' ended ' || NEW.state
                                         || CASE d.condition WHEN 'ok' THEN '; it had to succeed'
                                            ELSE '; it had to end other than succeeded' END
                FROM job_dependencies d
                WHERE d.needs = NEW.job_id AND jobs.job_id = d.job_id AND jobs.state = 'queued'
                  AND NOT (d.condition = 'any' OR (d.condition = 'ok') = (NEW.state = 'succeeded'))
                RETURNING jobs.job_id, jobs.epoch, jobs.reason
            )
            INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
            SELECT moved.job_id, 'queued', 'unschedulable', NULL, moved.epoch, 'dependency', moved.reason
            FROM moved;
            IF released > 0 THEN
                PERFORM pg_notify('irisfed_released', '');  -- at commit: the ticks place them now
            END IF;
            RETURN NULL;
        END $fn$
    """)
    op.execute("REVOKE ALL ON FUNCTION irisfed_dependencies_settle() FROM PUBLIC")
    op.execute(f"""
        CREATE TRIGGER jobs_dependencies_settle AFTER UPDATE OF state ON jobs FOR EACH ROW
        WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN {TERMINAL})
        EXECUTE FUNCTION irisfed_dependencies_settle()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_dependencies_settle ON jobs")
    op.execute("DROP FUNCTION irisfed_dependencies_settle()")
    op.execute("DROP INDEX jobs_queued_by_user")
    op.execute(f"CREATE INDEX jobs_queued_by_user ON {QUEUED_BY_USER} WHERE state = 'queued'")
    op.execute("DROP TABLE job_dependencies")
    op.execute("ALTER TABLE jobs DROP COLUMN deps_pending")
