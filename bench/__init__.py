"""Benchmarks: irisfed against raw NATS and Postgres baselines measured in the same run."""
