"""Priority bands and preemption (docs/design.md §3.3).

- ``jobs.band``: the job's band as its rank (0 ``batch``, 1 ``interactive``, 2
  ``production``; shared/bands.py), fixed at submit. Every job made before bands
  existed is ``interactive``, the default band.
- ``jobs.preemptions``: how many times the job was preempted (never counted as a
  retry; ``max_preemptions`` in its spec caps it).
- ``jobs_queued_by_user`` is rebuilt with the band first: each user's queue is
  claimed band first, then priority, then submit time.
- ``jobs_live_by_band``: the tick lists the live jobs of lower bands (the ones a
  waiting job may preempt) as a range of this partial index, only when one is needed.
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN band smallint NOT NULL DEFAULT 1, "
               "ADD COLUMN preemptions integer NOT NULL DEFAULT 0")
    op.execute("ALTER TABLE jobs ADD CONSTRAINT jobs_band_known CHECK (band BETWEEN 0 AND 2)")
    op.execute("DROP INDEX jobs_queued_by_user")
    op.execute("CREATE INDEX jobs_queued_by_user ON jobs (user_id, (-band), (-priority), submitted_at, job_id) "
               "WHERE state = 'queued'")
    op.execute("CREATE INDEX jobs_live_by_band ON jobs (band, owner_peer_id) "
               "WHERE state IN ('assigned', 'running')")


def downgrade() -> None:
    op.execute("DROP INDEX jobs_live_by_band")
    op.execute("DROP INDEX jobs_queued_by_user")
    op.execute("CREATE INDEX jobs_queued_by_user ON jobs (user_id, (-priority), submitted_at, job_id) "
               "WHERE state = 'queued'")
    op.execute("ALTER TABLE jobs DROP CONSTRAINT jobs_band_known")
    op.execute("ALTER TABLE jobs DROP COLUMN preemptions, DROP COLUMN band")
