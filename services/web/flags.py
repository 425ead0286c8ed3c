"""``irisfed web`` (``python -m irisfed.services.web``): its own flags, and how they become
``WebSettings``, where every default lives (a flag left out keeps it)."""

from __future__ import annotations

import argparse
import contextlib
import os

from irisfed.services.common.startup import given

COMMAND = "web"
HELP = "serve the live web dashboard (read-only; operators may cancel)"
# Starts without waiting for NATS: while NATS is away the pages poll Postgres and say so.
CONNECTS_NATS_ITSELF = True


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080)")
    p.add_argument("--root-path", help="path prefix when served behind a reverse proxy, e.g. /irisfed")
    p.add_argument("--viewers-per-client", type=int, metavar="N",
                   help="live-update streams one client address may hold (default 8; raise it when many "
                        "people share one address and no proxy forwards theirs)")
    p.add_argument("--refused-retry", type=float, metavar="SECONDS",
                   help="a page refused a live-update stream (too many open) asks for one again after this "
                        "long, refreshing itself meanwhile (default 30)")
    p.add_argument("--operator-token-file", metavar="PATH",
                   help="operators log in with the token in this file (default .irisfed/web-operator-token, "
                        "else $IRISFED_WEB_OPERATOR_TOKEN; none: view-only)")


def settings(args: argparse.Namespace, config):
    from irisfed.services.web.service import listen_socket
    from irisfed.services.web.settings import WebSettings, load_operator_token

    chosen = WebSettings(operator_token=load_operator_token(getattr(args, "operator_token_file", None)),
                         **given(args, host="host", port="port", root_path="root_path",
                                  viewers_per_client="viewers_per_client", refused_retry_s="refused_retry"))
    # The server binds once Postgres answers; a host or port that cannot be bound is
    # refused now, before anything connects, not after (or, Postgres away, never).
    listen_socket(chosen.host, chosen.port).close()
    return chosen


# The dashboard's process runs at this niceness (at least): on a machine it shares with
# the router, tick or agents, they get the CPU first and pages wait instead.
NICE = 5


def build(config, pool, nc, settings, connect_nats=None):
    from irisfed.services.web.service import WebService

    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, max(NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    return WebService(config, pool, nc, settings, connect_nats=connect_nats)
