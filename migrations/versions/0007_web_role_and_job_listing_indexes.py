"""The dashboard's read-only role, and the indexes its job listing needs.

- Group role ``irisfed_web`` (``irisfed web``; its login role comes from ``irisfed
  db-roles``): SELECT on the job table, the changelog, sync state and heartbeats,
  with row security letting it read every row and write none (it has no INSERT,
  UPDATE or DELETE grant, and its policies are FOR SELECT only).
- The Jobs page lists newest first with keyset pagination, optionally filtered by
  state, owner peer, a label or a text: one index per way in, so a page of 50 costs
  the same on a million rows as on a hundred. Text search is a trigram index on
  ``job_id || ' ' || name`` when the server has ``pg_trgm`` (Postgres's contrib);
  without it the text filter still works, by scanning newest first.
- ``jobs_by_state_updated`` (0001) was used by no query: dropped, so a submit pays
  for one index fewer.
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TABLES = ("jobs", "federation_changelog", "federation_sync_state", "peer_heartbeat")
TEXT = "(job_id || ' ' || coalesce(spec->>'name', ''))"


def upgrade() -> None:
    op.execute("""
        DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'irisfed_web') THEN
                CREATE ROLE irisfed_web NOLOGIN;
            END IF;
        END $$
    """)
    op.execute("GRANT USAGE ON SCHEMA public TO irisfed_web")
    op.execute("GRANT SELECT ON alembic_version TO irisfed_web")
    for table in TABLES:
        op.execute(f"GRANT SELECT ON {table} TO irisfed_web")
        op.execute(f"CREATE POLICY {table}_web_read ON {table} FOR SELECT TO irisfed_web USING (true)")

    op.execute("DROP INDEX jobs_by_state_updated")
    op.execute("CREATE INDEX jobs_newest ON jobs (submitted_at DESC, job_id DESC)")
    op.execute("CREATE INDEX jobs_by_state_newest ON jobs (state, submitted_at DESC, job_id DESC)")
    op.execute("CREATE INDEX jobs_by_owner_newest ON jobs (owner_peer_id, submitted_at DESC, job_id DESC)")
    op.execute("CREATE INDEX jobs_by_label ON jobs USING gin ((spec->'labels') jsonb_path_ops)")
    # CREATE EXTENSION needs the contrib files (and the right to create it): without
    # them, no trigram index, and the text filter scans instead.
    op.execute(f"""
        DO $$ BEGIN
            IF EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm') THEN
                CREATE EXTENSION IF NOT EXISTS pg_trgm;
                EXECUTE 'CREATE INDEX jobs_by_text ON jobs USING gin ({TEXT.replace("'", "''")} gin_trgm_ops)';
            END IF;
        END $$
    """)


def downgrade() -> None:
    for name in ("jobs_by_text", "jobs_by_label", "jobs_by_owner_newest", "jobs_by_state_newest", "jobs_newest"):
        op.execute(f"DROP INDEX IF EXISTS {name}")
    op.execute("CREATE INDEX jobs_by_state_updated ON jobs (state, updated_at DESC)")
    for table in TABLES:
        op.execute(f"DROP POLICY {table}_web_read ON {table}")
        op.execute(f"REVOKE ALL ON {table} FROM irisfed_web")
    op.execute("REVOKE ALL ON alembic_version FROM irisfed_web")
    op.execute("REVOKE USAGE ON SCHEMA public FROM irisfed_web")
