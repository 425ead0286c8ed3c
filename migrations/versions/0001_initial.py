"""Initial schema: jobs, federation_changelog, federation_sync_state, peer_heartbeat.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STATES = "'queued','assigned','running','succeeded','failed','killed','rejected','unschedulable'"


def upgrade() -> None:
    op.execute(f"""
        CREATE TABLE jobs (
            job_id            text PRIMARY KEY,
            spec              jsonb NOT NULL,
            spec_hash         text NOT NULL,
            state             text NOT NULL CHECK (state IN ({STATES})),
            disposition       text NOT NULL CHECK (disposition IN ('local','queue','reject')),
            pinned_peer_id    text,
            owner_peer_id     text,
            -- the owner's backend that runs it (capacity is accounted per peer and backend)
            backend           text,
            epoch             bigint NOT NULL DEFAULT 0 CHECK (epoch >= 0),
            attempts          integer NOT NULL DEFAULT 0,
            max_retries       integer NOT NULL DEFAULT 0 CHECK (max_retries >= 0),
            priority          integer NOT NULL DEFAULT 0,
            -- peers this job must not go back to (lost while running it)
            avoid_peers       text[] NOT NULL DEFAULT '{{}}',
            submitted_at      timestamptz NOT NULL DEFAULT now(),
            updated_at        timestamptz NOT NULL DEFAULT now(),
            assigned_at       timestamptz,
            started_at        timestamptz,
            finished_at       timestamptz,
            deadline_at       timestamptz,
            exit_code         integer,
            -- where the owner keeps stdout/stderr (a path on the owner's machine)
            log_dir           text,
            reason            text NOT NULL DEFAULT '',
            -- the routing/tick explanation of the latest decision, for `irisfed explain`
            explanation       jsonb,
            -- the first reply sent to the producer, returned again to duplicates
            submit_reply      jsonb NOT NULL,
            cancel_requested  boolean NOT NULL DEFAULT false,
            cancel_requested_at timestamptz
        )
    """)
    # The tick's claim scans queued jobs in priority order; a partial index keeps that
    # scan proportional to the queue, not to the table.
    op.execute(
        "CREATE INDEX jobs_queued_by_priority ON jobs ((-priority), submitted_at, job_id) "
        "WHERE state = 'queued'"
    )
    # Agents reconcile their own live jobs; the tick looks for live jobs of lost peers.
    op.execute(
        "CREATE INDEX jobs_live_by_owner ON jobs (owner_peer_id, state) "
        "WHERE state IN ('assigned','running')"
    )
    op.execute("CREATE INDEX jobs_by_state_updated ON jobs (state, updated_at DESC)")

    op.execute(f"""
        CREATE TABLE federation_changelog (
            seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            job_id      text NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            from_state  text CHECK (from_state IN ({STATES})),
            to_state    text NOT NULL CHECK (to_state IN ({STATES})),
            peer_id     text,
            epoch       bigint NOT NULL,
            at          timestamptz NOT NULL DEFAULT now(),
            actor       text NOT NULL,
            detail      text NOT NULL DEFAULT ''
        )
    """)
    op.execute("CREATE INDEX federation_changelog_by_job ON federation_changelog (job_id, seq)")
    # Append-only: the database refuses edits, not just the code.
    op.execute("""
        CREATE FUNCTION federation_changelog_append_only() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'federation_changelog is append-only';
        END $$
    """)
    op.execute("""
        CREATE TRIGGER federation_changelog_no_update
        BEFORE UPDATE ON federation_changelog
        FOR EACH ROW EXECUTE FUNCTION federation_changelog_append_only()
    """)

    op.execute("""
        CREATE TABLE federation_sync_state (
            job_id          text NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            peer_id         text NOT NULL,
            synced_at       timestamptz NOT NULL DEFAULT now(),
            changelog_seq   bigint NOT NULL,
            epoch           bigint NOT NULL,
            PRIMARY KEY (job_id, peer_id)
        )
    """)
    op.execute("CREATE INDEX federation_sync_state_by_peer ON federation_sync_state (peer_id, changelog_seq)")

    op.execute("""
        CREATE TABLE peer_heartbeat (
            peer_id      text PRIMARY KEY,
            run_id       text NOT NULL,
            seq          bigint NOT NULL,
            backends     jsonb NOT NULL,
            ttl_s        double precision NOT NULL CHECK (ttl_s > 0),
            sent_at      timestamptz NOT NULL,
            received_at  timestamptz NOT NULL,
            expires_at   timestamptz NOT NULL
        )
    """)


def downgrade() -> None:
    op.execute("DROP TABLE peer_heartbeat")
    op.execute("DROP TABLE federation_sync_state")
    op.execute("DROP TRIGGER federation_changelog_no_update ON federation_changelog")
    op.execute("DROP FUNCTION federation_changelog_append_only()")
    op.execute("DROP TABLE federation_changelog")
    op.execute("DROP TABLE jobs")
