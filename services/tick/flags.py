"""``irisfed tick`` (``python -m irisfed.services.tick``): its own flags, and how they become
``TickSettings``, where every default lives (a flag left out keeps it)."""

from __future__ import annotations

import argparse

from irisfed.services.common.startup import given

COMMAND = "tick"
HELP = "run a scheduler tick (places queued jobs)"


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, help="queued jobs claimed per transaction")
    p.add_argument("--policy", choices=("pack", "spread"),
                   help="placement policy: pack (best fit, the default) or spread (docs/scheduling.md)")
    p.add_argument("--reserve-after", type=_reserve_after, metavar="SECONDS",
                   help="wait after which a job holds the backend it fits soonest (default 300; 'off': never)")


def _reserve_after(text: str):
    return "off" if text.strip().lower() in ("off", "none", "never") else float(text)


def settings(args: argparse.Namespace, config):
    from irisfed.services.tick.service import TickSettings

    fields = given(args, batch_size="batch_size", policy="policy", reserve_after_s="reserve_after")
    if fields.get("reserve_after_s") == "off":
        fields["reserve_after_s"] = None
    return TickSettings(**fields)


def build(config, pool, nc, settings):
    from irisfed.services.tick.service import Tick

    return Tick(config, pool, nc, settings)
