"""Live updates: changes coalesced per flush, bounded per viewer, as server-sent events."""

from __future__ import annotations

import asyncio
import json

from irisfed.services.web.live import (
    MAX_IDS,
    RESYNC,
    Batch,
    Broker,
    ChangeTail,
    Pending,
    sse_event,
    sse_lines,
)


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def test_changes_between_flushes_become_one_batch():
    pending = Pending()
    assert pending.take() is None
    for job_id in ("a", "b", "a"):
        pending.job(job_id)
    pending.peers()
    pending.live(False)
    assert pending.take() == Batch(jobs=("a", "b"), peers=True, live=False)
    assert pending.take() is None


def test_too_many_jobs_are_sent_as_many():
    pending = Pending()
    for i in range(MAX_IDS + 1):
        pending.job(f"j{i}")
    pending.job("later")
    assert pending.take() == Batch(all_jobs=True)


def test_a_batch_as_server_sent_events():
    text = sse_lines(Batch(jobs=("j1", "j\n2"), peers=True, live=True, resync=True))
    assert events(text) == [("mode", {"live": True}), ("resync", {}), ("jobs", {"all": False, "ids": ["j1", "j\n2"]}),
                            ("peers", {})]
    assert events(sse_lines(Batch(all_jobs=True))) == [("jobs", {"all": True, "ids": []})]
    assert sse_event("x", {"s": "</script>\r\n"}).count("\n") == 3  # JSON never breaks a line


def test_a_viewer_that_falls_behind_gets_one_resync_and_others_are_untouched():
    broker = Broker(queue_batches=3)
    slow, quick = broker.join(), broker.join()
    for i in range(10):
        broker.job_changed(f"j{i}")
        broker.flush()
        while not quick.queue.empty():
            assert quick.queue.get_nowait().jobs == (f"j{i}",)
    queued = [slow.queue.get_nowait() for _ in range(slow.queue.qsize())]
    assert len(queued) <= 3 and RESYNC in queued and slow.dropped > 0


def test_the_broker_caps_viewers_and_closing_ends_every_stream():
    broker = Broker(max_viewers=2)
    one, two = broker.join(), broker.join()
    assert broker.join() is None and broker.viewers == 2
    broker.leave(one)
    assert broker.join() is not None
    broker.close()
    assert two.queue.get_nowait() is None and broker.join() is None


async def test_a_stream_opens_with_the_mode_and_ends_when_the_broker_closes():
    broker = Broker(live=True)
    viewer = broker.join()
    stream = broker.stream(viewer, keepalive_s=60)
    first = await anext(stream)
    assert first.startswith("retry: ") and events(first.split("\n\n", 1)[1]) == [("mode", {"live": True})]
    assert broker.set_live(False) and not broker.set_live(False)
    broker.flush()
    assert events(await anext(stream)) == [("mode", {"live": False})]
    broker.close()
    assert [chunk async for chunk in stream] == []
    assert broker.viewers == 0


async def test_a_quiet_stream_sends_keepalives():
    broker = Broker()
    stream = broker.stream(broker.join(), keepalive_s=0.01)
    await anext(stream)
    assert await asyncio.wait_for(anext(stream), 10) == ": keepalive\n\n"
    await stream.aclose()
    assert broker.viewers == 0


def test_the_polling_tail_reports_each_change_once_even_out_of_order():
    tail = ChangeTail(top=100, overlap=10)
    assert tail.since() == 100
    assert tail.new([(101, "a"), (103, "b"), (103, "b")]) == ["a", "b"]
    assert tail.new([(101, "a"), (102, "late"), (103, "b"), (104, "c")]) == ["late", "c"]  # 102 committed late
    assert tail.new([(95, "before-start")]) == []  # older than the dashboard
    assert tail.new([(200 + i, f"j{i}") for i in range(30)])[-1] == "j29"
    assert tail.since() == 219 and tail.new([(205, "x")]) == []  # below the overlap: settled
