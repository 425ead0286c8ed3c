"""federation_sync_state.note: what a peer did at its last sync of a job.

An agent that rejoins and finds its epoch stale kills its local copy and records
it here (e.g. "stale copy killed: epoch 3 superseded by 4").

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE federation_sync_state ADD COLUMN note text NOT NULL DEFAULT ''")


def downgrade() -> None:
    op.execute("ALTER TABLE federation_sync_state DROP COLUMN note")
