-- Queries on `federation_changelog` (append-only; rows are written by jobs.sql
-- in the same statement as the state change they record).

-- changelog_list_for_job --
-- One job's whole history, oldest first.
SELECT seq, from_state, to_state, peer_id, epoch, at, actor, detail
FROM federation_changelog WHERE job_id = $1 ORDER BY seq;

-- changelog_get_last_for_job --
-- One job's newest changelog row: where its history stands (a fenced copy's note cites it).
SELECT seq, to_state, epoch, peer_id FROM federation_changelog
WHERE job_id = $1 ORDER BY seq DESC LIMIT 1;

-- changelog_list_all --
-- The whole changelog in replay order, for invariant checks and audits.
SELECT seq, job_id, from_state, to_state, peer_id, epoch, actor, detail
FROM federation_changelog ORDER BY job_id, seq;

-- changelog_list_since --
-- Changes after position $1, oldest first, at most $2 (the dashboard's polling while
-- NATS is away: which jobs moved). A range of the primary key.
SELECT seq, job_id FROM federation_changelog WHERE seq > $1 ORDER BY seq LIMIT $2;

-- changelog_get_bounds --
-- The first and last positions (NULLs: an empty changelog) and Postgres's now().
SELECT min(seq) AS first_seq, max(seq) AS last_seq, now() AS now FROM federation_changelog;

-- changelog_get_first_from_seq --
-- The first row at position $1 or later: its position and time. The dashboard's charts
-- bisect positions with it to find where a time window starts: `at` has no index (one
-- would cost every write), and positions follow `at` to within a transaction's length.
SELECT seq, at FROM federation_changelog WHERE seq >= $1 ORDER BY seq LIMIT 1;

-- changelog_count_by_minute --
-- The dashboard's charts: changes per minute and kind from position $1 on that happened
-- at $2 or later ('move' rows), with the current queued and per-peer running counts
-- ('now' rows) read in the same snapshot, so the charts can walk back from the counts
-- through the moves. A job leaving `running` for the queue (its peer lost) has no
-- peer on its row: the peer is that of the job's last start (federation_changelog_by_job).
WITH moves AS (
    SELECT date_trunc('minute', c.at) AS minute, c.from_state, c.to_state,
           CASE WHEN c.from_state = 'running' AND c.peer_id IS NULL THEN (
               SELECT r.peer_id FROM federation_changelog r
               WHERE r.job_id = c.job_id AND r.seq < c.seq AND r.to_state = 'running'
               ORDER BY r.seq DESC LIMIT 1)
           ELSE c.peer_id END AS peer_id
    FROM federation_changelog c
    WHERE c.seq >= $1 AND c.at >= $2
)
SELECT 'move' AS kind, minute, from_state, to_state, peer_id, count(*) AS n
FROM moves GROUP BY minute, from_state, to_state, peer_id
UNION ALL
SELECT 'now', now(), NULL, state, owner_peer_id, count(*)
FROM jobs WHERE state IN ('queued', 'running') GROUP BY state, owner_peer_id;
