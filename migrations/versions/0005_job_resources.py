"""jobs.resources: what a job asks for, normalised (docs/scheduling.md).

The router stores the normalised request (``cpu`` always named); the tick sums the
live jobs' requests per backend to know what is used. Existing rows ask the
default, one cpu.
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""ALTER TABLE jobs ADD COLUMN resources jsonb NOT NULL DEFAULT '{"cpu": 1}'::jsonb""")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs DROP COLUMN resources")
