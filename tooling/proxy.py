"""A TCP proxy that can cut, delay and restore connections, for partition tests.

It runs its own event loop in a thread, so it keeps forwarding while the caller
blocks (a test waiting on a subprocess, the chaos runner sleeping). Placed between
one peer agent and NATS or Postgres, it partitions that peer without touching the
servers. ``cut`` aborts every open connection and refuses new ones (they are
accepted and reset at once, like a host that went away); ``restore`` lets them in.
``stall`` is the other kind of failure: a server that hangs. Every connection stays
open and new ones are accepted, but not one byte moves in either direction, and
nothing is reset, so only the clients' own timeouts notice. ``restore`` then resumes
forwarding (what was held is delivered), or with ``drop=True`` resets every
connection that was open, like a hung server that finally dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from irisfed.tooling.servers import free_port


class TcpProxy:
    """127.0.0.1:``port`` → ``target_host``:``target_port``."""

    def __init__(self, target_host: str, target_port: int, port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self.delay_s = 0.0
        self._cut = False
        self._stalled = False
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None  # clear while stalled (made in the loop)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task] = set()
        self._accepted = 0
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()
        self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._accepted += 1
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._connections.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        self._writers.add(writer)
        await self._flowing.wait()  # a hung server accepts, then says nothing
        if self._cut or writer.transport.is_closing():
            writer.transport.abort()
            self._writers.discard(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()  # stalled: read nothing, so nothing moves
                chunk = await reader.read(65536)
                if not chunk:
                    break
                await self._flowing.wait()  # a chunk read as the stall began is held
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self._cut or writer.transport.is_closing():
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

    def connections_seen(self) -> int:
        """How many connections it has accepted so far (stalled or not)."""
        return self._accepted

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Partition: drop every connection now and refuse new ones."""
        self._cut = True
        self._call(self._abort_all())

    @property
    def is_stalled(self) -> bool:
        return self._stalled

    def stall(self) -> None:
        """Hang: keep every connection open (and accept new ones) but forward nothing."""
        self._stalled = True

        async def hold() -> None:
            self._flowing.clear()

        self._call(hold())  # in force when this returns

    def restore(self, drop: bool = False) -> None:
        """End a cut or a stall. After a stall, resume forwarding what was held, or with
        ``drop`` reset every connection that was open (new ones go through)."""
        self._cut = False
        if self._stalled:
            self._stalled = False

            async def resume() -> None:
                if drop:
                    await self._abort_all()
                self._flowing.set()

            self._call(resume())

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
            self._flowing.set()  # let stalled pipes see their aborted connections and end
            if self._connections:
                await asyncio.wait(list(self._connections), timeout=2)
            left = list(self._connections)  # e.g. still connecting to a target that is gone
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=2)
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


def servers_of(url: str) -> list[tuple[str, int]]:
    """Every (host, port) a URL names: libpq's ``postgresql://u@h1:p1,h2:p2/db`` or a
    NATS cluster's ``nats://u@h1:p1,nats://u@h2:p2``."""
    from urllib.parse import urlsplit

    scheme = url.split("://", 1)[0] if "://" in url else "nats"
    default = 4222 if scheme.startswith("nats") else 5432
    if scheme.startswith("postgres"):
        netloc = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
        hosts = netloc.rsplit("@", 1)[-1].split(",")
    else:
        hosts = [urlsplit(part.strip()).netloc.rsplit("@", 1)[-1] for part in url.split(",") if part.strip()]
    found = []
    for host in hosts:
        name, sep, port = host.rpartition(":")
        found.append((name or "127.0.0.1", int(port)) if sep and port.isdigit() else (host or "127.0.0.1", default))
    return found


class ProxyGroup:
    """One TcpProxy per server of a multi-host URL (a Patroni cluster's, a NATS
    cluster's), cut, stalled and restored together: a service's whole view of that
    cluster goes away, or hangs, at once."""

    def __init__(self, proxies: list[TcpProxy]) -> None:
        self.proxies = proxies

    @property
    def is_cut(self) -> bool:
        return any(p.is_cut for p in self.proxies)

    @property
    def is_stalled(self) -> bool:
        return any(p.is_stalled for p in self.proxies)

    def cut(self) -> None:
        for proxy in self.proxies:
            proxy.cut()

    def stall(self) -> None:
        for proxy in self.proxies:
            proxy.stall()

    def restore(self, drop: bool = False) -> None:
        for proxy in self.proxies:
            proxy.restore(drop=drop)

    def delay(self, seconds: float) -> None:
        for proxy in self.proxies:
            proxy.delay(seconds)

    def url_for(self, url: str) -> str:
        """``url`` with its i-th server replaced by the i-th proxy."""
        from urllib.parse import urlsplit, urlunsplit

        ports = [f"127.0.0.1:{p.port}" for p in self.proxies]
        if url.startswith("postgres"):
            scheme, rest = url.split("://", 1)
            netloc, sep, tail = rest.partition("/")
            userinfo = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
            return f"{scheme}://{userinfo}{','.join(ports)}{sep}{tail}"
        parts = [urlsplit(part.strip()) for part in url.split(",") if part.strip()]
        return ",".join(urlunsplit(p._replace(netloc=(p.netloc.rsplit("@", 1)[0] + "@" if "@" in p.netloc else "")
                                               + port)) for p, port in zip(parts, ports, strict=True))

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()


def proxy_for(url: str) -> TcpProxy | ProxyGroup:
    """A proxy in front of the server ``url`` names (a group of them for several)."""
    servers = servers_of(url)
    if len(servers) == 1:
        return TcpProxy(*servers[0])
    return ProxyGroup([TcpProxy(host, port) for host, port in servers])
