"""What a service process imports, and when: checked in a fresh interpreter, since the
test process has imported everything already. A service reads its schema head without
Alembic (and SQLAlchemy), and the Ray backend imports Ray when it is made."""

import subprocess
import sys


def test_a_service_starts_without_importing_alembic():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, irisfed.services.router.service, irisfed.services.tick.service, "
         "irisfed.services.peer_agent.service, irisfed.services.common.db as db; db.schema_head(); "
         "print(sorted(m for m in sys.modules if m.split('.')[0] in ('alembic', 'sqlalchemy')))"],
        capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_a_ray_backend_imports_ray_when_it_is_made_not_in_its_first_launch(tmp_path):
    """Importing Ray holds the GIL for about a second: at agent start, before the first
    heartbeat, never inside a running agent's first launch."""
    made = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from irisfed.services.peer_agent.backends import make_backend; "
         "before = 'ray.job_submission' in sys.modules; "
         f"make_backend('ray', Path({str(tmp_path)!r}), options={{'address': 'http://127.0.0.1:1'}}, peer_id='ml'); "
         "print(before, 'ray.job_submission' in sys.modules)"],
        capture_output=True, text=True, check=True)
    assert made.stdout.split() == ["False", "True"]
