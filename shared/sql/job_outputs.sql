-- Queries on `job_outputs`: one row per file a run left in IRISFED_OUTPUT_DIR (migration
-- 0017). The owner agent writes them through a function; every service, the web and the
-- CLI read them. The bytes are in the object store (services/common/objects.py).

-- job_outputs_record --
-- Peer $1 records its runs' output files: (job $2, epoch $3, task $4, name $5, size $6,
-- stored $7, note $8), only of jobs it owns at that epoch (function: migration 0017).
-- How many rows were written.
SELECT irisfed_run_outputs_record($1, $2, $3, $4, $5, $6, $7, $8);

-- job_outputs_list --
-- A job's output files: of epoch $2 (NULL: its newest epoch that has any), task $3
-- (NULL: every task), in task and name order.
SELECT job_id, epoch, task_index, name, size, stored, note, peer_id, stored_at
FROM job_outputs
WHERE job_id = $1
  AND epoch = coalesce($2, (SELECT max(epoch) FROM job_outputs WHERE job_id = $1))
  AND ($3::integer IS NULL OR task_index = $3)
ORDER BY task_index, name;
