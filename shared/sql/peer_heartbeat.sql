-- Queries on `peer_heartbeat`: the newest advertisement of each peer.

-- peer_heartbeat_upsert --
-- Keep only the newest heartbeat: a higher seq within a run, or any seq of a new run.
INSERT INTO peer_heartbeat (peer_id, run_id, seq, backends, ttl_s, sent_at, received_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now(), now() + make_interval(secs => $5))
ON CONFLICT (peer_id) DO UPDATE
SET run_id = EXCLUDED.run_id, seq = EXCLUDED.seq, backends = EXCLUDED.backends,
    ttl_s = EXCLUDED.ttl_s, sent_at = EXCLUDED.sent_at,
    received_at = EXCLUDED.received_at, expires_at = EXCLUDED.expires_at
WHERE peer_heartbeat.run_id <> EXCLUDED.run_id OR peer_heartbeat.seq < EXCLUDED.seq;

-- peer_heartbeat_upsert_batch --
-- Many heartbeats heard on NATS in one statement (the tick's batch, once per interval).
-- $7 is how long ago each was heard: one held back through an outage is stored as old
-- as it is, never as fresh, so a restarting service does not take a dead peer for alive.
INSERT INTO peer_heartbeat (peer_id, run_id, seq, backends, ttl_s, sent_at, received_at, expires_at)
SELECT peer_id, run_id, seq, backends::jsonb, ttl_s, sent_at,
       now() - make_interval(secs => age_s), now() - make_interval(secs => age_s) + make_interval(secs => ttl_s)
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::double precision[], $6::timestamptz[],
            $7::double precision[])
    AS t(peer_id, run_id, seq, backends, ttl_s, sent_at, age_s)
ON CONFLICT (peer_id) DO UPDATE
SET run_id = EXCLUDED.run_id, seq = EXCLUDED.seq, backends = EXCLUDED.backends,
    ttl_s = EXCLUDED.ttl_s, sent_at = EXCLUDED.sent_at,
    received_at = EXCLUDED.received_at, expires_at = EXCLUDED.expires_at
WHERE peer_heartbeat.run_id <> EXCLUDED.run_id OR peer_heartbeat.seq < EXCLUDED.seq;

-- peer_heartbeat_list --
-- All advertisements. The routing view uses age_s (Postgres's now() - received_at,
-- one clock) and places it on its own monotonic clock: no two hosts' wall clocks compared.
SELECT peer_id, run_id, seq, backends, ttl_s, sent_at, received_at, expires_at,
       extract(epoch FROM received_at)::double precision AS received_epoch,
       extract(epoch FROM now() - received_at)::double precision AS age_s,
       expires_at > now() AS reachable
FROM peer_heartbeat ORDER BY peer_id;

-- peer_heartbeat_list_news --
-- The advertisements newer than what a router's or tick's view holds ($1 peer ids, $2
-- their run ids, $3 their seqs): a new run or a higher seq, or a peer it lacks. Each
-- service re-reads the table every heartbeat interval, and most rows are the ones it
-- heard on NATS itself; sending and decoding 1,000 of them a second was a tenth of a
-- core. Columns as peer_heartbeat_list.
SELECT h.peer_id, h.run_id, h.seq, h.backends, h.ttl_s, h.sent_at, h.received_at, h.expires_at,
       extract(epoch FROM h.received_at)::double precision AS received_epoch,
       extract(epoch FROM now() - h.received_at)::double precision AS age_s,
       h.expires_at > now() AS reachable
FROM peer_heartbeat h
LEFT JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS held(peer_id, run_id, seq) ON held.peer_id = h.peer_id
WHERE held.peer_id IS NULL OR h.run_id <> held.run_id OR h.seq > held.seq
ORDER BY h.peer_id;
