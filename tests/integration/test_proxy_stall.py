"""The test proxy's stall mode: a server that hangs, as opposed to one that resets."""

from __future__ import annotations

import asyncio

import pytest

from tooling.proxy import TcpProxy


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


async def test_restore_with_drop_resets_the_stalled_connections_and_lets_new_ones_in(echo_port):
    proxy = TcpProxy("127.0.0.1", echo_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(reader, writer, b"x") == b"x"
        proxy.stall()
        writer.write(b"lost")
        await writer.drain()
        proxy.restore(drop=True)  # the hung server finally dies
        try:
            data = await asyncio.wait_for(reader.read(16), 5)
        except ConnectionResetError:
            data = b""
        assert data == b""  # reset or EOF, and never the held bytes
        fresh_reader, fresh_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(fresh_reader, fresh_writer, b"fresh") == b"fresh"
        fresh_writer.close()
    finally:
        proxy.close()


async def test_cut_during_a_stall_still_resets(echo_port):
    proxy = TcpProxy("127.0.0.1", echo_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(reader, writer, b"x") == b"x"
        proxy.stall()
        proxy.cut()
        try:
            data = await asyncio.wait_for(reader.read(16), 5)
        except ConnectionResetError:
            data = b""
        assert data == b""
        proxy.restore()
        fresh_reader, fresh_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(fresh_reader, fresh_writer, b"ok") == b"ok"
        fresh_writer.close()
    finally:
        proxy.close()
