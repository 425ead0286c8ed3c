"""Live dashboard viewers for the ``web`` section, in a process of their own.

``python -m irisfed.bench.viewers BASE COUNT`` opens COUNT ``/events`` streams on the
dashboard at BASE (raw sockets, as an ``EventSource`` holds them: every ``event:``
line counted, no page re-fetched), prints one JSON line when they are open, then
answers each ``snapshot`` line on stdin with one JSON line of counts, and closes
them on ``close`` (or end of input).

A process of its own because real viewers are browsers on other machines: the
bench process times each job's events as its own event loop hears them, and 100
sockets read on that same loop after every flush would delay those timestamps and
bill the bench's own work to the dashboard.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


class EventCounter:
    """Counts server-sent events in a byte stream read in arbitrary pieces: each event
    has one ``event: <name>`` line (see ``irisfed.services.web.live``)."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self._partial = b""

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith(b"event: "):
                name = line[7:].strip().decode("ascii", "replace")
                self.events[name] = self.events.get(name, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.events.values())


class SseClient:
    """One ``/events`` stream over a raw socket, its events counted."""

    def __init__(self, host: str, port: int, address: str) -> None:
        self.host, self.port = host, port
        self.address = address  # the browser's, as a proxy in front would forward it
        self.counter = EventCounter()
        self.status = 0
        self.ended = False
        self._task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._writer = writer
        writer.write(f"GET /events HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAccept: text/event-stream\r\n"
                     f"X-Forwarded-For: {self.address}\r\nCache-Control: no-cache\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1])
        self._task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        # Chunked transfer encoding: chunk-size lines never start with "event: ", so the
        # counter can read the raw body.
        try:
            while data := await reader.read(65536):
                self.counter.feed(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        self.ended = True

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass


def snapshot(viewers: list[SseClient]) -> dict[str, Any]:
    return {"events": [dict(v.counter.events) for v in viewers], "ended": [v.ended for v in viewers]}


async def open_viewers(base: str, count: int) -> list[SseClient]:
    """``count`` open streams, each past its opening ``mode`` event; RuntimeError if
    the dashboard refused any."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    # Each stream from its own browser (the dashboard allows a few streams per client
    # address; uvicorn takes it from X-Forwarded-For when the connection is local).
    viewers = [SseClient(host, int(port), f"10.0.{n // 250}.{n % 250 + 1}") for n in range(count)]
    await asyncio.gather(*(v.open() for v in viewers))
    refused = [v.status for v in viewers if v.status != 200]
    if refused:
        for v in viewers:
            await v.close()
        raise RuntimeError(f"{len(refused)} of {count} /events streams refused: {refused[:5]}")
    for _ in range(100):  # each stream opens with its "mode" event
        if all(v.counter.total for v in viewers):
            break
        await asyncio.sleep(0.05)
    return viewers


async def _serve(base: str, count: int) -> int:
    try:
        viewers = await open_viewers(base, count)
    except (OSError, RuntimeError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps({"opened": len(viewers)}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "snapshot":
                print(json.dumps(snapshot(viewers)), flush=True)
            elif line.strip() == "close":
                break
    finally:
        for v in viewers:
            await v.close()
    return 0


class ViewerProcess:
    """The bench's handle on a ``python -m irisfed.bench.viewers`` child."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, base: str, count: int, env: dict[str, str]) -> ViewerProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "irisfed.bench.viewers", base, str(count), env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        viewers = cls(process)
        first = await viewers._answer(patience_s=60)
        if "opened" not in first:
            await viewers.close()
            raise RuntimeError(f"live viewers did not open: {first.get('error', first)}")
        return viewers

    async def _answer(self, patience_s: float = 10) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), patience_s)
        if not line:
            raise RuntimeError(f"the live viewers' process ended (exit {await self.process.wait()})")
        return json.loads(line)

    async def snapshot(self) -> tuple[list[dict[str, int]], list[bool]]:
        """Each stream's event counts so far, and whether it has ended."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"snapshot\n")
        await self.process.stdin.drain()
        answer = await self._answer()
        return answer["events"], answer["ended"]

    async def close(self) -> None:
        if self.process.returncode is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(b"close\n")
                await self.process.stdin.drain()
                await asyncio.wait_for(self.process.wait(), 10)
            except (OSError, TimeoutError):
                self.process.kill()  # our own child, by its handle
                await self.process.wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(_serve(sys.argv[1], int(sys.argv[2]))))
