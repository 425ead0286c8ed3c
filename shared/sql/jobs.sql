-- Queries on `jobs`. Every state change is a compare-and-set on (state, epoch)
-- and writes its federation_changelog row in the same statement, so a job's
-- state and its history can never disagree.

-- job_insert_batch --
-- Create many jobs (one router group-commit batch) with their first changelog rows
-- and their job_listing rows.
-- Existing job_ids, and ids naming an array (job_arrays), are skipped; the caller answers
-- those as duplicates or conflicts.
-- The batch's distinct explanations ($2) are stored once each, in the same statement,
-- so a job's explanation_key always names a stored row.
WITH input AS (
    -- One JSON array of row objects (the NewJob fields), encoded in C by msgspec:
    -- far cheaper for the router than fifteen array parameters built in Python.
    SELECT * FROM json_to_recordset($1::text::json) AS t(
        job_id text, spec_json text, spec_hash text, state text, disposition text,
        pinned_peer_id text, owner_peer_id text, backend text, epoch bigint, max_retries int,
        priority int, deadline_s double precision, reason text, explanation text, resources_json text,
        user_id text, band smallint, replicas int)
), explained AS (
    INSERT INTO job_explanations (key, explanation, verdicts)
    SELECT key, explanation, verdicts
    FROM json_to_recordset($2::text::json) AS e(key text, explanation jsonb, verdicts jsonb)
    ON CONFLICT (key) DO NOTHING
), inserted AS (
    INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, pinned_peer_id, owner_peer_id,
                      backend, epoch, max_retries, priority, deadline_at, reason, explanation_key,
                      assigned_at, finished_at, resources, user_id, band, replicas)
    SELECT job_id, spec_json::jsonb, spec_hash, state, disposition, pinned_peer_id, owner_peer_id,
           backend, epoch, max_retries, priority,
           CASE WHEN deadline_s IS NULL THEN NULL ELSE now() + make_interval(secs => deadline_s) END,
           reason, explanation,
           CASE WHEN state = 'assigned' THEN now() END,
           CASE WHEN state IN ('rejected', 'unschedulable') THEN now() END,
           COALESCE(resources_json::jsonb, '{"cpu": 1}'::jsonb), COALESCE(user_id, 'default'),
           COALESCE(band, 1), COALESCE(replicas, 1)
    FROM input
    WHERE NOT EXISTS (SELECT 1 FROM job_arrays a WHERE a.array_id = input.job_id)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id, state, owner_peer_id, epoch, reason, submitted_at,
              spec->'labels' AS labels, spec->>'name' AS name
), logged AS (
    INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
    SELECT job_id, NULL, state, owner_peer_id, epoch, 'router', reason FROM inserted
), listed AS (
    -- What the Jobs page searches, written once (migration 0011): never updated after.
    INSERT INTO job_listing (job_id, submitted_at, labels, search_text)
    SELECT job_id, submitted_at, coalesce(labels, '{}'::jsonb), job_id || ' ' || coalesce(name, '')
    FROM inserted
)
SELECT job_id FROM inserted;

-- job_get_submitted --
-- What answers resubmissions of existing jobs: the spec hash and what the first reply
-- said, from the row's fixed columns and its first changelog row (the state, owner
-- and reason it was created with), and a rejected job's verdicts.
SELECT j.job_id, j.spec_hash, j.disposition, j.pinned_peer_id, first.to_state AS first_state,
       first.peer_id AS first_peer_id, first.detail AS first_reason,
       CASE WHEN j.disposition = 'reject' THEN e.verdicts END AS verdicts
FROM jobs j
CROSS JOIN LATERAL (
    SELECT to_state, peer_id, detail FROM federation_changelog c
    WHERE c.job_id = j.job_id ORDER BY seq LIMIT 1) first
LEFT JOIN job_explanations e ON e.key = j.explanation_key AND j.disposition = 'reject'
WHERE j.job_id = ANY($1::text[]);

-- job_get --
-- One whole job (every column, in table order, its explanation joined), or no row.
SELECT j.job_id, j.spec, j.spec_hash, j.state, j.disposition, j.pinned_peer_id, j.owner_peer_id, j.backend,
       j.epoch, j.attempts, j.max_retries, j.priority, j.avoid_peers, j.submitted_at, j.updated_at,
       j.assigned_at, j.started_at, j.finished_at, j.deadline_at, j.exit_code, j.log_dir, j.reason,
       e.explanation, j.cancel_requested, j.cancel_requested_at, j.user_id, j.cancel_requested_by,
       j.band, j.preemptions, j.stopping_on, j.replicas, j.failures, j.restarts
FROM jobs j LEFT JOIN job_explanations e ON e.key = j.explanation_key
WHERE j.job_id = $1;

-- job_get_for_update --
-- Lock one job while deciding what a cancel does to it.
SELECT job_id, state, owner_peer_id, epoch, cancel_requested, attempts FROM jobs WHERE job_id = $1 FOR UPDATE;

-- job_list --
-- The unified view: newest first (a range of job_listing_newest, each job by its key).
-- One listing row per job (its key): a second one, forged, is refused.
SELECT j.job_id, j.state, j.disposition, j.pinned_peer_id, j.owner_peer_id, j.epoch, j.attempts,
       j.priority, j.submitted_at, j.updated_at, j.exit_code, j.reason, j.spec->'command' AS command,
       j.user_id, j.band, j.preemptions, j.resources, j.replicas, j.started_at, j.finished_at, j.array_id
FROM job_listing l JOIN jobs j ON j.job_id = l.job_id
ORDER BY l.submitted_at DESC, l.job_id DESC
LIMIT $1;

-- job_list_by_state --
-- job_list for one state ($1): a range of jobs_by_state_newest.
SELECT job_id, state, disposition, pinned_peer_id, owner_peer_id, epoch, attempts, priority,
       submitted_at, updated_at, exit_code, reason, spec->'command' AS command, user_id, band, preemptions,
       resources, replicas, started_at, finished_at, array_id
FROM jobs
WHERE state = $1
ORDER BY submitted_at DESC, job_id DESC
LIMIT $2;

-- job_list_by_user --
-- job_list for one user ($1), optionally one state ($2): a range of jobs_by_user_newest.
SELECT job_id, state, disposition, pinned_peer_id, owner_peer_id, epoch, attempts, priority,
       submitted_at, updated_at, exit_code, reason, spec->'command' AS command, user_id, band, preemptions,
       resources, replicas, started_at, finished_at, array_id
FROM jobs
WHERE user_id = $1 AND ($2::text IS NULL OR state = $2)
ORDER BY submitted_at DESC, job_id DESC
LIMIT $3;

-- job_count_by_state --
-- How many jobs are in each state (states with none are absent).
SELECT state, count(*) AS jobs FROM jobs GROUP BY state;

-- job_move --
-- Compare-and-set one job from (state $2, epoch $3) to state $4 under epoch $5 and
-- owner $6, recording why. Returns the changelog seq, or no row when the CAS lost.
WITH moved AS (
    UPDATE jobs SET
        state = $4,
        epoch = $5,
        owner_peer_id = $6,
        reason = $7,
        exit_code = COALESCE($8, exit_code),
        log_dir = COALESCE($10, log_dir),
        attempts = attempts + CASE WHEN $4 = 'running' THEN 1 ELSE 0 END,
        avoid_peers = CASE WHEN $11::text IS NULL THEN avoid_peers
                           ELSE array_append(avoid_peers, $11::text) END,
        backend = CASE WHEN $4 = 'queued' THEN NULL ELSE backend END,
        updated_at = now(),
        started_at = CASE WHEN $4 = 'running' THEN now() ELSE started_at END,
        finished_at = CASE WHEN $4 IN ('succeeded','failed','killed','rejected','unschedulable')
                           THEN now() ELSE finished_at END
    WHERE job_id = $1 AND state = $2 AND epoch = $3
    RETURNING job_id, owner_peer_id, epoch
)
INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
SELECT job_id, $2, $4, COALESCE(owner_peer_id, $6), epoch, $9, $7 FROM moved
RETURNING seq;

-- job_request_cancel --
-- Durably remember a cancel and who asked ($2: `user alice`, `operator (web)`); the
-- owner applies it when it sees it. A later request does not rename the first asker.
UPDATE jobs SET cancel_requested = true, cancel_requested_at = now(), updated_at = now(),
                cancel_requested_by = coalesce(cancel_requested_by, $2)
WHERE job_id = $1;

-- job_start_batch --
-- A peer agent accepts many assigned jobs at once: assigned → running, CAS on
-- (state, epoch, owner $1), with changelog and sync-state rows in the same statement.
-- A function (migration 0004): agents may not write jobs or history directly, and it
-- refuses a caller acting as another peer. What to run comes back with the acceptance.
SELECT job_id, spec, backend FROM irisfed_job_start_batch($1, $2::text[], $3::bigint[], $4::text[], $5::text[]);

-- job_finish_batch --
-- A peer agent reports many ended runs at once: running → succeeded | failed | killed,
-- CAS on (state, epoch, owner $1). A stored cancel makes the ending `killed`.
-- Changelog and sync state in the same statement (function: migration 0004).
SELECT job_id, state, reason FROM irisfed_job_finish_batch($1, $2::text[], $3::bigint[], $4::int[], $5::boolean[]);

-- job_hand_back --
-- A peer agent hands back its assigned gang $2 at epoch $3 whose tasks did not all start
-- (the start timeout, a task that could not start): $4 = 'queued' (epoch + 1, no owner),
-- 'failed' (out of retries) or 'killed' (a cancel stored); attempts + 1 (a failed start
-- is a retry). CAS on (assigned, epoch, owner $1), changelog and sync state in the same
-- statement (function: migration 0016). The changelog seq; NULL: the CAS lost.
SELECT irisfed_job_hand_back($1, $2, $3, $4, $5);

-- job_list_assigned_specs --
-- What to run of a peer's assigned gangs ($1: the peer; $2, $3: job ids and epochs): a
-- gang is launched while still assigned and accepted (job_start_batch) once all its
-- tasks run. Only its own rows at those epochs.
SELECT j.job_id, j.spec, j.backend
FROM unnest($2::text[], $3::bigint[]) AS input(job_id, epoch)
JOIN jobs j ON j.job_id = input.job_id AND j.epoch = input.epoch
WHERE j.owner_peer_id = $1 AND j.state = 'assigned';

-- job_end_run --
-- A peer agent ends its own running job $2 at epoch $3 other than by its exit: back to
-- the queue ($4 = 'queued': epoch + 1, no owner, no backend; launch error or orphan with
-- retries left), 'failed' or 'killed' (cancelled while the agent was down), CAS on
-- (state, epoch, owner $1), with changelog (actor $1) and sync state in the same
-- statement (function: migrations 0004, 0018). $7: handed back through no fault of the
-- job (its agent restarted under it): restarts + 1, no retry spent. Returns the
-- changelog seq; NULL: the CAS lost.
SELECT irisfed_job_end_run($1, $2, $3, $4, $5, $6, $7);

-- job_count_live --
-- Slots in use per peer and backend: assigned and running jobs, one per task.
SELECT owner_peer_id, backend, sum(replicas)::bigint AS live
FROM jobs
WHERE state IN ('assigned', 'running')
GROUP BY owner_peer_id, backend;

-- job_pass_reads --
-- What a tick pass reads before it places, in one statement (its wake-up waits for
-- one round trip beside the claim, not two). Kind 'live', key the owner peer: what
-- assigned and running jobs hold per peer and backend (a row with resource NULL counts
-- the slots in use, one per task, and names the lowest band live there: the tick reads
-- what it may preempt only where a live job's band is below the queue's; the others
-- sum what the jobs asked for per resource, each task's times its tasks). Kind
-- 'queued', key the user: each user with queued jobs and the band of its first one (a
-- skip scan of jobs_queued_by_user: one index probe per user, however deep its queue).
WITH RECURSIVE users AS (
    (SELECT user_id, band FROM jobs WHERE state = 'queued' AND deps_pending = 0 ORDER BY user_id, -band LIMIT 1)
    UNION ALL
    SELECT next.user_id, next.band
    FROM users, LATERAL (SELECT j.user_id, j.band FROM jobs j
                         WHERE j.state = 'queued' AND j.deps_pending = 0 AND j.user_id > users.user_id
                         ORDER BY j.user_id, -j.band LIMIT 1) AS next
), live AS (
    SELECT owner_peer_id, backend, resources, replicas, band FROM jobs WHERE state IN ('assigned', 'running')
)
SELECT 'live' AS kind, owner_peer_id AS key, backend, NULL::text AS resource, sum(replicas)::float8 AS amount,
       min(band) AS band
FROM live
GROUP BY owner_peer_id, backend
UNION ALL
SELECT 'live', owner_peer_id, backend, r.key, sum(r.value::numeric * replicas)::float8, NULL
FROM live, jsonb_each_text(live.resources) AS r
GROUP BY owner_peer_id, backend, r.key
UNION ALL
SELECT 'queued', user_id, NULL, NULL, NULL, band FROM users;

-- job_assign_batch --
-- The tick's commit: queued → assigned for many jobs at once, CAS on epoch. $5: each
-- one's history detail (NULL: 'placed'; a preempting job names its victims).
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[])
        AS t(job_id, epoch, peer_id, backend, detail)
), moved AS (
    UPDATE jobs SET state = 'assigned', epoch = jobs.epoch + 1, owner_peer_id = input.peer_id,
                    backend = input.backend, assigned_at = now(), updated_at = now(),
                    reason = 'assigned to ' || input.peer_id
    FROM input
    WHERE jobs.job_id = input.job_id AND jobs.state = 'queued' AND jobs.epoch = input.epoch
    RETURNING jobs.job_id, jobs.owner_peer_id, jobs.epoch, coalesce(input.detail, 'placed') AS detail
), logged AS (
    INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
    SELECT job_id, 'queued', 'assigned', owner_peer_id, epoch, 'tick', detail FROM moved
)
SELECT job_id, owner_peer_id, epoch FROM moved;

-- job_explain_batch --
-- Record why claimed jobs stay queued: each distinct explanation stored once ($4:
-- keys, $5: documents), each job pointing at its own by key. Rows whose explanation
-- did not change are not written at all, so a long-waiting queue costs no writes per tick.
WITH explained AS (
    INSERT INTO job_explanations (key, explanation)
    SELECT key, doc::jsonb FROM unnest($4::text[], $5::text[]) AS d(key, doc)
    ON CONFLICT (key) DO NOTHING
)
UPDATE jobs SET explanation_key = input.key, reason = input.reason
FROM unnest($1::text[], $2::text[], $3::text[]) AS input(job_id, key, reason)
WHERE jobs.job_id = input.job_id AND jobs.state = 'queued'
  AND jobs.explanation_key IS DISTINCT FROM input.key;

-- job_expire_deadlines --
-- Queued jobs past their deadline become unschedulable.
WITH moved AS (
    UPDATE jobs SET state = 'unschedulable', updated_at = now(), finished_at = now(),
                    reason = 'waited longer than its deadline_s without a peer able to run it'
    WHERE job_id IN (
        SELECT job_id FROM jobs
        WHERE state = 'queued' AND deadline_at IS NOT NULL AND deadline_at < now()
        LIMIT $1 FOR UPDATE SKIP LOCKED)
    RETURNING job_id, epoch, reason
), logged AS (
    INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
    SELECT job_id, 'queued', 'unschedulable', NULL, epoch, 'tick', reason FROM moved
)
SELECT job_id, epoch FROM moved;

-- job_list_live_for_owner --
-- Everything a peer agent should be doing: its assigned and running jobs.
SELECT job_id, state, epoch, backend, cancel_requested, priority, replicas
FROM jobs
WHERE owner_peer_id = $1 AND state IN ('assigned', 'running')
ORDER BY priority DESC, submitted_at, job_id;

-- job_claim_on_lost_peers --
-- Unpinned live jobs owned by lost peers ($1: their ids; the tick decides who is lost
-- from heartbeats, TTL and grace), at most $2, locked. Pinned jobs never move, so they
-- are filtered here, before the LIMIT: a lost peer full of pinned work cannot hide the
-- rest. owner = ANY($1) is a range scan of jobs_live_by_owner (partial: live rows only).
SELECT job_id, state, epoch, owner_peer_id, attempts, max_retries, pinned_peer_id, cancel_requested,
       preemptions, failures + restarts AS spared
FROM jobs
WHERE state IN ('assigned', 'running')
  AND owner_peer_id = ANY($1::text[])
  AND (pinned_peer_id IS NULL OR pinned_peer_id = '')
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- job_list_states --
-- Every job's current state and epoch, for invariant checks.
SELECT job_id, state, epoch, owner_peer_id, pinned_peer_id, exit_code FROM jobs ORDER BY job_id;

-- job_count_queued_by_class --
-- Queued jobs per (pin, constraint set): the $1 largest classes, the rest as "other".
WITH classes AS (
    SELECT COALESCE(pinned_peer_id, '') AS pinned_peer,
           COALESCE(spec->>'constraints', '[]') AS constraints,
           count(*) AS jobs
    FROM jobs WHERE state = 'queued'
    GROUP BY 1, 2
), ranked AS (
    SELECT *, row_number() OVER (ORDER BY jobs DESC, pinned_peer, constraints) AS rank FROM classes
)
SELECT pinned_peer, constraints, jobs FROM ranked WHERE rank <= $1
UNION ALL
SELECT 'other', 'other', sum(jobs)::bigint FROM ranked WHERE rank > $1 HAVING count(*) > 0;

-- job_list_page --
-- The dashboard's job list: one page newest first, after the keyset cursor ($5, $6) =
-- (submitted_at, job_id) of the last row shown (NULLs: the first page). Optional
-- filters: state $1, owner $2, labels containing $3, id or name containing $4 (its
-- LIKE metacharacters escaped by the caller). The cursor is a row comparison, so a
-- deep page costs what the first does. This form walks job_listing_newest (written
-- once per job, migration 0011) and joins each job by its key; the four below lead
-- with the one filter an index serves (the store picks which), the others are the
-- same conditions.
SELECT j.job_id, coalesce(j.spec->>'name', '') AS name, j.state, j.owner_peer_id, j.pinned_peer_id,
       j.epoch, j.attempts, j.priority, j.submitted_at, j.updated_at, j.exit_code, j.reason,
       j.spec->'command' AS command, coalesce(j.spec->'labels', '{}'::jsonb) AS labels, j.user_id,
       j.band, j.preemptions
FROM job_listing l JOIN jobs j ON j.job_id = l.job_id
WHERE (l.submitted_at, l.job_id) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::text, ''))
  AND ($1::text IS NULL OR j.state = $1)
  AND ($2::text IS NULL OR j.owner_peer_id = $2)
  AND ($8::text IS NULL OR j.user_id = $8)
  AND ($3::jsonb IS NULL OR l.labels @> $3::jsonb)
  AND ($4::text IS NULL OR l.search_text ILIKE '%' || $4 || '%')
ORDER BY l.submitted_at DESC, l.job_id DESC
LIMIT $7;

-- job_list_page_by_state --
-- job_list_page for one state ($1 given): a range of jobs_by_state_newest.
SELECT job_id, coalesce(spec->>'name', '') AS name, state, owner_peer_id, pinned_peer_id, epoch,
       attempts, priority, submitted_at, updated_at, exit_code, reason, spec->'command' AS command,
       coalesce(spec->'labels', '{}'::jsonb) AS labels, user_id, band, preemptions
FROM jobs
WHERE state = $1
  AND (submitted_at, job_id) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::text, ''))
  AND ($2::text IS NULL OR owner_peer_id = $2)
  AND ($3::jsonb IS NULL OR spec->'labels' @> $3::jsonb)
  AND ($4::text IS NULL OR (job_id || ' ' || coalesce(spec->>'name', '')) ILIKE '%' || $4 || '%')
  AND ($8::text IS NULL OR user_id = $8)
ORDER BY submitted_at DESC, job_id DESC
LIMIT $7;

-- job_list_page_by_owner --
-- job_list_page for one owner peer ($2 given): a range of jobs_by_owner_newest.
SELECT job_id, coalesce(spec->>'name', '') AS name, state, owner_peer_id, pinned_peer_id, epoch,
       attempts, priority, submitted_at, updated_at, exit_code, reason, spec->'command' AS command,
       coalesce(spec->'labels', '{}'::jsonb) AS labels, user_id, band, preemptions
FROM jobs
WHERE owner_peer_id = $2
  AND (submitted_at, job_id) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::text, ''))
  AND ($1::text IS NULL OR state = $1)
  AND ($3::jsonb IS NULL OR spec->'labels' @> $3::jsonb)
  AND ($4::text IS NULL OR (job_id || ' ' || coalesce(spec->>'name', '')) ILIKE '%' || $4 || '%')
  AND ($8::text IS NULL OR user_id = $8)
ORDER BY submitted_at DESC, job_id DESC
LIMIT $7;

-- job_list_page_by_user --
-- job_list_page for one user ($8 given): a range of jobs_by_user_newest.
SELECT job_id, coalesce(spec->>'name', '') AS name, state, owner_peer_id, pinned_peer_id, epoch,
       attempts, priority, submitted_at, updated_at, exit_code, reason, spec->'command' AS command,
       coalesce(spec->'labels', '{}'::jsonb) AS labels, user_id, band, preemptions
FROM jobs
WHERE user_id = $8
  AND (submitted_at, job_id) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::text, ''))
  AND ($1::text IS NULL OR state = $1)
  AND ($2::text IS NULL OR owner_peer_id = $2)
  AND ($3::jsonb IS NULL OR spec->'labels' @> $3::jsonb)
  AND ($4::text IS NULL OR (job_id || ' ' || coalesce(spec->>'name', '')) ILIKE '%' || $4 || '%')
ORDER BY submitted_at DESC, job_id DESC
LIMIT $7;

-- job_list_page_by_label --
-- job_list_page for jobs whose labels contain $3 (given): job_listing_by_label (GIN), then sorted.
SELECT j.job_id, coalesce(j.spec->>'name', '') AS name, j.state, j.owner_peer_id, j.pinned_peer_id,
       j.epoch, j.attempts, j.priority, j.submitted_at, j.updated_at, j.exit_code, j.reason,
       j.spec->'command' AS command, coalesce(j.spec->'labels', '{}'::jsonb) AS labels, j.user_id,
       j.band, j.preemptions
FROM job_listing l JOIN jobs j ON j.job_id = l.job_id
WHERE l.labels @> $3::jsonb
  AND (l.submitted_at, l.job_id) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::text, ''))
  AND ($1::text IS NULL OR j.state = $1)
  AND ($2::text IS NULL OR j.owner_peer_id = $2)
  AND ($8::text IS NULL OR j.user_id = $8)
  AND ($4::text IS NULL OR l.search_text ILIKE '%' || $4 || '%')
ORDER BY l.submitted_at DESC, l.job_id DESC
LIMIT $7;

-- job_list_page_by_text --
-- job_list_page for ids or names containing $4 (given, 3 characters or more):
-- job_listing_by_text (trigrams) when the server has pg_trgm, then sorted.
SELECT j.job_id, coalesce(j.spec->>'name', '') AS name, j.state, j.owner_peer_id, j.pinned_peer_id,
       j.epoch, j.attempts, j.priority, j.submitted_at, j.updated_at, j.exit_code, j.reason,
       j.spec->'command' AS command, coalesce(j.spec->'labels', '{}'::jsonb) AS labels, j.user_id,
       j.band, j.preemptions
FROM job_listing l JOIN jobs j ON j.job_id = l.job_id
WHERE l.search_text ILIKE '%' || $4 || '%'
  AND (l.submitted_at, l.job_id) < (coalesce($5::timestamptz, 'infinity'), coalesce($6::text, ''))
  AND ($1::text IS NULL OR j.state = $1)
  AND ($2::text IS NULL OR j.owner_peer_id = $2)
  AND ($8::text IS NULL OR j.user_id = $8)
  AND ($3::jsonb IS NULL OR l.labels @> $3::jsonb)
ORDER BY l.submitted_at DESC, l.job_id DESC
LIMIT $7;

-- job_count_live_by_state --
-- Queued, assigned and running jobs (states with none are absent): ranges of
-- jobs_by_state_newest, so it stays cheap however many jobs have ended.
SELECT state, count(*) AS jobs FROM jobs WHERE state IN ('queued', 'assigned', 'running') GROUP BY state;

-- job_get_oldest_queued --
-- The job that has waited longest in the queue, and how long (Postgres's clock), or no row.
SELECT job_id, submitted_at, extract(epoch FROM now() - submitted_at)::float8 AS age_s
FROM jobs WHERE state = 'queued'
ORDER BY submitted_at, job_id
LIMIT 1;

-- job_count_submitted_by_minute --
-- Jobs submitted per minute since $1 (a range of job_listing_newest). Not joined with
-- jobs: an hour of listing rows is counted from the index alone. A row the router
-- role forged would count too; that role is trusted to write jobs at all.
SELECT date_trunc('minute', submitted_at) AS minute, count(*) AS jobs
FROM job_listing WHERE submitted_at >= $1
GROUP BY 1;

-- job_claim_queued_by_user --
-- Lock the next queued jobs of each user $1[i] in that user's own order (band, then
-- priority, then submit time), at most $6 each, after that user's keyset cursor
-- ($2[i], $3[i], $4[i], $5[i]) = (-band, -priority, submitted_at, job_id) of its last
-- job seen (the store passes a cursor
-- before every job for a user's start, never NULLs: a plain row comparison is what
-- lets the index seek to it). One range scan of jobs_queued_by_user per user. SKIP LOCKED lets several ticks claim
-- disjoint batches. The tick orders the users by fair share (shared/fair_share.py).
-- A preempted job whose old run has not been seen to stop (stopping_on) is not claimed,
-- nor one waiting for its dependencies (deps_pending: outside the index's predicate).
SELECT j.job_id, j.epoch, j.pinned_peer_id, j.avoid_peers, j.priority, j.submitted_at,
       j.constraints_json, j.resources_json, j.preferences_json, j.waited_s, j.cancel_requested, j.user_id,
       j.band, j.replicas, j.group_by
FROM unnest($1::text[], $2::int[], $3::int[], $4::timestamptz[], $5::text[])
    AS c(user_id, neg_band, neg_priority, submitted_at, job_id)
CROSS JOIN LATERAL (
    SELECT job_id, epoch, pinned_peer_id, avoid_peers, priority, submitted_at,
           spec->>'constraints' AS constraints_json, resources::text AS resources_json,
           spec->>'preferences' AS preferences_json,
           extract(epoch from now() - submitted_at)::float8 AS waited_s, cancel_requested, user_id, band,
           replicas, coalesce(spec->'coschedule'->>'group_by', '') AS group_by
    FROM jobs
    WHERE state = 'queued' AND deps_pending = 0 AND user_id = c.user_id AND stopping_on IS NULL
      AND (-band, -priority, submitted_at, job_id) > (c.neg_band, c.neg_priority, c.submitted_at, c.job_id)
    ORDER BY -band, -priority, submitted_at, job_id
    LIMIT $6
    FOR UPDATE SKIP LOCKED
) j;

-- job_claim_queued_of_user --
-- job_claim_queued_by_user for one user ($1, its cursor $2..$5, at most $6): the
-- same rows, without the unnest and lateral join, whose planning on every execution
-- cost a queue of one user (a federation without users) more than the claim itself.
SELECT job_id, epoch, pinned_peer_id, avoid_peers, priority, submitted_at,
       spec->>'constraints' AS constraints_json, resources::text AS resources_json,
       spec->>'preferences' AS preferences_json,
       extract(epoch from now() - submitted_at)::float8 AS waited_s, cancel_requested, user_id, band,
       replicas, coalesce(spec->'coschedule'->>'group_by', '') AS group_by
FROM jobs
WHERE state = 'queued' AND deps_pending = 0 AND user_id = $1 AND stopping_on IS NULL
  AND (-band, -priority, submitted_at, job_id) > ($2::int, $3::int, $4::timestamptz, $5::text)
ORDER BY -band, -priority, submitted_at, job_id
LIMIT $6
FOR UPDATE SKIP LOCKED;

-- job_live_usage_by_user --
-- What the assigned and running jobs of users $1 hold (quota checks, under their
-- locks: a range of jobs_live_by_user per user): a row with resource NULL counts a
-- user's live tasks (slots), the others sum what they asked per resource (times tasks).
WITH live AS (
    SELECT user_id, resources, replicas FROM jobs
    WHERE user_id = ANY($1::text[]) AND state IN ('assigned', 'running')
)
SELECT user_id, NULL::text AS resource, sum(replicas)::float8 AS amount FROM live GROUP BY user_id
UNION ALL
SELECT user_id, r.key, sum(r.value::numeric * replicas)::float8
FROM live, jsonb_each_text(live.resources) AS r
GROUP BY user_id, r.key;

-- job_live_usage_all_users --
-- job_live_usage_by_user for every user (fair share reads it once per tick pass, the
-- views too). A statement of its own: one plan for "these users" and "all users"
-- would be a generic plan that scans every live job for a few users.
WITH live AS (
    SELECT user_id, resources, replicas FROM jobs WHERE state IN ('assigned', 'running')
)
SELECT user_id, NULL::text AS resource, sum(replicas)::float8 AS amount FROM live GROUP BY user_id
UNION ALL
SELECT user_id, r.key, sum(r.value::numeric * replicas)::float8
FROM live, jsonb_each_text(live.resources) AS r
GROUP BY user_id, r.key;

-- job_quota_lock --
-- Serialise every writer that may make users $1 (sorted by the caller, so two writers
-- never wait on each other in a cycle) hold more: routers assigning LOCAL jobs and
-- ticks assigning placements take these locks, then read the users' live usage, then
-- write, in one transaction. Ending work needs no lock: it only frees room.
SELECT count(pg_advisory_xact_lock(hashtextextended('irisfed.quota.' || u, 0)))
FROM unnest($1::text[]) AS u;

-- transaction_lock_timeout --
-- How long this transaction's next lock waits may last ($1: e.g. '800ms'), then
-- lock_not_available (transient: the writer answers `unavailable`).
SELECT set_config('lock_timeout', $1, true);

-- job_count_by_user --
-- Queued, assigned and running jobs per user (users with none are absent).
SELECT user_id, state, count(*)::bigint AS jobs
FROM jobs WHERE state IN ('queued', 'assigned', 'running')
GROUP BY user_id, state;

-- job_list_preemptible --
-- Live jobs of bands below $1 (never production: shared/bands.py) on peers $2: what a
-- waiting job of band $1 may preempt (docs/scheduling.md, "Preemption"), with what
-- each asked (each task, and how many tasks) and since when it holds its room (running:
-- started; assigned: assigned this time, whatever an earlier run's started_at says;
-- seconds since the epoch). A range of jobs_live_by_band, read only when a waiting job
-- could use it.
SELECT job_id, epoch, state, owner_peer_id, backend, band, resources::text AS resources_json, user_id,
       extract(epoch from CASE WHEN state = 'running' THEN coalesce(started_at, assigned_at, updated_at)
                               ELSE coalesce(assigned_at, updated_at) END)::float8 AS since,
       replicas
FROM jobs
WHERE state IN ('assigned', 'running') AND band < least($1::int, 2) AND owner_peer_id = ANY($2::text[]);

-- job_lock_victims --
-- Lock the chosen victims that are still as the tick saw them (CAS on state, epoch and
-- owner: $1..$4), in job id order, skipping any another writer holds (an agent
-- finishing it, another tick preempting it): the tick preempts only for jobs whose
-- every victim came back, so a victim in flux costs a pass, never a needless victim.
SELECT job_id
FROM jobs
WHERE (job_id, state, epoch, owner_peer_id) IN (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]))
  AND state IN ('assigned', 'running')
ORDER BY job_id
FOR UPDATE SKIP LOCKED;

-- job_preempt_batch --
-- Preempt victims $1 (locked by job_lock_victims, CAS on state $2, epoch $3, owner $4)
-- for jobs $5 (each victim's preemptor): back to the queue at its old place under a new
-- epoch (its run is fenced), no owner or backend, its preemptions counted, a changelog
-- row saying by whom. A victim already preempted max_preemptions times (its spec; 100
-- when absent) fails instead; one whose cancel was stored ends killed (the user asked).
-- Both keep their owner on record and are fenced the same way. A running victim queued
-- again is not placed until its old run is seen to stop (stopping_on: its run owner
-- clears it, or the tick once that owner is lost), so it never runs under two epochs;
-- an assigned gang too, whose tasks start before it is accepted.
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[])
        AS t(job_id, state, epoch, owner_peer_id, preemptor)
), decided AS (
    SELECT input.*, jobs.preemptions,
           CASE WHEN jobs.cancel_requested THEN 'killed'
                WHEN jobs.preemptions >= coalesce((jobs.spec->>'max_preemptions')::int, 100) THEN 'failed'
                ELSE 'queued' END AS to_state,
           coalesce((jobs.spec->>'max_preemptions')::int, 100) AS max_preemptions,
           coalesce(jobs.cancel_requested_by, 'request') AS cancelled_by
    FROM input JOIN jobs USING (job_id)
    WHERE jobs.state = input.state AND jobs.epoch = input.epoch AND jobs.owner_peer_id = input.owner_peer_id
), moved AS (
    UPDATE jobs SET
        state = decided.to_state,
        epoch = jobs.epoch + 1,
        owner_peer_id = CASE WHEN decided.to_state = 'queued' THEN NULL ELSE jobs.owner_peer_id END,
        backend = CASE WHEN decided.to_state = 'queued' THEN NULL ELSE jobs.backend END,
        stopping_on = CASE WHEN decided.to_state = 'queued'
                                AND (decided.state = 'running' OR jobs.replicas > 1)
                           THEN decided.owner_peer_id END,
        preemptions = jobs.preemptions + 1,
        reason = CASE decided.to_state
            WHEN 'queued' THEN 'preempted by ' || decided.preemptor
            WHEN 'failed' THEN 'preempted by ' || decided.preemptor || '; preempted '
                               || decided.preemptions + 1 || ' times, more than its max_preemptions '
                               || decided.max_preemptions
            ELSE 'preempted by ' || decided.preemptor || '; cancelled by ' || decided.cancelled_by END,
        updated_at = now(),
        finished_at = CASE WHEN decided.to_state = 'queued' THEN jobs.finished_at ELSE now() END
    FROM decided
    WHERE jobs.job_id = decided.job_id
    RETURNING jobs.job_id, jobs.state, jobs.epoch, jobs.owner_peer_id, jobs.reason, decided.state AS from_state,
              decided.owner_peer_id AS run_owner, decided.preemptor
), logged AS (
    INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail)
    SELECT job_id, from_state, state, owner_peer_id, epoch, 'tick', reason FROM moved
)
SELECT job_id, state, epoch, run_owner, reason, preemptor FROM moved;

-- job_runs_stopped --
-- Peer $1 says its runs of preempted jobs are gone: clears stopping_on of its queued
-- jobs ($2: only these; NULL: all) except those it still runs ($3), so the tick may
-- place them again (function: migration 0015). The ids released.
SELECT irisfed_job_runs_stopped($1, $2, $3) AS job_id;

-- job_release_stopping_on_lost --
-- The tick releases preempted jobs whose old run's peer is lost past TTL + grace ($1)
-- or no longer configured (not in $2; NULL: not judged yet, as for live jobs of such
-- peers, shortly after the tick starts): no agent is left to say the run stopped, and
-- such a peer's live jobs are recovered the same way. The ids released, with the peer.
WITH waiting AS (
    SELECT job_id, stopping_on FROM jobs
    WHERE state = 'queued' AND stopping_on IS NOT NULL
      AND (stopping_on = ANY($1::text[]) OR NOT stopping_on = ANY(coalesce($2::text[], ARRAY[stopping_on])))
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs SET stopping_on = NULL, updated_at = now()
FROM waiting
WHERE jobs.job_id = waiting.job_id
RETURNING jobs.job_id, jobs.epoch, waiting.stopping_on AS peer_id;
