"""A lean job row: explanations stored once per distinct decision, no stored reply.

- ``job_explanations``: one row per distinct explanation (``irisfed explain``), keyed
  by a hash of its content; ``jobs.explanation_key`` names a job's. Thousands of jobs
  routed the same way share one row instead of each storing the same ``jsonb``.
  ``verdicts`` holds a rejected submit's reply verdicts (every peer; the explanation
  lists 10), so a duplicate of a rejected job is answered exactly as the first was.
  No foreign key: a key is always written in the same statement as its row, rows
  are never deleted, and a foreign key would lock the shared row for every job.
- ``jobs.submit_reply`` is dropped: a duplicate's reply is rebuilt from the row and
  its first changelog row, which hold everything the first reply said
  (``irisfed.services.router.plan.original_reply``).
- Grants: routers and ticks insert explanations, the dashboard reads them all;
  agents may run ``job_get`` (it joins the table) but see no explanation.

Rows moved here are keyed by a hash of their ``jsonb`` text, which differs from the
services' (a hash of their compact JSON): the same document may then be stored
twice, which costs a row and changes nothing a reader sees.
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BATCH = 10_000  # jobs per statement when moving documents, so no statement holds millions of rows

SERVICES = "irisfed_router, irisfed_tick"


def upgrade() -> None:
    op.execute("""
        CREATE TABLE job_explanations (
            key          text PRIMARY KEY,
            explanation  jsonb NOT NULL,
            verdicts     jsonb
        )
    """)
    op.execute("ALTER TABLE jobs ADD COLUMN explanation_key text")
    op.execute(f"""
        DO $$
        DECLARE
            last_id text := '';
            moved int;
        BEGIN
            LOOP
                WITH chunk AS (
                    SELECT job_id, explanation,
                           CASE WHEN disposition = 'reject' THEN submit_reply->'verdicts' END AS verdicts
                    FROM jobs WHERE job_id > last_id AND explanation IS NOT NULL
                    ORDER BY job_id LIMIT {BATCH}
                ), keyed AS (
                    SELECT job_id, explanation, verdicts,
                           encode(sha256(convert_to(explanation::text || coalesce(E'\\n' || verdicts::text, ''),
                                                    'UTF8')), 'hex') AS key
                    FROM chunk
                ), stored AS (
                    INSERT INTO job_explanations (key, explanation, verdicts)
                    SELECT DISTINCT ON (key) key, explanation, verdicts FROM keyed
                    ON CONFLICT (key) DO NOTHING
                ), linked AS (
                    UPDATE jobs SET explanation_key = keyed.key FROM keyed
                    WHERE jobs.job_id = keyed.job_id
                    RETURNING jobs.job_id
                )
                SELECT count(*), max(job_id) INTO moved, last_id FROM linked;
                EXIT WHEN moved = 0;
            END LOOP;
        END $$
    """)
    op.execute("ALTER TABLE jobs DROP COLUMN explanation, DROP COLUMN submit_reply")

    op.execute(f"GRANT SELECT, INSERT ON job_explanations TO {SERVICES}")
    op.execute("GRANT SELECT ON job_explanations TO irisfed_web, irisfed_agent")
    op.execute("ALTER TABLE job_explanations ENABLE ROW LEVEL SECURITY")
    op.execute(f"CREATE POLICY job_explanations_services ON job_explanations TO {SERVICES} "
               "USING (true) WITH CHECK (true)")
    op.execute("CREATE POLICY job_explanations_web_read ON job_explanations FOR SELECT TO irisfed_web USING (true)")
    # Agents read their own jobs with job_get, which joins this table; they need no
    # explanation, and one readable by every peer would tell them about the others.
    op.execute("CREATE POLICY job_explanations_agent ON job_explanations FOR SELECT TO irisfed_agent USING (false)")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN explanation jsonb, ADD COLUMN submit_reply jsonb")
    # The first reply as 0001-0007 stored it: from the first changelog row (the state,
    # owner and reason the job was created with) and a rejected job's verdicts.
    op.execute(f"""
        DO $$
        DECLARE
            last_id text := '';
            moved int;
        BEGIN
            LOOP
                WITH chunk AS (
                    SELECT job_id FROM jobs WHERE job_id > last_id ORDER BY job_id LIMIT {BATCH}
                ), filled AS (
                    UPDATE jobs SET
                        explanation = e.explanation,
                        submit_reply = jsonb_build_object(
                            'job_id', jobs.job_id, 'disposition', jobs.disposition,
                            'state', coalesce(first.to_state, jobs.state),
                            'peer_id', CASE WHEN jobs.disposition = 'local' THEN coalesce(first.peer_id, '')
                                            ELSE coalesce(jobs.pinned_peer_id, '') END,
                            'duplicate', false, 'reason', coalesce(first.detail, jobs.reason),
                            'verdicts', coalesce(e.verdicts, '[]'::jsonb))
                    FROM chunk
                    LEFT JOIN LATERAL (
                        SELECT to_state, peer_id, detail FROM federation_changelog c
                        WHERE c.job_id = chunk.job_id ORDER BY seq LIMIT 1) first ON true
                    LEFT JOIN jobs j2 ON j2.job_id = chunk.job_id
                    LEFT JOIN job_explanations e ON e.key = j2.explanation_key
                    WHERE jobs.job_id = chunk.job_id
                    RETURNING jobs.job_id
                )
                SELECT count(*), max(job_id) INTO moved, last_id FROM filled;
                EXIT WHEN moved = 0;
            END LOOP;
        END $$
    """)
    op.execute("ALTER TABLE jobs ALTER COLUMN submit_reply SET NOT NULL")
    op.execute("ALTER TABLE jobs DROP COLUMN explanation_key")
    op.execute("DROP TABLE job_explanations")
