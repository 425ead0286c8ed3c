"""Arrays: one submit, N jobs ``<job_id>_<i>`` (docs/design.md §3.8).

- ``job_arrays``: one row per array (its stored base id, size, parallel limit and
  spec hash): the duplicate and conflict check of the whole submit, and what makes
  the base id name every element (cancel, ``after``, ``irisfed jobs``).
- ``jobs.array_id``, ``jobs.array_index``: an element's array and index (the index
  ``jobs_by_array`` lists an array's elements in order).
- ``jobs.array_held``: an element waiting for one of its array's ``parallel`` slots.
  A held element also counts one in ``deps_pending``, so the tick, which claims only
  queued jobs with none pending, never sees it.
- ``irisfed_array_release`` (AFTER UPDATE of ``jobs.state``): when an element that held
  a slot (it was never held, or was released) ends, the array's lowest held element
  still queued is released, under its row lock: two elements ending together release
  two, and an element cancelled while held frees no slot it never had. So at most
  ``parallel`` elements of an array are ever released and not ended. Once the array's
  cancel was asked (``job_arrays.cancel_requested``, set before its elements are
  ended) nothing is released any more.
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

SEARCH_PATH = "SET search_path = pg_catalog, public, pg_temp"
TERMINAL = "('succeeded', 'failed', 'killed', 'rejected', 'unschedulable')"
JOB_ARRAYS = """
        CREATE TABLE job_arrays (
            array_id     text PRIMARY KEY,
            user_id      text NOT NULL,
            size         integer NOT NULL CHECK (size BETWEEN 1 AND 10000),
            parallel     integer CHECK (parallel >= 1),
            spec_hash    text NOT NULL,
            reply        text NOT NULL,
            submitted_at timestamptz NOT NULL DEFAULT now(),
            cancel_requested boolean NOT NULL DEFAULT false
        )
    """


def upgrade() -> None:
    op.execute(JOB_ARRAYS)
    op.execute("CREATE INDEX job_arrays_by_user ON job_arrays (user_id, submitted_at DESC)")
    op.execute("ALTER TABLE jobs ADD COLUMN array_id text, ADD COLUMN array_index integer, "
               "ADD COLUMN array_held boolean NOT NULL DEFAULT false")
    op.execute("CREATE INDEX jobs_by_array ON jobs (array_id, array_index) WHERE array_id IS NOT NULL")
    op.execute("GRANT SELECT, INSERT, UPDATE (cancel_requested) ON job_arrays TO irisfed_router")
    op.execute("GRANT SELECT ON job_arrays TO irisfed_tick, irisfed_web")
    op.execute(f"""
        CREATE FUNCTION irisfed_array_release() RETURNS trigger
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER {SEARCH_PATH}
        AS $fn$
        DECLARE
            next_id text;
        BEGIN
            -- An array being cancelled gives no slot to anyone: its held elements are ended.
            IF EXISTS (SELECT 1 FROM job_arrays a WHERE a.array_id = NEW.array_id AND a.cancel_requested) THEN
                RETURN NULL;
            END IF;
            -- FOR UPDATE (not SKIP LOCKED): an element another transaction holds is
            -- waited for and checked again, and the next one is taken if it was released
            -- meanwhile, so every slot freed is given to exactly one element.
            SELECT j.job_id INTO next_id FROM jobs j
            WHERE j.array_id = NEW.array_id AND j.array_held AND j.state = 'queued'
            ORDER BY j.array_index LIMIT 1 FOR UPDATE;
            IF FOUND THEN
                UPDATE jobs SET array_held = false, deps_pending = 0, updated_at = now(), reason = ''
                WHERE jobs.job_id = next_id AND jobs.deps_pending = 1;
                IF FOUND THEN
                    PERFORM pg_notify('irisfed_released', '');  -- claimable now: see migration 0019
                END IF;
                UPDATE jobs SET array_held = false, deps_pending = jobs.deps_pending - 1, updated_at = now()
                WHERE jobs.job_id = next_id AND jobs.deps_pending > 1;
            END IF;
            RETURN NULL;
        END $fn$
    """)
    op.execute("REVOKE ALL ON FUNCTION irisfed_array_release() FROM PUBLIC")
    op.execute(f"""
        CREATE TRIGGER jobs_array_release AFTER UPDATE OF state ON jobs FOR EACH ROW
        WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN {TERMINAL}
              AND OLD.state NOT IN {TERMINAL} AND NEW.array_id IS NOT NULL AND NOT OLD.array_held)
        EXECUTE FUNCTION irisfed_array_release()
    """)


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_array_release ON jobs")
    op.execute("DROP FUNCTION irisfed_array_release()")
    op.execute("DROP INDEX jobs_by_array")
    op.execute("ALTER TABLE jobs DROP COLUMN array_held, DROP COLUMN array_index, DROP COLUMN array_id")
    op.execute("DROP TABLE job_arrays")
