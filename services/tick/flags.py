"""``irisfed tick`` (``python -m services.tick``): its own flags, and how they become
``TickSettings``, where every default lives (a flag left out keeps it)."""

from __future__ import annotations

import argparse

from services.common.startup import given

COMMAND = "tick"
HELP = "run a scheduler tick (places queued jobs)"


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, help="queued jobs claimed per transaction")


def settings(args: argparse.Namespace, config):
    from services.tick.service import TickSettings

    return TickSettings(**given(args, batch_size="batch_size"))


def build(config, pool, nc, settings):
    from services.tick.service import Tick

    return Tick(config, pool, nc, settings)
