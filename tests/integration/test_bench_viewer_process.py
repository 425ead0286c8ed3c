"""The bench's live-viewer process (bench.viewers.ViewerProcess): it opens the event
streams it is asked for against a real local server, counts what each receives, and
closes them; when no stream opens it says so instead of measuring nothing."""

import asyncio

import pytest


async def _tiny_sse_server(events_per_stream: int):
    """A local server answering each request with an event stream of ``mode`` then
    ``events_per_stream`` ``jobs`` events (what bench.viewers reads, not the dashboard)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\nevent: mode\ndata: {}\n\n")
        writer.write(b"event: jobs\ndata: []\n\n" * events_per_stream)
        await writer.drain()
        await reader.read()  # held open until the viewer closes
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_viewer_process_opens_counts_and_closes_its_streams():
    from irisfed.bench.deployment import bench_env
    from irisfed.bench.viewers import ViewerProcess

    server = await _tiny_sse_server(events_per_stream=3)
    port = server.sockets[0].getsockname()[1]
    async with server:
        viewers = await ViewerProcess.start(f"http://127.0.0.1:{port}", 4, bench_env())
        try:
            for _ in range(100):
                events, ended = await viewers.snapshot()
                if all(e.get("jobs") == 3 for e in events):
                    break
                await asyncio.sleep(0.05)
        finally:
            await viewers.close()
    assert events == [{"mode": 1, "jobs": 3}] * 4
    assert ended == [False] * 4
    assert viewers.process.returncode == 0


async def test_viewer_process_says_why_when_no_stream_opens():
    from irisfed.bench.deployment import bench_env
    from irisfed.bench.viewers import ViewerProcess
    from irisfed.tooling.servers import free_port

    with pytest.raises(RuntimeError, match="live viewers did not open"):
        await ViewerProcess.start(f"http://127.0.0.1:{free_port()}", 2, bench_env())
