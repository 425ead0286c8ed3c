"""The peer agent: one per cluster; advertises, accepts assignments, runs jobs, reports."""
