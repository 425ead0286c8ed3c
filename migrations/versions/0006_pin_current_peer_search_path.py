"""irisfed_current_peer() resolves only the real peer_roles table.

0003 defined it SECURITY DEFINER with ``SET search_path = public``. A search path
that does not name ``pg_temp`` searches the session's temp schema *first* for
tables, so any login role (TEMP is granted to PUBLIC) could create a temp
``peer_roles`` mapping itself to another peer and then, through row security and
the agent functions' caller check, read, kill or hand back that peer's jobs and
rewrite its heartbeat. Now the path is pinned with pg_temp last and the table is
schema-qualified.
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE OR REPLACE FUNCTION irisfed_current_peer() RETURNS text
        LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
        AS $$ SELECT peer_id FROM public.peer_roles WHERE role_name = session_user $$
    """)


def downgrade() -> None:
    op.execute("""
        CREATE OR REPLACE FUNCTION irisfed_current_peer() RETURNS text
        LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public
        AS $$ SELECT peer_id FROM peer_roles WHERE role_name = session_user $$
    """)
