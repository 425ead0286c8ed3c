"""``irisfed env``'s exports evaluated by a real shell: each variable holds exactly the
value ``irisfed up`` wrote, odd passwords included, and nothing in them runs."""

from __future__ import annotations

import os
import subprocess

from irisfed.cli.env import env_lines
from tests.infra.up_state import up_state

ODD_PASSWORD = "p'a\"ss $(touch /tmp/never) `x` w0rd"


def _evaluated(lines: list[str], *names: str) -> dict[str, str]:
    """What a shell has after ``eval`` of these lines."""
    script = "\n".join(lines) + "\n" + "".join(f'printf "%s\\0" "${name}"\n' for name in names)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                            env={"PATH": os.environ["PATH"]})
    return dict(zip(names, result.stdout.split("\0")[:-1], strict=True))


def test_producer_exports_its_nats_user_for_irisfed_and_for_other_nats_tools(tmp_path):
    lines = env_lines("producer", up_state(tmp_path))
    values = _evaluated(lines, "IRISFED_NATS_URL", "NATS_URL", "NATS_USER", "NATS_PASSWORD", "IRISFED_CONFIG",
                        "IRISFED_DATABASE_URL")
    assert values == {"IRISFED_NATS_URL": "nats://producer:pw1@127.0.0.1:4222", "NATS_URL": "nats://127.0.0.1:4222",
                      "NATS_USER": "producer", "NATS_PASSWORD": "pw1", "IRISFED_CONFIG": "/x/federation.toml",
                      "IRISFED_DATABASE_URL": ""}
    assert lines[0].startswith("# irisfed producer environment")
    assert lines[-1].startswith("#") and "nats context save irisfed-producer" in lines[-1]
    assert "--inbox-prefix _INBOX_producer" in lines[-1]


def test_operator_adds_the_database(tmp_path):
    lines = env_lines("operator", up_state(tmp_path))
    values = _evaluated(lines, "IRISFED_NATS_URL", "NATS_USER", "IRISFED_DATABASE_URL")
    assert values == {"IRISFED_NATS_URL": "nats://operator:pw2@127.0.0.1:4222", "NATS_USER": "operator",
                      "IRISFED_DATABASE_URL": "postgresql://postgres@127.0.0.1:5/irisfed"}
    assert "--inbox-prefix _INBOX_operator" in lines[-1]


def test_values_are_shell_quoted(tmp_path):
    from urllib.parse import quote

    url = f"nats://producer:{quote(ODD_PASSWORD, safe='')}@127.0.0.1:4222"
    values = _evaluated(env_lines("producer", up_state(tmp_path, url)), "NATS_PASSWORD", "IRISFED_NATS_URL")
    assert values == {"NATS_PASSWORD": ODD_PASSWORD, "IRISFED_NATS_URL": url}
    assert not os.path.exists("/tmp/never")
