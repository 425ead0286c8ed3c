-- Queries on `federation_sync_state`: how far each peer has synchronized each job.

-- sync_state_upsert --
-- Record that a peer synchronized a job up to changelog position $3 (and what it did).
INSERT INTO federation_sync_state (job_id, peer_id, synced_at, changelog_seq, epoch, note)
VALUES ($1, $2, now(), $3, $4, $5)
ON CONFLICT (job_id, peer_id) DO UPDATE
SET synced_at = now(),
    changelog_seq = GREATEST(federation_sync_state.changelog_seq, EXCLUDED.changelog_seq),
    epoch = EXCLUDED.epoch,
    note = EXCLUDED.note;

-- sync_state_get --
-- Every peer's synchronization of one job.
SELECT job_id, peer_id, synced_at, changelog_seq, epoch, note
FROM federation_sync_state WHERE job_id = $1 ORDER BY peer_id;
