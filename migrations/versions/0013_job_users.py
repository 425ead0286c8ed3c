"""Jobs belong to users: ``jobs.user_id``, who asked for a cancel, and per-user indexes.

- ``jobs.user_id``: the user whose job it is (docs/design.md §3.2), ``default`` for
  every job made before users existed (their ids carry no ``<user>:`` part, so
  ``default`` is exactly right). Fixed at submit, never updated.
- ``jobs.cancel_requested_by``: who asked for a stored cancel (``user alice``,
  ``operator (web)``), so the history row that ends the run names them.
- ``jobs_queued_by_user``: the tick claims each user's queue in that user's own
  order (fair share), a range scan per user; its leading column also serves the
  tick's list of users with queued work (a skip scan).
- ``jobs_live_by_user``: what each user's live jobs hold (quota, fair share).
- ``jobs_by_user_newest``: ``irisfed jobs --user`` and the dashboard's user filter.
- ``irisfed_job_finish_batch`` names the requester in a killed run's reason.
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"

_LOGGED_AND_SYNCED = """            ), logged AS (
                INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
                SELECT moved.job_id, 'running', moved.state, p_peer, moved.epoch, p_peer, moved.reason FROM moved
                RETURNING federation_changelog.seq, federation_changelog.job_id, federation_changelog.epoch
            ), synced AS (
                INSERT INTO federation_sync_state (job_id, peer_id, synced_at, changelog_seq, epoch)
                SELECT logged.job_id, p_peer, now(), logged.seq, logged.epoch FROM logged
                ON CONFLICT (job_id, peer_id) DO UPDATE
                SET synced_at = now(), changelog_seq = EXCLUDED.changelog_seq, epoch = EXCLUDED.epoch,
                    note = ''
            )"""


def _finish_batch(killed_reason: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION irisfed_job_finish_batch(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_exit_codes integer[], p_cancelled boolean[])
        RETURNS TABLE (job_id text, state text, reason text)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
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
                                              THEN {killed_reason}
                                              ELSE 'exit code ' || input.exit_code END
                FROM input
                WHERE jobs.job_id = input.job_id AND jobs.state = 'running'
                  AND jobs.epoch = input.epoch AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.state, jobs.reason
{_LOGGED_AND_SYNCED}
            SELECT moved.job_id, moved.state, moved.reason FROM moved;
        END $fn$
    """


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN user_id text NOT NULL DEFAULT 'default', "
               "ADD COLUMN cancel_requested_by text")
    op.execute("CREATE INDEX jobs_queued_by_user ON jobs (user_id, (-priority), submitted_at, job_id) "
               "WHERE state = 'queued'")
    op.execute("CREATE INDEX jobs_live_by_user ON jobs (user_id) WHERE state IN ('assigned', 'running')")
    op.execute("CREATE INDEX jobs_by_user_newest ON jobs (user_id, submitted_at DESC, job_id DESC)")
    op.execute(_finish_batch("'cancelled by ' || coalesce(jobs.cancel_requested_by, 'request')"))


def downgrade() -> None:
    op.execute(_finish_batch("'cancelled by request'"))
    op.execute("DROP INDEX jobs_by_user_newest")
    op.execute("DROP INDEX jobs_live_by_user")
    op.execute("DROP INDEX jobs_queued_by_user")
    op.execute("ALTER TABLE jobs DROP COLUMN cancel_requested_by, DROP COLUMN user_id")
