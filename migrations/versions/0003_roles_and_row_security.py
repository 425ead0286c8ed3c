"""Least privilege in Postgres: group roles per service and row-level security.

- ``irisfed_router`` and ``irisfed_tick`` get only the statements they run.
- ``irisfed_agent`` members (one login role per peer, mapped in ``peer_roles``)
  may read and change only the jobs, sync state and heartbeat rows of their own
  peer, may hand a job back to the queue but never to another peer, and append
  changelog rows only in their own name.
The migrating owner bypasses row security, as do operators' admin connections.
Group roles are cluster-wide: they are created when missing and left in place
on downgrade (other databases may use them). `irisfed db-roles` creates the
login roles.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

GROUPS = ("irisfed_router", "irisfed_tick", "irisfed_agent")
SERVICES = "irisfed_router, irisfed_tick"


def upgrade() -> None:
    for role in GROUPS:
        op.execute(f"""
            DO $$ BEGIN
                IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
                    CREATE ROLE {role} NOLOGIN;
                END IF;
            END $$
        """)
    op.execute("""
        CREATE TABLE peer_roles (
            role_name  text PRIMARY KEY,
            peer_id    text NOT NULL UNIQUE
        )
    """)
    # SECURITY DEFINER so agents need no access beyond their own mapping; session_user
    # is the login role even inside the function.
    op.execute("""
        CREATE FUNCTION irisfed_current_peer() RETURNS text
        LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public
        AS $$ SELECT peer_id FROM peer_roles WHERE role_name = session_user $$
    """)
    for role in GROUPS:
        op.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        op.execute(f"GRANT SELECT ON alembic_version TO {role}")
    op.execute("GRANT SELECT, INSERT, UPDATE ON jobs TO irisfed_router")
    op.execute("GRANT SELECT, UPDATE ON jobs TO irisfed_tick, irisfed_agent")
    op.execute(f"GRANT SELECT, INSERT ON federation_changelog TO {SERVICES}, irisfed_agent")
    op.execute("GRANT SELECT ON peer_heartbeat TO irisfed_router")
    # Ticks write the heartbeats they hear on NATS, in batches.
    op.execute("GRANT SELECT, INSERT, UPDATE ON peer_heartbeat TO irisfed_tick")
    op.execute("GRANT SELECT, INSERT, UPDATE ON peer_heartbeat, federation_sync_state TO irisfed_agent")
    op.execute("GRANT EXECUTE ON FUNCTION irisfed_current_peer() TO irisfed_agent")

    op.execute("ALTER TABLE jobs ENABLE ROW LEVEL SECURITY")
    op.execute(f"CREATE POLICY jobs_services ON jobs TO {SERVICES} USING (true) WITH CHECK (true)")
    op.execute("""
        CREATE POLICY jobs_own_peer ON jobs TO irisfed_agent
        USING (owner_peer_id = irisfed_current_peer())
        WITH CHECK (owner_peer_id IS NULL OR owner_peer_id = irisfed_current_peer())
    """)
    op.execute("ALTER TABLE federation_changelog ENABLE ROW LEVEL SECURITY")
    op.execute(f"CREATE POLICY changelog_services ON federation_changelog TO {SERVICES} USING (true) WITH CHECK (true)")
    op.execute("CREATE POLICY changelog_read ON federation_changelog FOR SELECT TO irisfed_agent USING (true)")
    op.execute("""
        CREATE POLICY changelog_own_peer ON federation_changelog FOR INSERT TO irisfed_agent
        WITH CHECK (peer_id IS NULL OR peer_id = irisfed_current_peer())
    """)
    op.execute("ALTER TABLE federation_sync_state ENABLE ROW LEVEL SECURITY")
    op.execute("""
        CREATE POLICY sync_state_own_peer ON federation_sync_state TO irisfed_agent
        USING (peer_id = irisfed_current_peer()) WITH CHECK (peer_id = irisfed_current_peer())
    """)
    op.execute("ALTER TABLE peer_heartbeat ENABLE ROW LEVEL SECURITY")
    op.execute("CREATE POLICY heartbeat_read ON peer_heartbeat FOR SELECT TO irisfed_router USING (true)")
    op.execute("CREATE POLICY heartbeat_tick ON peer_heartbeat TO irisfed_tick USING (true) WITH CHECK (true)")
    op.execute("""
        CREATE POLICY heartbeat_own_peer ON peer_heartbeat TO irisfed_agent
        USING (peer_id = irisfed_current_peer()) WITH CHECK (peer_id = irisfed_current_peer())
    """)


def downgrade() -> None:
    for table, policies in (
        ("peer_heartbeat", ("heartbeat_read", "heartbeat_tick", "heartbeat_own_peer")),
        ("federation_sync_state", ("sync_state_own_peer",)),
        ("federation_changelog", ("changelog_services", "changelog_read", "changelog_own_peer")),
        ("jobs", ("jobs_services", "jobs_own_peer")),
    ):
        for policy in policies:
            op.execute(f"DROP POLICY {policy} ON {table}")
        op.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
    for role in GROUPS:
        op.execute(f"REVOKE ALL ON jobs, federation_changelog, federation_sync_state, peer_heartbeat, "
                   f"alembic_version FROM {role}")
        op.execute(f"REVOKE USAGE ON SCHEMA public FROM {role}")
    op.execute("DROP FUNCTION irisfed_current_peer()")
    op.execute("DROP TABLE peer_roles")
