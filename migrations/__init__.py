"""Alembic migrations for irisfed's Postgres schema (async env on asyncpg)."""

from pathlib import Path

MIGRATIONS_DIR = Path(__file__).resolve().parent
