"""What the command line prints, captured as a wide truecolor terminal shows it, and the
checks that hostile strings (rich markup, emoji codes, tabs, line breaks, ESC, bidi
controls) show literally: never as terminal control, markup or a faked row."""

from __future__ import annotations

import contextlib
import io

from rich.console import Console

from irisfed.cli import views

# Tabs and line breaks would fake rows in plain and TSV output; ESC and bidi controls
# would drive the terminal; brackets and colons would be rich markup and emoji.
HOSTILE = "[bold]x[/]:smile:\tFAKE\nrow\r\x1b[31m\u202eevil"
# Retitle the terminal, clear it, turn it red.
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"


def truecolor_console(width: int = 500) -> Console:
    """A terminal (colours and all) writing into a string: ``console.file.getvalue()``."""
    return Console(file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor")


def capture(mode: str, draw) -> str:
    """What ``draw(out)`` prints in ``mode`` (a wide truecolor terminal for tables)."""
    console = truecolor_console(width=400)
    out = views.Out(mode, wide=True, console_=console)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        draw(out)
    return console.file.getvalue() + printed.getvalue()


def assert_safe(text: str, mode: str) -> None:
    """``HOSTILE`` shows, literally, and cannot drive the terminal or fake a row."""
    assert "\x1b[31m" not in text and "\u202e" not in text and "\r" not in text, repr(text)
    assert "\\x1b[31m" in text and "\\u202e" in text
    assert "[bold]x[/]:smile:" in text and "😄" not in text
    if mode != "table":
        assert not any(line.startswith(("FAKE", "row")) for line in text.splitlines()), text


def job_table(job, history, *details) -> str:
    """What ``irisfed job`` shows of ``job`` on a wide truecolor terminal (``details``:
    its tasks, then its outputs, as ``views.print_job`` takes them)."""
    console = truecolor_console()
    views.print_job(job, history, views.Out("table", True, console), *details)
    return console.file.getvalue()
