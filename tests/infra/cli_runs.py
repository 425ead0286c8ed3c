"""The command line run in process (``irisfed.cli.main``) as a user runs it: no
``IRISFED_`` variable set, in a folder of its own (no ``.irisfed/connect.json``), its
federation.toml written there."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from irisfed.cli import main
from irisfed.tooling.federation import Peer, render_config


def bare_environment(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """No ``IRISFED_`` variable, and ``folder`` the working directory."""
    for name in [n for n in os.environ if n.startswith("IRISFED_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(folder)


def users_config(users: Iterable[Mapping[str, Any]]) -> str:
    """A federation.toml of peers home and gpu-west, and ``users`` (``[[users]]`` tables)."""
    return render_config([Peer("home"), Peer("gpu-west")], local_cluster="home", users=users)


def cli_on(database_url: str, users: Iterable[Mapping[str, Any]], folder: Path, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture) -> Callable[..., tuple[int, str, str]]:
    """``run(*args, config=True)`` → (exit code, stdout, stderr) of ``irisfed *args`` against
    ``database_url``, run in ``folder``; ``--config`` names a federation.toml there of
    ``users_config(users)`` unless ``config=False``."""
    bare_environment(monkeypatch, folder)
    (folder / "federation.toml").write_text(users_config(users))

    def run(*args: str, config: bool = True) -> tuple[int, str, str]:
        flags = ["--database-url", database_url] + (["--config", "federation.toml"] if config else [])
        code = main([*args, *flags])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
