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
