"""``irisfed router`` (``python -m irisfed.services.router``): its own flags, and how they become
``RouterSettings``, where every default lives (a flag left out keeps it)."""

from __future__ import annotations

import argparse

from irisfed.services.common.startup import ProcessSettings, given

COMMAND = "router"
HELP = "run a router (answers submit and cancel)"


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--writers", type=int, help="concurrent group-commit writers")
    p.add_argument("--max-queue", type=int,
                   help="submits waiting for a writer at most; more are answered unavailable")
    p.add_argument("--submit-timeout", type=float, metavar="SECONDS",
                   help="longest a submit waits for a writer, and for its commit, before unavailable")


def settings(args: argparse.Namespace, config):
    from irisfed.services.router.service import RouterSettings

    chosen = RouterSettings(**given(args, writers="writers", max_queue="max_queue", submit_timeout_s="submit_timeout"))
    db_pool = getattr(args, "db_pool", None)
    chosen.require_pool(ProcessSettings.db_pool if db_pool is None else db_pool)
    return chosen


def build(config, pool, nc, settings):
    from irisfed.services.router.service import Router

    return Router(config, pool, nc, settings)
