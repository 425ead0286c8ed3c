"""A local TCP port that accepts and counts connections and says nothing: pointed at by
a service's database and NATS URLs, it proves the service refused its flags before it
connected anywhere. A test module takes the ``listeners`` fixture by importing
``listeners_fixture``.

It opens sockets: never for tests/unit (whose guard refuses them)."""

from __future__ import annotations

import socket
import threading

import pytest


class CountingListener:
    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(name="listeners")
def listeners_fixture():
    """Two counting listeners: (database, NATS), closed when the test ends."""
    db, nats = CountingListener(), CountingListener()
    yield db, nats
    db.close()
    nats.close()
