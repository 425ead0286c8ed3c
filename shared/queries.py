"""Every SQL statement irisfed runs, by name: the schema's one read and write vocabulary.

Statements live in named blocks (``-- job_get --`` plus a line of purpose) in
``sql/<table>.sql``, one file per table, and are loaded once here. Only the text is
here, never a driver: the services' store (``irisfed.services.common.store``) and the
producers' client (``irisfed.reads``) both run these same statements, so a table's SQL
is written in one place whoever reads it.
"""

from __future__ import annotations

import re
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent / "sql"
_BLOCK = re.compile(r"^-- ([a-z_]+) --\s*$", re.MULTILINE)


def load_queries(folder: Path = SQL_DIR) -> dict[str, str]:
    """Every ``-- name --`` block of every ``.sql`` file in ``folder``, by name."""
    queries: dict[str, str] = {}
    for path in sorted(folder.glob("*.sql")):
        parts = _BLOCK.split(path.read_text())
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise ValueError(f"query {name} is defined twice")
            queries[name] = body.strip()
    return queries


QUERIES = load_queries()
