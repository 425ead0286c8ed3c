"""Gangs: jobs of many tasks, placed all or nothing (docs/design.md §3.4).

- ``jobs.replicas``: how many tasks the job has (1 for every job made before gangs).
  ``jobs.resources`` stays what *each task* asks; what a live job holds is that times
  ``replicas``, and it takes ``replicas`` slots.
- ``job_tasks``: one row per task of a gang's run (job, epoch, index): the peer and
  node it ran on, its state, exit code and log. Written by the owner agent through
  ``irisfed_job_tasks_report`` (an agent function like migration 0004's: its caller is
  checked; only a job it owns at that epoch takes new rows, and it updates only its own
  rows, so a fenced run still says how its tasks ended); read by every service, the web
  and the CLI. Single-task jobs have none: the job row says it all.
- ``irisfed_job_hand_back``: a gang is ``running`` only once all its tasks run, so its
  agent launches it while it is still ``assigned``; when its tasks do not all start
  (the start timeout, a task that cannot start) the agent hands it back from
  ``assigned``: queued under a new epoch (no owner) while retries remain, else failed,
  or killed when a cancel was stored. The failed start counts as a start (attempts + 1)
  and so as a retry. CAS on (assigned, epoch, owner), changelog and sync state in the
  same statement, like 0004's ``irisfed_job_end_run``.
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
FUNCTION = "irisfed_job_tasks_report(text, text[], bigint[], integer[], text[], text[], integer[], text[])"
HAND_BACK = "irisfed_job_hand_back(text, text, bigint, text, text)"
TASK_STATES = "'pending', 'running', 'succeeded', 'failed', 'killed', 'lost'"


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN replicas integer NOT NULL DEFAULT 1 "
               "CONSTRAINT jobs_replicas_range CHECK (replicas BETWEEN 1 AND 4096)")
    op.execute(f"""
        CREATE TABLE job_tasks (
            job_id      text NOT NULL,
            epoch       bigint NOT NULL,
            task_index  integer NOT NULL CHECK (task_index >= 0),
            peer_id     text NOT NULL,
            node        text,
            state       text NOT NULL CHECK (state IN ({TASK_STATES})),
            exit_code   integer,
            log_path    text,
            updated_at  timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (job_id, epoch, task_index)
        )
    """)
    op.execute("ALTER TABLE job_tasks ENABLE ROW LEVEL SECURITY")
    op.execute("GRANT SELECT ON job_tasks TO irisfed_router, irisfed_tick, irisfed_web, irisfed_agent")
    op.execute("CREATE POLICY job_tasks_read ON job_tasks FOR SELECT "
               "TO irisfed_router, irisfed_tick, irisfed_web, irisfed_agent USING (true)")
    op.execute(f"""
        CREATE FUNCTION irisfed_job_tasks_report(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_indexes integer[], p_nodes text[],
            p_states text[], p_exit_codes integer[], p_logs text[])
        RETURNS integer
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        DECLARE
            written integer;
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            WITH input AS (
                SELECT * FROM unnest(p_job_ids, p_epochs, p_indexes, p_nodes, p_states, p_exit_codes, p_logs)
                    AS t(job_id, epoch, task_index, node, state, exit_code, log_path)
            ), updated AS (
                -- Its own rows, whatever the job is now: a run fenced or handed back still
                -- says how its tasks ended.
                UPDATE job_tasks AS t
                SET node = coalesce(input.node, t.node), state = input.state,
                    exit_code = coalesce(input.exit_code, t.exit_code),
                    log_path = coalesce(input.log_path, t.log_path), updated_at = now()
                FROM input
                WHERE t.job_id = input.job_id AND t.epoch = input.epoch AND t.task_index = input.task_index
                  AND t.peer_id = p_peer
                RETURNING 1
            ), owned AS (
                -- New rows only for a job this peer owns at that epoch, within its replicas.
                SELECT input.* FROM input JOIN jobs ON jobs.job_id = input.job_id
                WHERE jobs.owner_peer_id = p_peer AND jobs.epoch = input.epoch
                  AND input.task_index < jobs.replicas
            ), inserted AS (
                INSERT INTO job_tasks (job_id, epoch, task_index, peer_id, node, state, exit_code, log_path)
                SELECT job_id, epoch, task_index, p_peer, node, state, exit_code, log_path FROM owned
                ON CONFLICT (job_id, epoch, task_index) DO NOTHING
                RETURNING 1
            ), written_rows AS (
                SELECT 1 FROM updated UNION ALL SELECT 1 FROM inserted
            )
            SELECT count(*) INTO written FROM written_rows;
            RETURN written;
        END $fn$
    """)
    op.execute(f"""
        CREATE FUNCTION irisfed_job_hand_back(
            p_peer text, p_job_id text, p_epoch bigint, p_to_state text, p_reason text)
        RETURNS bigint
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        DECLARE
            handed_back constant boolean := p_to_state = 'queued';
            found_seq bigint;
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            IF p_to_state IS NULL OR p_to_state NOT IN ('queued', 'failed', 'killed') THEN
                RAISE EXCEPTION 'an agent hands back its assigned job as queued, failed or killed, not %',
                    coalesce(p_to_state, 'NULL') USING ERRCODE = 'invalid_parameter_value';
            END IF;
            WITH moved AS (
                UPDATE jobs SET
                    state = p_to_state,
                    epoch = CASE WHEN handed_back THEN jobs.epoch + 1 ELSE jobs.epoch END,
                    owner_peer_id = CASE WHEN handed_back THEN NULL ELSE jobs.owner_peer_id END,
                    backend = CASE WHEN handed_back THEN NULL ELSE jobs.backend END,
                    attempts = jobs.attempts + 1,
                    reason = coalesce(p_reason, ''),
                    updated_at = now(),
                    finished_at = CASE WHEN handed_back THEN jobs.finished_at ELSE now() END
                WHERE jobs.job_id = p_job_id AND jobs.state = 'assigned' AND jobs.epoch = p_epoch
                  AND jobs.owner_peer_id = p_peer
                RETURNING jobs.job_id, jobs.epoch, jobs.reason
            ), logged AS (
                INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
                SELECT moved.job_id, 'assigned', p_to_state, p_peer, moved.epoch, p_peer, moved.reason FROM moved
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
            RETURN found_seq;  -- NULL: the CAS lost (not ours, not assigned, or another epoch)
        END $fn$
    """)
    for function in (FUNCTION, HAND_BACK):
        op.execute(f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {function} TO irisfed_agent")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {HAND_BACK}")
    op.execute(f"DROP FUNCTION {FUNCTION}")
    op.execute("DROP TABLE job_tasks")
    op.execute("ALTER TABLE jobs DROP COLUMN replicas")
