"""``irisfed router`` (``python -m services.router``): its own flags, and how they become
``RouterSettings``, where every default lives (a flag left out keeps it)."""

from __future__ import annotations

import argparse

from services.common.startup import given

COMMAND = "router"
HELP = "run a router (answers submit and cancel)"


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--writers", type=int, help="concurrent group-commit writers")
    p.add_argument("--max-queue", type=int,
                   help="submits waiting for a writer at most; more are answered unavailable")
    p.add_argument("--submit-timeout", type=float, metavar="SECONDS",
                   help="longest a submit waits for a writer, and for its commit, before unavailable")


def settings(args: argparse.Namespace, config):
    from services.router.service import RouterSettings

    return RouterSettings(**given(args, writers="writers", max_queue="max_queue", submit_timeout_s="submit_timeout"))


def build(config, pool, nc, settings):
    from services.router.service import Router

    return Router(config, pool, nc, settings)
