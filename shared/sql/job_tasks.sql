-- Queries on `job_tasks`: one row per task of a gang's run (migration 0016). The owner
-- agent writes them through a function; every service, the web and the CLI read them.

-- job_tasks_report --
-- Peer $1 records its gangs' tasks: (job $2, epoch $3, index $4) on node $5, state $6,
-- exit code $7, log $8: new rows only of jobs it owns at that epoch, updates of its own
-- rows (a fenced run's end too) (function: migration 0016). How many rows were written.
SELECT irisfed_job_tasks_report($1, $2, $3, $4, $5, $6, $7, $8);

-- job_tasks_list --
-- A job's tasks, newest run (epoch) first, in index order.
SELECT job_id, epoch, task_index, peer_id, node, state, exit_code, log_path, updated_at
FROM job_tasks
WHERE job_id = $1
ORDER BY epoch DESC, task_index;
