"""A bare NATS echo responder: the request/reply baseline (``python -m irisfed.bench.echo URL SUBJECT``)."""

import asyncio
import signal
import sys

from irisfed.services.common.bus import connect_client


async def main(url: str, subject: str) -> None:
    nc = await connect_client(url)  # the URL's user and its own inbox prefix, like every client of ours

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, cb=echo)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
