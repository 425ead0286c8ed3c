"""The run contract's counts (docs/design.md §3.7): failure retries, and runs handed
back through no fault of the job.

- ``jobs.failures``: runs that exited non-zero and were run again (at most the spec's
  ``max_failure_retries``). ``jobs.restarts``: runs its own agent handed back after it
  restarted under them (``irisfed up`` stopped, the agent killed). Neither spends a
  retry of ``max_retries`` (``shared.retry``): the starts those count leave them out,
  as they leave out preemptions.
- ``irisfed_job_finish_batch``: a run that exited non-zero while failure retries
  remain goes back to the queue (a new epoch, no owner or backend, ``failures`` + 1)
  instead of ending ``failed``; the reason says which retry it is. Out of them, the
  reason says so.
- ``irisfed_job_end_run`` takes ``p_no_fault``: a hand-back that spends no retry
  (``restarts`` + 1).
"""

import importlib.util
from pathlib import Path

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
END_RUN_OLD = "irisfed_job_end_run(text, text, bigint, text, text, integer)"
END_RUN_NEW = "irisfed_job_end_run(text, text, bigint, text, text, integer, boolean)"


def _migration(name: str):
    spec = importlib.util.spec_from_file_location(f"irisfed_migration_{name[:4]}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A run that exited non-zero (not cancelled) with failure retries left.
_RETRY = ("(NOT (input.cancelled OR jobs.cancel_requested) AND input.exit_code <> 0 "
          "AND jobs.failures < coalesce((jobs.spec->>'max_failure_retries')::int, 0))")
_ALLOWED = "coalesce((jobs.spec->>'max_failure_retries')::int, 0)"

FINISH_BATCH = f"""
        CREATE OR REPLACE FUNCTION irisfed_job_finish_batch(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_exit_codes integer[], p_cancelled boolean[])
        RETURNS TABLE (job_id text, state text, reason text)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        #variable_conflict use_column
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            -- The update decides the ending: its SET reads the row as it was (the stored
            -- cancel, the failures so far).
            RETURN QUERY
            WITH input AS (
                SELECT * FROM unnest(p_job_ids, p_epochs, p_exit_codes, p_cancelled)
                    AS t(job_id, epoch, exit_code, cancelled)
            ), moved AS (
                UPDATE jobs SET state = CASE WHEN input.cancelled OR jobs.cancel_requested THEN 'killed'
                                             WHEN input.exit_code = 0 THEN 'succeeded'
                                             WHEN {_RETRY} THEN 'queued' ELSE 'failed' END,
                                epoch = jobs.epoch + CASE WHEN {_RETRY} THEN 1 ELSE 0 END,
                                owner_peer_id = CASE WHEN {_RETRY} THEN NULL ELSE jobs.owner_peer_id END,
                                backend = CASE WHEN {_RETRY} THEN NULL ELSE jobs.backend END,
                                failures = jobs.failures + CASE WHEN {_RETRY} THEN 1 ELSE 0 END,
                                exit_code = input.exit_code, updated_at = now(),
                                finished_at = CASE WHEN {_RETRY} THEN jobs.finished_at ELSE now() END,
                                reason = CASE WHEN input.cancelled OR jobs.cancel_requested
                                              THEN 'cancelled by ' || coalesce(jobs.cancel_requested_by, 'request')
                                              WHEN input.exit_code = 0 THEN 'exit code 0'
                                              WHEN {_RETRY}
                                              THEN 'exit code ' || input.exit_code || '; running again (failure retry '
                                                   || jobs.failures + 1 || ' of ' || {_ALLOWED} || ')'
                                              WHEN {_ALLOWED} > 0
                                              THEN 'exit code ' || input.exit_code || '; no failure retries left'
                                              ELSE 'exit code ' || input.exit_code END
                FROM input
                WHERE jobs.job_id = input.job_id AND jobs.state = 'running'
                  AND jobs.epoch = input.epoch AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.state, jobs.reason
            ), logged AS (
                INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
                SELECT moved.job_id, 'running', moved.state, p_peer, moved.epoch, p_peer, moved.reason FROM moved
                RETURNING federation_changelog.seq, federation_changelog.job_id, federation_changelog.epoch
            ), synced AS (
                INSERT INTO federation_sync_state (job_id, peer_id, synced_at, changelog_seq, epoch)
                SELECT logged.job_id, p_peer, now(), logged.seq, logged.epoch FROM logged
                ON CONFLICT (job_id, peer_id) DO UPDATE
                SET synced_at = now(), changelog_seq = EXCLUDED.changelog_seq, epoch = EXCLUDED.epoch,
                    note = ''
            )
            SELECT moved.job_id, moved.state, moved.reason FROM moved;
        END $fn$
    """


def _end_run(no_fault: bool) -> str:
    """``irisfed_job_end_run`` as 0004 made it, with (``no_fault``) the ``p_no_fault`` flag."""
    parameter = ", p_no_fault boolean DEFAULT false" if no_fault else ""
    restarts = ("restarts = jobs.restarts + CASE WHEN handed_back AND p_no_fault THEN 1 ELSE 0 END,"
                if no_fault else "")
    return f"""
        CREATE FUNCTION irisfed_job_end_run(
            p_peer text, p_job_id text, p_epoch bigint, p_to_state text, p_reason text,
            p_exit_code integer DEFAULT NULL{parameter})
        RETURNS bigint
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        DECLARE
            handed_back constant boolean := p_to_state = 'queued';
            found_seq bigint;
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            IF p_to_state IS NULL OR p_to_state NOT IN ('queued', 'failed', 'killed') THEN
                RAISE EXCEPTION 'an agent ends its running job as queued, failed or killed, not %',
                    coalesce(p_to_state, 'NULL') USING ERRCODE = 'invalid_parameter_value';
            END IF;
            WITH moved AS (
                UPDATE jobs SET
                    state = p_to_state,
                    epoch = CASE WHEN handed_back THEN jobs.epoch + 1 ELSE jobs.epoch END,
                    owner_peer_id = CASE WHEN handed_back THEN NULL ELSE jobs.owner_peer_id END,
                    backend = CASE WHEN handed_back THEN NULL ELSE jobs.backend END,
                    {restarts}
                    reason = coalesce(p_reason, ''),
                    exit_code = coalesce(p_exit_code, jobs.exit_code),
                    updated_at = now(),
                    finished_at = CASE WHEN handed_back THEN jobs.finished_at ELSE now() END
                WHERE jobs.job_id = p_job_id AND jobs.state = 'running' AND jobs.epoch = p_epoch
                  AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.reason
            ), logged AS (
                INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
                SELECT moved.job_id, 'running', p_to_state, p_peer, moved.epoch, p_peer, moved.reason FROM moved
                RETURNING federation_changelog.seq, federation_changelog.job_id, federation_changelog.epoch
            ), synced AS (
                INSERT INTO federation_sync_state (job_id, peer_id, synced_at, changelog_seq, epoch)
                SELECT logged.job_id, p_peer, now(), logged.seq, logged.epoch FROM logged
                ON CONFLICT (job_id, peer_id) DO UPDATE
                SET synced_at = now(),
                    changelog_seq = greatest(federation_sync_state.changelog_seq, EXCLUDED.changelog_seq),
                    epoch = EXCLUDED.epoch, note = ''
            )
            SELECT logged.seq INTO found_seq FROM logged;
            RETURN found_seq;  -- NULL: the CAS lost (not ours, not running, or another epoch)
        END $fn$
    """


def _grant(function: str) -> None:
    op.execute(f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {function} TO irisfed_agent")


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN failures integer NOT NULL DEFAULT 0 CHECK (failures >= 0), "
               "ADD COLUMN restarts integer NOT NULL DEFAULT 0 CHECK (restarts >= 0)")
    op.execute(FINISH_BATCH)
    op.execute(f"DROP FUNCTION {END_RUN_OLD}")
    op.execute(_end_run(no_fault=True))
    _grant(END_RUN_NEW)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {END_RUN_NEW}")
    op.execute(_end_run(no_fault=False))
    _grant(END_RUN_OLD)
    m0013 = _migration("0013_job_users.py")
    op.execute(m0013._finish_batch("'cancelled by ' || coalesce(jobs.cancel_requested_by, 'request')"))
    op.execute("ALTER TABLE jobs DROP COLUMN restarts, DROP COLUMN failures")
