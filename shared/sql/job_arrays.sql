-- Queries on `job_arrays`: one row per array (migration 0020); its elements are jobs
-- `<array_id>_<i>` with `array_id` and `array_index` set. The router writes both in one
-- transaction; Postgres releases held elements as others end (trigger irisfed_array_release).

-- job_array_insert --
-- Array $1 of user $2: $3 elements, at most $4 live at once (NULL: no limit), spec hash
-- $5, first reply $6. No row when the id names an array already.
INSERT INTO job_arrays (array_id, user_id, size, parallel, spec_hash, reply)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (array_id) DO NOTHING
RETURNING array_id;

-- job_array_get --
-- One array: its size, limit, spec hash and first reply, or no row.
SELECT array_id, user_id, size, parallel, spec_hash, reply, submitted_at FROM job_arrays WHERE array_id = $1;

-- job_array_mark --
-- The elements $1 of array $2 (indexes $3): held ($4) or not, $5 more pending each.
UPDATE jobs j SET array_id = $2, array_index = e.i, array_held = e.held,
                  deps_pending = j.deps_pending + e.pending,
                  reason = CASE WHEN e.held AND j.deps_pending + e.pending = 1 THEN $6 ELSE j.reason END
FROM unnest($1::text[], $3::int[], $4::bool[], $5::int[]) AS e(job_id, i, held, pending)
WHERE j.job_id = e.job_id;

-- job_array_elements --
-- The elements of arrays $1 with their states, in order; FOR SHARE when locked (a submit
-- naming them in `after`, so an element's end waits for its edges).
SELECT array_id, job_id, state FROM jobs WHERE array_id = ANY($1::text[]) ORDER BY array_id, array_index;

-- job_array_elements_lock --
SELECT array_id, job_id, state FROM jobs WHERE array_id = ANY($1::text[])
ORDER BY array_id, array_index FOR SHARE;

-- job_array_counts --
-- How many elements of array $1 are in each state.
SELECT state, count(*)::int AS jobs FROM jobs WHERE array_id = $1 GROUP BY state ORDER BY state;

-- job_array_kill_queued --
-- Cancel every queued job of array $1 at once, held ones and released ones not placed
-- yet (a cancel's rule for a queued job: killed now), remembering who asked ($2); reason
-- $3, or $4 for one that ran before. With their changelog rows; their ids and epochs.
WITH killed AS (
    UPDATE jobs SET state = 'killed', updated_at = now(), finished_at = now(),
                    reason = CASE WHEN attempts > 0 THEN $4 ELSE $3 END,
                    cancel_requested = true, cancel_requested_at = now(),
                    cancel_requested_by = coalesce(cancel_requested_by, $2)
    WHERE array_id = $1 AND state = 'queued'
    RETURNING job_id, epoch, owner_peer_id, reason
)
INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
SELECT job_id, 'queued', 'killed', owner_peer_id, epoch, 'router', reason FROM killed
RETURNING job_id, epoch;

-- job_array_request_cancel --
-- Remember that array $1's cancel was asked: from now on no end releases a held element.
UPDATE job_arrays SET cancel_requested = true WHERE array_id = $1;
