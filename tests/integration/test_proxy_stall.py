"""The test proxy's stall mode: a server that hangs, as opposed to one that resets."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from irisfed.tooling.proxy import TcpProxy


@pytest.fixture
async def echo_port():
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _roundtrip(reader, writer, data: bytes, timeout: float = 5.0) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), timeout)


async def test_stall_holds_every_byte_without_a_reset_and_restore_delivers_them(echo_port):
    proxy = TcpProxy("127.0.0.1", echo_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(reader, writer, b"before") == b"before"

        proxy.stall()
        assert proxy.is_stalled
        writer.write(b"held")
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.5)
        assert not reader.at_eof()  # no reset, no EOF: the connection just hangs
        # A new connection is accepted (like a hung server's listen backlog), then hangs too.
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        late_writer.write(b"late")
        await late_writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(late_reader.read(1), 0.3)

        proxy.restore()  # resume: what was held is delivered, in order
        assert not proxy.is_stalled
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
        assert await asyncio.wait_for(late_reader.readexactly(4), 5) == b"late"
        assert await _roundtrip(reader, writer, b"after") == b"after"
        writer.close()
        late_writer.close()
    finally:
        proxy.close()


async def _reset_or_eof(reader) -> bytes:
    """What a stalled connection reads once the proxy drops it: nothing (a reset or EOF)."""
    try:
        return await asyncio.wait_for(reader.read(16), 5)
    except ConnectionResetError:
        return b""


async def _served_again(proxy: TcpProxy, data: bytes) -> bytes:
    """A fresh connection through ``proxy`` echoes ``data``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        return await _roundtrip(reader, writer, data)
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def _stalled(echo_port: int):
    """A proxy to the echo server with one connection that worked, then stalled."""
    proxy = TcpProxy("127.0.0.1", echo_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(reader, writer, b"x") == b"x"
        proxy.stall()
        yield proxy, reader, writer
    finally:
        proxy.close()


async def test_restore_with_drop_resets_the_stalled_connections_and_lets_new_ones_in(echo_port):
    async with _stalled(echo_port) as (proxy, reader, writer):
        writer.write(b"lost")
        await writer.drain()
        proxy.restore(drop=True)  # the hung server finally dies
        assert await _reset_or_eof(reader) == b""  # and never the held bytes
        assert await _served_again(proxy, b"fresh") == b"fresh"


async def test_cut_during_a_stall_still_resets(echo_port):
    async with _stalled(echo_port) as (proxy, reader, _):
        proxy.cut()
        assert await _reset_or_eof(reader) == b""
        proxy.restore()
        assert await _served_again(proxy, b"ok") == b"ok"
