"""Files that hold secrets (passwords, URLs with credentials, tokens): mode 0600
before the secret goes in, so it is never readable by others even for an instant."""

from __future__ import annotations

from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, which is (or is made) mode 0600 first."""
    path.touch(mode=0o600)
    path.chmod(0o600)  # touch's mode does not apply to a file that already exists
    path.write_text(text)
