"""The schema head services check at start is read from the migration files, and agrees
with Alembic's (that a service reads it without importing Alembic is
tests/integration/test_service_imports.py)."""

import pytest
from alembic.script import ScriptDirectory

from irisfed.migrations import MIGRATIONS_DIR, head_revision


def test_the_head_read_from_the_files_is_alembics_head():
    assert head_revision() == ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()


def test_two_heads_are_an_error(tmp_path):
    for name, revision, down in [("a", "0001", "None"), ("b", "0002", '"0001"'), ("c", "0003", '"0001"')]:
        (tmp_path / f"{name}.py").write_text(f'revision = "{revision}"\ndown_revision = {down}\n')
    with pytest.raises(RuntimeError, match="2 heads"):
        head_revision(tmp_path)
    (tmp_path / "c.py").write_text('revision: str = "0003"\ndown_revision: str | None = "0002"\n')
    assert head_revision(tmp_path) == "0003"
