-- Queries on `job_dependencies`: one row per edge "job_id waits for needs" (migration
-- 0019). The router writes them with the job at submit; Postgres settles them when a
-- job ends (trigger irisfed_dependencies_settle); every service, the web and the CLI read them.

-- job_dependencies_lock --
-- The states of a submit's dependencies $1 (stored ids), locked FOR SHARE until its
-- transaction ends: an end racing the submit waits, then finds the edges written.
SELECT job_id, state FROM jobs WHERE job_id = ANY($1::text[]) ORDER BY job_id FOR SHARE;

-- job_dependencies_insert --
-- Job $1 waits for jobs $2 on conditions $3, $4 of them not ended yet.
WITH edges AS (
    INSERT INTO job_dependencies (job_id, needs, condition)
    SELECT $1, needs, condition FROM unnest($2::text[], $3::text[]) AS e(needs, condition)
)
UPDATE jobs SET deps_pending = $4 WHERE job_id = $1;

-- job_dependencies_of --
-- What job $1 waits for, each with its state now, in the order named.
SELECT d.needs AS job_id, d.condition, j.state
FROM job_dependencies d JOIN jobs j ON j.job_id = d.needs
WHERE d.job_id = $1
ORDER BY d.needs;

-- job_dependents_of --
-- The jobs that wait for job $1, each with its state now (the index on needs).
SELECT d.job_id, d.condition, j.state
FROM job_dependencies d JOIN jobs j ON j.job_id = d.job_id
WHERE d.needs = $1
ORDER BY d.job_id;

-- job_dependencies_insert_edges --
-- Edges only, many jobs at once (an array's elements): job $1[i] waits for $2[i] on $3[i].
-- The caller sets their pending counts (job_array_mark).
INSERT INTO job_dependencies (job_id, needs, condition)
SELECT job_id, needs, condition FROM unnest($1::text[], $2::text[], $3::text[]) AS e(job_id, needs, condition);
