"""Outputs: what each run's ``IRISFED_OUTPUT_DIR`` held (docs/design.md §3.5).

- ``job_outputs``: one row per file of a run (job, epoch, task, name): its size, and
  whether its bytes are in the object store (``stored``) or were left out (over
  ``max_output_mb``, unreadable, or the store would not take them: ``note`` says which).
  Single-task runs use task 0. The bytes live in the object store; this is what refers
  to them, so a reader never lists the store to find a job's outputs.
- Written by the owner agent through ``irisfed_run_outputs_record`` (checked caller,
  like migration 0004's functions): rows only for a job it owns at that epoch, so a
  fenced run's files are never listed as the job's. Read by every service, the web and
  the CLI. A job's rows go with it (``ON DELETE CASCADE``).
- A workspace needs no column: its digest and size are part of the job's spec.
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
FUNCTION = "irisfed_run_outputs_record(text, text[], bigint[], integer[], text[], bigint[], boolean[], text[])"


def upgrade() -> None:
    op.execute("""
        CREATE TABLE job_outputs (
            job_id      text NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            epoch       bigint NOT NULL,
            task_index  integer NOT NULL CHECK (task_index >= 0),
            name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 1024),
            size        bigint NOT NULL CHECK (size >= 0),
            stored      boolean NOT NULL,
            note        text NOT NULL DEFAULT '',
            peer_id     text NOT NULL,
            stored_at   timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (job_id, epoch, task_index, name)
        )
    """)
    op.execute("ALTER TABLE job_outputs ENABLE ROW LEVEL SECURITY")
    op.execute("GRANT SELECT ON job_outputs TO irisfed_router, irisfed_tick, irisfed_web, irisfed_agent")
    op.execute("CREATE POLICY job_outputs_read ON job_outputs FOR SELECT "
               "TO irisfed_router, irisfed_tick, irisfed_web, irisfed_agent USING (true)")
    op.execute(f"""
        CREATE FUNCTION irisfed_run_outputs_record(
            p_peer text, p_job_ids text[], p_epochs bigint[], p_tasks integer[], p_names text[],
            p_sizes bigint[], p_stored boolean[], p_notes text[])
        RETURNS integer
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        DECLARE
            written integer;
        BEGIN
            PERFORM irisfed_check_caller(p_peer);
            WITH input AS (
                SELECT * FROM unnest(p_job_ids, p_epochs, p_tasks, p_names, p_sizes, p_stored, p_notes)
                    AS t(job_id, epoch, task_index, name, size, stored, note)
            ), owned AS (
                SELECT input.* FROM input JOIN jobs ON jobs.job_id = input.job_id
                WHERE jobs.owner_peer_id = p_peer AND jobs.epoch = input.epoch
                  AND input.task_index < jobs.replicas
            ), written_rows AS (
                INSERT INTO job_outputs (job_id, epoch, task_index, name, size, stored, note, peer_id)
                SELECT job_id, epoch, task_index, name, size, stored, coalesce(note, ''), p_peer FROM owned
                ON CONFLICT (job_id, epoch, task_index, name) DO UPDATE
                SET size = EXCLUDED.size, stored = EXCLUDED.stored, note = EXCLUDED.note, stored_at = now()
                WHERE job_outputs.peer_id = p_peer
                RETURNING 1
            )
            SELECT count(*) INTO written FROM written_rows;
            RETURN written;
        END $fn$
    """)
    op.execute(f"REVOKE ALL ON FUNCTION {FUNCTION} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {FUNCTION} TO irisfed_agent")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {FUNCTION}")
    op.execute("DROP TABLE job_outputs")
