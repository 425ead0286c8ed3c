"""A preempted job waits for its old run to stop before it is placed again.

A running job preempted goes back to ``queued`` at once (its epoch bumped: the run is
fenced), but its old run lives until its agent kills it. Placed again elsewhere while
that agent is down, the job would run under two epochs at once. So:

- ``jobs.stopping_on``: the peer whose run of a preempted job has not been seen to
  stop yet (NULL: none). The tick claims no queued job that has one.
- ``irisfed_job_runs_stopped(peer, only, keep)``: that peer says its runs are gone:
  clears ``stopping_on`` of its queued jobs (those in ``only`` when given), except
  those in ``keep`` (runs it still has). An agent function like migration 0004's
  (caller checked, EXECUTE for ``irisfed_agent`` only); the tick clears it itself for
  a peer lost past TTL + grace.
- ``jobs_stopping_on``: a partial index, so each agent's reconcile and the tick's
  lost-peer pass cost a range of the few rows waiting.
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
FUNCTION = "irisfed_job_runs_stopped(text, text[], text[])"


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN stopping_on text")
    op.execute("CREATE INDEX jobs_stopping_on ON jobs (stopping_on) "
               "WHERE state = 'queued' AND stopping_on IS NOT NULL")
    op.execute(f"""
        CREATE FUNCTION irisfed_job_runs_stopped(p_peer text, p_only text[], p_keep text[])
        RETURNS SETOF text
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            RETURN QUERY
            UPDATE jobs SET stopping_on = NULL, updated_at = now()
            WHERE jobs.state = 'queued' AND jobs.stopping_on = p_peer
              AND (p_only IS NULL OR jobs.job_id = ANY(p_only))
              AND NOT (jobs.job_id = ANY(coalesce(p_keep, '{{}}'::text[])))
            RETURNING jobs.job_id;
        END $fn$
    """)
    op.execute(f"REVOKE ALL ON FUNCTION {FUNCTION} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {FUNCTION} TO irisfed_agent")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {FUNCTION}")
    op.execute("DROP INDEX jobs_stopping_on")
    op.execute("ALTER TABLE jobs DROP COLUMN stopping_on")
