"""Agents change jobs only through narrowly scoped functions.

Under 0003 an agent role could UPDATE its own `jobs` rows freely (spec, epoch,
cancel_requested ...) and INSERT changelog rows with any actor, yet could not
hand its own job back to the queue: the requeued row (owner NULL) failed its
SELECT policy. Now agents have no direct INSERT/UPDATE on `jobs` or
`federation_changelog`; they make exactly their moves through SECURITY DEFINER
functions (search_path pinned), each a compare-and-set on (state, epoch, owner)
that writes the changelog row (peer and actor: the peer itself) and the sync
state in the same statement:

- ``irisfed_job_start_batch``: accept assigned → running (many jobs);
- ``irisfed_job_finish_batch``: running → succeeded | failed | killed by exit
  (a stored cancel makes it killed);
- ``irisfed_job_end_run``: its own running job → queued (epoch + 1, no owner,
  no backend), failed or killed (launch error, orphan after a restart, cancel
  while it was down).

Each checks its caller (``irisfed_check_caller``): a login role that is an agent
(a member of ``irisfed_agent`` or mapped in ``peer_roles``) may act only as its own
peer (``irisfed_current_peer()``); the migration owner (the functions' definer) and
superusers may act for any peer, which is how deployments without roles (services
connect as the owner) call the same functions. EXECUTE goes to ``irisfed_agent``
only (not PUBLIC): router and tick roles cannot call them. Agents keep reading
their own jobs and every changelog row, and writing their own sync state and
heartbeat rows directly (0003's policies).
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Pinned: pg_catalog first so no object anyone creates elsewhere can shadow a built-in.
SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
CHECK = "irisfed_check_caller(text)"
FUNCTIONS = (
    "irisfed_job_start_batch(text, text[], bigint[], text[], text[])",
    "irisfed_job_finish_batch(text, text[], bigint[], integer[], boolean[])",
    "irisfed_job_end_run(text, text, bigint, text, text, integer)",
)


def _logged_and_synced(from_state: str, to_state: str) -> str:
    """The CTEs both batch functions end with: the moved rows' changelog rows (in the
    peer's own name) and their sync state, in the same statement as the move."""
    return f"""            ), logged AS (
                INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
                SELECT moved.job_id, {from_state}, {to_state}, p_peer, moved.epoch, p_peer, moved.reason FROM moved
                RETURNING federation_changelog.seq, federation_changelog.job_id, federation_changelog.epoch
            ), synced AS (
                INSERT INTO federation_sync_state (job_id, peer_id, synced_at, changelog_seq, epoch)
                SELECT logged.job_id, p_peer, now(), logged.seq, logged.epoch FROM logged
                ON CONFLICT (job_id, peer_id) DO UPDATE
                SET synced_at = now(), changelog_seq = EXCLUDED.changelog_seq, epoch = EXCLUDED.epoch,
                    note = ''
            )"""


# As 0004 made it; 0012 replaces it and its downgrade puts this back.
FINISH_BATCH = f"""
        CREATE FUNCTION irisfed_job_finish_batch(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_exit_codes integer[], p_cancelled boolean[])
        RETURNS TABLE (job_id text, state text, reason text)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        #variable_conflict use_column
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            RETURN QUERY
            WITH input AS (
                SELECT * FROM unnest(p_job_ids, p_epochs, p_exit_codes, p_cancelled)
                    AS t(job_id, epoch, exit_code, cancelled)
            ), decided AS (
                SELECT input.*,
                       CASE WHEN input.cancelled OR jobs.cancel_requested THEN 'killed'
                            WHEN input.exit_code = 0 THEN 'succeeded' ELSE 'failed' END AS to_state
                FROM input JOIN jobs ON jobs.job_id = input.job_id AND jobs.owner_peer_id = p_peer
            ), moved AS (
                UPDATE jobs SET state = decided.to_state, exit_code = decided.exit_code,
                                updated_at = now(), finished_at = now(),
                                reason = CASE decided.to_state WHEN 'killed' THEN 'cancelled by request'
                                              ELSE 'exit code ' || decided.exit_code END
                FROM decided
                WHERE jobs.job_id = decided.job_id AND jobs.state = 'running'
                  AND jobs.epoch = decided.epoch AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.state, jobs.reason
{_logged_and_synced("'running'", 'moved.state')}
            SELECT moved.job_id, moved.state, moved.reason FROM moved;
        END $fn$
    """


def upgrade() -> None:
    op.execute(f"""
        CREATE FUNCTION irisfed_check_caller(p_peer text) RETURNS void
        LANGUAGE plpgsql STABLE {SEARCH_PATH}
        AS $fn$
        DECLARE
            me text;
        BEGIN
            -- Called only from the SECURITY DEFINER functions below, so current_user is
            -- their owner; session_user is who logged in (a peer cannot change it).
            IF session_user = current_user
               OR (SELECT rolsuper FROM pg_roles WHERE rolname = session_user) THEN
                RETURN;  -- the migration owner or an admin: no roles set up, any peer
            END IF;
            me := irisfed_current_peer();
            IF me IS NULL AND NOT pg_has_role(session_user, 'irisfed_agent', 'MEMBER') THEN
                RETURN;  -- not an agent: a role an admin let run these (EXECUTE is not PUBLIC)
            END IF;
            IF p_peer IS DISTINCT FROM me THEN
                RAISE EXCEPTION 'role % may act only as peer %, not as %',
                    session_user, coalesce(me, '(none: not a peer role)'), coalesce(p_peer, 'NULL')
                    USING ERRCODE = 'insufficient_privilege';
            END IF;
        END $fn$
    """)
    op.execute(f"""
        CREATE FUNCTION irisfed_job_start_batch(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_log_dirs text[], p_reasons text[])
        RETURNS TABLE (job_id text, spec jsonb, backend text)
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        #variable_conflict use_column
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            RETURN QUERY
            WITH input AS (
                SELECT * FROM unnest(p_job_ids, p_epochs, p_log_dirs, p_reasons)
                    AS t(job_id, epoch, log_dir, reason)
            ), moved AS (
                UPDATE jobs SET state = 'running', attempts = jobs.attempts + 1, started_at = now(),
                                updated_at = now(), log_dir = input.log_dir,
                                reason = coalesce(input.reason, '')
                FROM input
                WHERE jobs.job_id = input.job_id AND jobs.state = 'assigned'
                  AND jobs.epoch = input.epoch AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.reason, jobs.spec, jobs.backend
{_logged_and_synced("'assigned'", "'running'")}
            SELECT moved.job_id, moved.spec, moved.backend FROM moved;
        END $fn$
    """)
    op.execute(FINISH_BATCH)
    op.execute(f"""
        CREATE FUNCTION irisfed_job_end_run(
            p_peer text, p_job_id text, p_epoch bigint, p_to_state text, p_reason text,
            p_exit_code integer DEFAULT NULL)
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
    """)
    # Functions are executable by PUBLIC unless revoked.
    op.execute(f"REVOKE ALL ON FUNCTION {CHECK} FROM PUBLIC")
    for function in FUNCTIONS:
        op.execute(f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {function} TO irisfed_agent")

    # No direct writes of jobs or history: only the functions above.
    op.execute("REVOKE UPDATE ON jobs FROM irisfed_agent")
    op.execute("REVOKE INSERT ON federation_changelog FROM irisfed_agent")
    op.execute("DROP POLICY changelog_own_peer ON federation_changelog")
    op.execute("DROP POLICY jobs_own_peer ON jobs")
    op.execute("""
        CREATE POLICY jobs_own_peer_read ON jobs FOR SELECT TO irisfed_agent
        USING (owner_peer_id = irisfed_current_peer())
    """)


def downgrade() -> None:
    op.execute("DROP POLICY jobs_own_peer_read ON jobs")
    op.execute("""
        CREATE POLICY jobs_own_peer ON jobs TO irisfed_agent
        USING (owner_peer_id = irisfed_current_peer())
        WITH CHECK (owner_peer_id IS NULL OR owner_peer_id = irisfed_current_peer())
    """)
    op.execute("""
        CREATE POLICY changelog_own_peer ON federation_changelog FOR INSERT TO irisfed_agent
        WITH CHECK (peer_id IS NULL OR peer_id = irisfed_current_peer())
    """)
    op.execute("GRANT UPDATE ON jobs TO irisfed_agent")
    op.execute("GRANT INSERT ON federation_changelog TO irisfed_agent")
    for function in FUNCTIONS:
        op.execute(f"DROP FUNCTION {function}")
    op.execute(f"DROP FUNCTION {CHECK}")
