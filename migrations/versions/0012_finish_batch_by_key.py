"""An agent's finish statement finds its jobs by key, not by every job its peer ever ran.

0004's ``irisfed_job_finish_batch`` read each job's stored cancel in a join of its own
before the update: ``input JOIN jobs ON job_id AND owner_peer_id = p_peer``. With no
state in that join, the index that fits it best is ``jobs_by_owner_newest`` (0007),
every job the peer has ever owned, and Postgres took it whenever its statistics
lagged behind a growing table (a fresh deployment, a burst): a hash of all of them per
call. Seen at 500 jobs/s (docs/performance.md, Dispatch path): 1,030 rows read to
finish 9, ~5 ms a call, and growing with the peer's history. The update now decides
the ending itself (``SET`` reads the row as it was, so a stored cancel still makes
it ``killed``), with the same compare-and-set on (state, epoch, owner), which
``jobs_live_by_owner`` (live rows only) or the key serve. What it returns, writes to
history and to sync state is unchanged.
"""

import importlib.util
from pathlib import Path

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def _migration_0004():
    spec = importlib.util.spec_from_file_location(
        "irisfed_migration_0004", Path(__file__).with_name("0004_agent_job_functions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    m0004 = _migration_0004()
    op.execute(f"""
        CREATE OR REPLACE FUNCTION irisfed_job_finish_batch(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_exit_codes integer[], p_cancelled boolean[])
        RETURNS TABLE (job_id text, state text, reason text)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {m0004.SEARCH_PATH}
        AS $fn$
        #variable_conflict use_column
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            -- The update decides the ending: its SET reads the row as it was (the stored cancel).
            RETURN QUERY
            WITH input AS (
                SELECT * FROM unnest(p_job_ids, p_epochs, p_exit_codes, p_cancelled)
                    AS t(job_id, epoch, exit_code, cancelled)
            ), moved AS (
                UPDATE jobs SET state = CASE WHEN input.cancelled OR jobs.cancel_requested THEN 'killed'
                                             WHEN input.exit_code = 0 THEN 'succeeded' ELSE 'failed' END,
                                exit_code = input.exit_code, updated_at = now(), finished_at = now(),
                                reason = CASE WHEN input.cancelled OR jobs.cancel_requested
                                              THEN 'cancelled by request'
                                              ELSE 'exit code ' || input.exit_code END
                FROM input
                WHERE jobs.job_id = input.job_id AND jobs.state = 'running'
                  AND jobs.epoch = input.epoch AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.state, jobs.reason
{m0004._logged_and_synced("'running'", 'moved.state')}
            SELECT moved.job_id, moved.state, moved.reason FROM moved;
        END $fn$
    """)


def downgrade() -> None:
    op.execute(_migration_0004().FINISH_BATCH.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
