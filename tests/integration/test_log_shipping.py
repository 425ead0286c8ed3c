"""The agent's log shipping against a real nats-server with JetStream (docs/design.md
§3.6): files shipped in order into the peer's log stream, resumed by a new shipper
from where the stream says (nothing twice, nothing lost), capped at ``max_bytes``
with the gap shown, ended with the end message, and caught up after the stream
could not be written."""

from __future__ import annotations

import os

import pytest

from irisfed.services.common.logstore import LogStore, ensure_log_streams, log_stream
from irisfed.services.peer_agent.logs import LogShipper, run_files
from irisfed.shared.logs import assemble, dropped_text, log_subject
from tests.infra.waiting import wait_for

PEER = "gpu-west"


@pytest.fixture
async def logs(nats_client, subject_prefix):
    await ensure_log_streams(nats_client, subject_prefix, [PEER])
    return LogStore(nats_client, subject_prefix, PEER)


def shipper(store: LogStore, prefix: str, max_bytes: int = 1 << 20) -> LogShipper:
    return LogShipper(store, prefix, PEER, max_bytes)


async def read_all(store: LogStore, subject: str) -> tuple[bytes, bool]:
    pieces, seq = [], 1
    while batch := await store.read(subject, seq):
        pieces += batch
        seq = batch[-1].seq + 1
    data, _, ended = assemble(pieces, 0)
    return data, ended


async def test_output_is_shipped_in_order_and_ended_once_the_run_ends(tmp_path, logs, subject_prefix):
    run_dir = tmp_path / "job-1" / "epoch-1"
    run_dir.mkdir(parents=True)
    (run_dir / "stdout").write_bytes(b"")
    (run_dir / "stderr").write_bytes(b"warn\n")
    ship = shipper(logs, subject_prefix)
    ship.follow("job-1", 1, 1, str(run_dir))
    out = log_subject(subject_prefix, PEER, "job-1", 1, 0, "stdout")
    written = b""
    for i in range(5):
        line = f"line {i}\n".encode()
        with open(run_dir / "stdout", "ab") as handle:
            handle.write(line)
        written += line
        await ship.ship_pass()  # the first pass finds where the stream stopped: nothing yet
        await ship.ship_pass()
        assert (await read_all(logs, out)) == (written, False)  # live: shipped while it runs
    assert await ship.finish("job-1", 1, 1, str(run_dir))
    assert await read_all(logs, out) == (written, True)
    err = log_subject(subject_prefix, PEER, "job-1", 1, 0, "stderr")
    assert await read_all(logs, err) == (b"warn\n", True)
    assert ship.files == {} and ship.runs == {}


async def test_a_new_shipper_resumes_where_the_stream_stopped(tmp_path, logs, subject_prefix):
    """An agent restarted mid-run: no byte twice, none lost."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    path = run_dir / "stdout"
    path.write_bytes(b"".join(f"{i:05d}\n".encode() for i in range(1000)))
    first = shipper(logs, subject_prefix)
    first.follow("job.2", 3, 1, str(run_dir))
    await first.ship_pass()
    await first.ship_pass()
    with open(path, "ab") as handle:
        handle.write(b"after the restart\n")
    again = shipper(logs, subject_prefix)  # the old one is gone, its memory with it
    assert await again.finish("job.2", 3, 1, str(run_dir))
    subject = log_subject(subject_prefix, PEER, "job.2", 3, 0, "stdout")
    assert await read_all(logs, subject) == (path.read_bytes(), True)
    assert again.shipped == len(b"after the restart\n")
    third = shipper(logs, subject_prefix)  # a run ended and shipped whole: nothing more
    assert await third.finish("job.2", 3, 1, str(run_dir))
    assert third.shipped == 0


async def test_a_gang_ships_each_tasks_output_apart(tmp_path, logs, subject_prefix):
    run_dir = tmp_path / "g"
    for i in range(3):
        (run_dir / f"task-{i}").mkdir(parents=True)
        (run_dir / f"task-{i}" / "stdout").write_text(f"task {i}\n")
    ship = shipper(logs, subject_prefix)
    assert await ship.finish("g", 1, 3, str(run_dir))
    for i in range(3):
        subject = log_subject(subject_prefix, PEER, "g", 1, i, "stdout")
        assert await read_all(logs, subject) == (f"task {i}\n".encode(), True)
    assert [s for s, _ in run_files(str(run_dir), "g", 1, 3, subject_prefix, PEER)][:2] == [
        log_subject(subject_prefix, PEER, "g", 1, 0, "stdout"), log_subject(subject_prefix, PEER, "g", 1, 0, "stderr")]


async def test_at_most_max_bytes_are_kept_and_the_reader_is_told_what_was_dropped(tmp_path, logs, subject_prefix):
    run_dir = tmp_path / "big"
    run_dir.mkdir()
    cap = 300_000
    ship = shipper(logs, subject_prefix, max_bytes=cap)
    ship.follow("big", 1, 1, str(run_dir))
    await ship.ship_pass()
    written = bytearray()
    for i in range(8):  # 8 x 100 KB, shipped as it comes: the oldest purged
        chunk = bytes([65 + i]) * 100_000
        with open(run_dir / "stdout", "ab") as handle:
            handle.write(chunk)
        written += chunk
        await ship.ship_pass()
    with open(run_dir / "stdout", "ab") as handle:  # then 2 MB at once: skipped to its last 300 KB
        handle.write(b"z" * 2_000_000)
    written += b"z" * 2_000_000
    assert await ship.finish("big", 1, 1, str(run_dir))
    subject = log_subject(subject_prefix, PEER, "big", 1, 0, "stdout")
    shown, ended = await read_all(logs, subject)
    assert ended and shown == dropped_text(len(written) - cap) + b"z" * cap
    held = sum(len(p.data) for p in await logs.read(subject, 1, limit=1000))
    assert held <= cap


async def test_output_written_while_the_stream_is_missing_is_caught_up(tmp_path, nats_client, subject_prefix):
    """A store that does not take pieces never stops the run: the file waits on disk."""
    store = LogStore(nats_client, subject_prefix, PEER, timeout_s=2.0)
    run_dir = tmp_path / "late"
    run_dir.mkdir()
    (run_dir / "stdout").write_bytes(b"before\n")
    ship = shipper(store, subject_prefix)
    ship.follow("late", 1, 1, str(run_dir))
    await ship.ship_pass()
    assert ship.files[log_subject(subject_prefix, PEER, "late", 1, 0, "stdout")].failing
    await ensure_log_streams(nats_client, subject_prefix, [PEER])
    with open(run_dir / "stdout", "ab") as handle:
        handle.write(b"after\n")
    assert await ship.finish("late", 1, 1, str(run_dir))
    subject = log_subject(subject_prefix, PEER, "late", 1, 0, "stdout")
    assert await read_all(store, subject) == (b"before\nafter\n", True)
    assert log_stream(subject_prefix, PEER).endswith("-logs__gpu-west")


async def test_a_run_printing_200_mib_keeps_its_last_16_and_the_shipper_memory_stays_bounded(
        tmp_path, logs, subject_prefix):
    import tracemalloc

    mib = 1 << 20
    run_dir = tmp_path / "loud"
    run_dir.mkdir()
    ship = shipper(logs, subject_prefix, max_bytes=16 * mib)
    ship.follow("loud", 1, 1, str(run_dir), fresh=True)
    block = bytes(range(256)) * (mib // 256)
    tracemalloc.start()
    try:
        with open(run_dir / "stdout", "ab") as out:
            for i in range(200):  # 200 MiB printed while it is shipped, a pass every 2 MiB
                out.write(block[:-8] + f"{i:07d}\n".encode())
                out.flush()
                if i % 2:
                    await ship.ship_pass()
        assert await ship.finish("loud", 1, 1, str(run_dir))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 48 * mib  # a few passes' reads, never the file
    subject = log_subject(subject_prefix, PEER, "loud", 1, 0, "stdout")
    shown, ended = await read_all(logs, subject)
    written = 200 * mib
    assert ended and shown.startswith(dropped_text(written - 16 * mib))
    assert shown[len(dropped_text(written - 16 * mib)):] == (run_dir / "stdout").read_bytes()[-16 * mib:]
    held = sum(len(p.data) for p in await logs.read(subject, 1, limit=10_000, max_bytes=64 * mib))
    assert held <= 16 * mib


async def test_an_agent_started_later_ships_what_an_ended_run_could_not(tmp_path, nats_client, subject_prefix):
    """The run ended while the stream took nothing; its agent died before it could catch
    up: the next agent finds the run's mark (in its own folder) and ships the rest, once."""
    store = LogStore(nats_client, subject_prefix, PEER, timeout_s=2.0)
    marks = tmp_path / "marks"
    run_dir = tmp_path / "work" / "ended" / "epoch-2"
    run_dir.mkdir(parents=True)
    first = LogShipper(store, subject_prefix, PEER, 1 << 20, marks=marks)
    first.follow("ended", 2, 1, str(run_dir), fresh=True)  # launched: marked at once
    (run_dir / "stdout").write_bytes(b"all of it\n")
    assert not await first.finish("ended", 2, 1, str(run_dir))
    assert [p.name for p in marks.iterdir()] == ["ended.2.json"] and list(run_dir.iterdir()) == [run_dir / "stdout"]
    (marks / "planted.1.json").write_text('{"job_id": "bob:x", "epoch": 1, "tasks": 99999999, "log_dir": "/etc"}')
    (marks / "junk.json").write_text("not json")
    await ensure_log_streams(nats_client, subject_prefix, [PEER])
    later = LogShipper(store, subject_prefix, PEER, 1 << 20, marks=marks)  # the first agent is gone
    assert await later.resume_unshipped() == 1  # the marks that do not read as ours are dropped
    assert sorted(p.name for p in marks.iterdir()) == ["ended.2.json"]
    later.end_unless(set())  # not running any more: ship to its end
    await wait_for(lambda: _shipped(later), "the resumed run to be shipped whole")
    subject = log_subject(subject_prefix, PEER, "ended", 2, 0, "stdout")
    assert await read_all(store, subject) == (b"all of it\n", True)
    assert list(marks.iterdir()) == []
    assert await LogShipper(store, subject_prefix, PEER, 1 << 20, marks=marks).resume_unshipped() == 0


async def _shipped(ship: LogShipper) -> bool:
    await ship.ship_pass()
    return not ship.files


async def test_a_job_that_swaps_its_output_for_a_link_or_a_fifo_ships_nothing_of_them(tmp_path, logs,
                                                                                      subject_prefix):
    elsewhere = tmp_path / "agent-only"
    elsewhere.mkdir()
    secret = elsewhere / "stdout"
    secret.write_text("TOKEN=do-not-ship\n")
    run_dir = tmp_path / "run"
    (run_dir / "task-1").mkdir(parents=True)
    ship = shipper(logs, subject_prefix)
    ship.follow("swap", 1, 2, str(run_dir), fresh=True)
    (run_dir / "task-0").symlink_to(elsewhere)  # a task folder that is a link to a folder with a stdout
    (run_dir / "task-1" / "stdout").write_bytes(b"mine\n")
    await ship.ship_pass()
    (run_dir / "task-1" / "stdout").unlink()
    (run_dir / "task-1" / "stdout").symlink_to(secret)  # the file itself a link
    os.mkfifo(run_dir / "task-1" / "stderr")  # a FIFO no one writes: opening it must not block
    await ship.ship_pass()
    assert await ship.finish("swap", 1, 2, str(run_dir))
    shown = {task: await read_all(logs, log_subject(subject_prefix, PEER, "swap", 1, task, "stdout"))
             for task in (0, 1)}
    assert shown == {0: (b"", True), 1: (b"mine\n", True)}
    assert await read_all(logs, log_subject(subject_prefix, PEER, "swap", 1, 1, "stderr")) == (b"", True)


async def test_one_runs_flood_never_starves_anothers_output(tmp_path, logs, subject_prefix):
    ship = shipper(logs, subject_prefix, max_bytes=64 << 20)
    for name, size in (("flood", 40 << 20), ("quiet", 10)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "stdout").write_bytes(b"x" * size)
        ship.follow(name, 1, 1, str(tmp_path / name), fresh=True)
    await ship.ship_pass()
    quiet = await read_all(logs, log_subject(subject_prefix, PEER, "quiet", 1, 0, "stdout"))
    assert quiet == (b"x" * 10, False)  # shipped in the first pass beside the flood
