"""What ``pip install .`` puts in site-packages: one name, ``irisfed``, and everything
the services read at run time (SQL, migrations, the dashboard's files).

The wheel is built from this checkout and unpacked into a folder of its own, then
imported from there by a fresh interpreter started outside the checkout, so neither
the repository's folders nor the editable install can stand in for what is missing.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, cwd=out)
    [built] = out.glob("irisfed-*.whl")
    return built


def test_the_distribution_installs_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [top_level] = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["irisfed"]
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"irisfed"}


def test_an_installed_copy_has_everything_the_services_read(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    # bin/ holds the `irisfed` script; no other importable name lands beside the package.
    assert {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")} - {"bin"} == {"irisfed"}
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import irisfed, irisfed.shared.queries as q, irisfed.migrations as m;"
        "import irisfed.services.web.app, irisfed.cli, irisfed.client;"
        "from irisfed.services.common import db;"
        "assert irisfed.__file__.startswith(sys.argv[1]), irisfed.__file__;"
        "assert q.SQL_DIR.is_relative_to(sys.argv[1]) and 'job_get' in q.QUERIES;"
        "assert m.MIGRATIONS_DIR.is_relative_to(sys.argv[1]);"
        "assert (m.MIGRATIONS_DIR / 'alembic.ini').exists() and (m.MIGRATIONS_DIR / 'env.py').exists();"
        "print(db.schema_head())"
    )
    found = subprocess.run([sys.executable, "-c", probe, str(target)], capture_output=True, text=True, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    from irisfed.migrations import head_revision
    assert found.stdout.strip() == head_revision()
    web = target / "irisfed" / "services" / "web"
    assert list((web / "templates").glob("*.html")) and list((web / "static").glob("*.js"))
