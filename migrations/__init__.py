"""Alembic migrations for irisfed's Postgres schema (async env on asyncpg)."""

import re
from pathlib import Path

MIGRATIONS_DIR = Path(__file__).resolve().parent

_REVISION = re.compile(r'^(down_revision|revision)\s*(?::[^=]*)?=\s*["\']?([^"\'\s]*)["\']?\s*$', re.MULTILINE)


def head_revision(versions: Path = MIGRATIONS_DIR / "versions") -> str:
    """The newest revision, read from the migration files' ``revision``/``down_revision``
    lines without importing Alembic (services check the schema at every start). A
    history that is not one straight line is an error here, as it would be to Alembic's
    ``get_current_head``; tests/integration/test_migrations.py checks both agree."""
    revisions: dict[str, str] = {}
    for path in sorted(versions.glob("*.py")):
        found = dict((key, value) for key, value in _REVISION.findall(path.read_text()))
        if "revision" in found:
            revisions[found["revision"]] = "" if found.get("down_revision") in (None, "None") else found["down_revision"]
    heads = set(revisions) - set(revisions.values())
    if len(heads) != 1:
        raise RuntimeError(f"{versions} has {len(heads)} heads ({', '.join(sorted(heads))}), not one")
    return heads.pop()
