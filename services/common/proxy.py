"""A TCP proxy that can cut, delay and restore connections, for partition tests.

It runs its own event loop in a thread, so it keeps forwarding while the caller
blocks (a test waiting on a subprocess, the chaos runner sleeping). Placed between
one peer agent and NATS or Postgres, it partitions that peer without touching the
servers. ``cut`` aborts every open connection and refuses new ones (they are
accepted and reset at once, like a host that went away); ``restore`` lets them in.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from services.common.servers import free_port


class TcpProxy:
    """127.0.0.1:``port`` → ``target_host``:``target_port``."""

    def __init__(self, target_host: str, target_port: int, port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self.delay_s = 0.0
        self._cut = False
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()
        self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self._cut:
                    break
                writer.write(chunk)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()

    async def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Partition: drop every connection now and refuse new ones."""
        self._cut = True
        self._call(self._abort_all())

    def restore(self) -> None:
        self._cut = False

    def delay(self, seconds: float) -> None:
        """Hold every chunk this long before forwarding it (0: no delay)."""
        self.delay_s = seconds

    def url_for(self, url: str) -> str:
        """``url`` (nats:// or postgresql://) rewritten to go through this proxy."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{self.port}"))

    def close(self) -> None:
        async def shutdown() -> None:
            await self._abort_all()
            if self._server is not None:
                self._server.close()
                with contextlib.suppress(Exception):
                    await self._server.wait_closed()

        with contextlib.suppress(Exception):
            self._call(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


def proxy_for(url: str) -> TcpProxy:
    """A proxy in front of the server ``url`` names."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    default = 4222 if parts.scheme.startswith("nats") else 5432
    return TcpProxy(parts.hostname or "127.0.0.1", parts.port or default)
