"""A message whose header no one can read never stops a service from hearing: nats-py
decodes a header's status line outside its own error handling, and a status that is
not UTF-8 would end the connection's read loop for good (the connection looking alive
until its pings time out, minutes later). Anyone who may publish on a subject a
service hears (a user on its own submit subject) could so deafen every router in turn.
Real nats-server, a raw socket speaking the protocol, the router as it runs."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

from tests.infra.routers import RouterThread

BAD_HEADER = b"NATS/1.0 \xff\xfe\xfd\r\n\r\n"


def publish_raw(url: str, subject: str, header: bytes, payload: bytes) -> None:
    """HPUB ``subject`` with ``header`` as it is, as ``url``'s user, over a socket of its own."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as raw:
        raw.recv(65536)  # INFO
        connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True}
        if parts.username:
            connect.update(user=parts.username, **{"pass": parts.password})
        raw.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\n")
        raw.sendall(b"HPUB %s %d %d\r\n" % (subject.encode(), len(header), len(header) + len(payload))
                    + header + payload + b"\r\nPING\r\n")
        answer = b""
        while b"PONG" not in answer and b"-ERR" not in answer:
            chunk = raw.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert b"PONG" in answer, answer  # the server took it and passed it on


def test_a_submit_with_an_unreadable_header_leaves_the_router_hearing(database_url, servers):
    router = RouterThread(database_url, servers.nats_url)
    try:
        body = json.dumps({"job_id": "bad", "command": ["true"]}).encode()
        for _ in range(3):
            publish_raw(servers.nats_url, f"{router.prefix}.submit", BAD_HEADER, body)
        reply = json.loads(router.reply_to("submit", {"job_id": "after", "command": ["true"]}))
        assert reply["job_id"] == "after" and "error" not in reply, reply
        assert json.loads(router.reply_to("submit", {"job_id": "bad", "command": ["true"]}))["duplicate"] is False
    finally:
        router.close()
