"""A local TCP port that accepts and counts connections and says nothing: pointed at by
a service's database and NATS URLs, it proves the service refused its flags before it
connected anywhere."""

from __future__ import annotations

import socket
import threading


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
