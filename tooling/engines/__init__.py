"""Real cluster engines for backend tests (docs/design.md §7): a single-node Slurm and a
local Ray head, each started in a folder of its own and stopped by PID.

``slurm.start_slurm`` and ``ray.start_ray`` are what the ``tests/engines`` fixtures
call when no existing cluster is given in the environment.
"""
