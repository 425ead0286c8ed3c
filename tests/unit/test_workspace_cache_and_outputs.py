"""The agent's workspace cache (fetch once, verify, evict least recently used but never
one a run holds, partial trees dropped at start), the choice of a run's outputs, the
client's output paths, and the workspace settings and wire field. No network: the
cache's fetch is a function over bytes held here."""

from __future__ import annotations

import asyncio
from pathlib import Path, PureWindowsPath

import msgspec
import pytest

from irisfed.errors import InvalidRequestError
from irisfed.services.common.objects import DigestMismatch, ObjectMissing, StoreUnavailable
from irisfed.services.peer_agent.outputs import Found, choose_outputs, scan_outputs
from irisfed.services.peer_agent.plan import unusable_workspace_move
from irisfed.services.peer_agent.workspaces import WorkspaceCache, WorkspaceUnusable
from irisfed.shared.config import parse_config
from irisfed.shared.errors import ConfigError, InvalidRequest
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.workspace import digest_of
from irisfed.transfer import Output, local_path
from tests.infra.archives import archive, member
from tests.infra.probes import returns
from tests.infra.waiting import wait_for

MIB = 1024 * 1024


def tree(name: str, size: int) -> bytes:
    return archive(member(f"{name}.bin", data=b"x" * size))


def cache_of(root: Path, store: dict[str, bytes], max_bytes: int = 10 * MIB) -> WorkspaceCache:
    async def fetch(digest: str, user: str, job, sink) -> None:
        if digest not in store:
            raise ObjectMissing(f"workspace {digest} is not in the object store")
        data = store[digest]
        for at in range(0, len(data), 1000):  # in chunks, as the router sends them
            sink(data[at:at + 1000])
            await asyncio.sleep(0)
    return WorkspaceCache(root, fetch, max_bytes=max_bytes, max_files=100, max_unpacked_bytes=10 * MIB)


async def test_a_digest_is_fetched_once_however_many_runs_ask_at_once(tmp_path):
    data = tree("a", 100)
    cache = await cache_of(tmp_path, {digest_of(data): data}).open()
    paths = await asyncio.gather(*(cache.acquire(digest_of(data)) for _ in range(5)))
    assert len(set(paths)) == 1 and (paths[0] / "a.bin").read_bytes() == b"x" * 100
    assert cache.fetches == 1 and cache.entries[("default", digest_of(data))].holders == 5


async def test_least_recently_used_trees_go_first_but_never_one_a_run_holds(tmp_path):
    blobs = {digest_of(d): d for d in (tree("a", 400_000), tree("b", 400_000), tree("c", 400_000))}
    a, b, c = blobs
    cache = await cache_of(tmp_path, blobs, max_bytes=900_000).open()
    held = await cache.acquire(a)  # held by a run throughout
    await cache.acquire(b)
    cache.release(b)
    await cache.acquire(c)  # over the cap: b (free, oldest free) goes, a stays
    assert set(cache.entries) == {("default", a), ("default", c)} and held.is_dir()
    assert not (tmp_path / "default" / b.removeprefix("sha256:")).exists()
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == sorted(d.removeprefix("sha256:") for d in (a, c))


async def test_partial_trees_left_by_a_killed_agent_are_dropped_and_whole_ones_kept(tmp_path):
    data = tree("a", 10)
    first = await cache_of(tmp_path, {digest_of(data): data}).open()
    await first.acquire(digest_of(data))
    mine = tmp_path / "default"
    (mine / ".abc.partial-1234").mkdir()
    (mine / ".abc.partial-1234" / "half").write_text("x")
    (mine / "not-a-digest").mkdir()
    (tmp_path / digest_of(data).removeprefix("sha256:")).mkdir()  # not under a user's folder
    (tmp_path / "Not-A-User").mkdir()
    again = await cache_of(tmp_path, {}).open()  # nothing fetchable: a whole tree is reused
    assert await again.acquire(digest_of(data)) == mine / digest_of(data).removeprefix("sha256:")
    assert again.fetches == 0
    assert [p.name for p in tmp_path.iterdir()] == ["default"]
    assert sorted(p.name for p in mine.iterdir()) == [digest_of(data).removeprefix("sha256:")]


async def test_unusable_workspaces_say_why_for_the_job(tmp_path):
    hostile = archive(member("../escape", data=b"x"))
    cache = await cache_of(tmp_path, {digest_of(hostile): hostile}).open()
    with pytest.raises(WorkspaceUnusable, match=r"^workspace refused: '\.\.' in path"):
        await cache.acquire(digest_of(hostile))
    missing = "sha256:" + "0" * 64
    with pytest.raises(WorkspaceUnusable, match=f"^workspace {missing} is no longer in the object store$"):
        await cache.acquire(missing)

    async def corrupt(digest, user, job, sink):
        raise DigestMismatch("the stored chunks do not match")
    cache.fetch = corrupt
    with pytest.raises(WorkspaceUnusable, match="^workspace refused: the stored chunks"):
        await cache.acquire("sha256:" + "1" * 64)
    with pytest.raises(WorkspaceUnusable, match="is not a workspace digest"):
        await cache.acquire("sha256:../../etc")
    assert [p for p in tmp_path.rglob("*") if p.name != "default"] == []  # nothing half unpacked


def found(name: str, size: int, regular: bool = True, task: int = 0) -> Found:
    return Found(task, name, Path(name), size, regular)


def test_outputs_within_the_cap_in_name_order_and_the_rest_listed_with_why():
    chosen = choose_outputs([found("a", 600), found("b", 500), found("c", 300), found("l", 0, regular=False),
                             found("bad\udcff", 1), found("ctl\n", 1), found("bad\\xff", 1)], max_bytes=1000)
    assert [(o.name, o.stored) for o in chosen] == [
        ("a", True), ("b", False), ("c", True), ("l", False), ("bad\\xff (2)", False), ("ctl\n", False),
        ("bad\\xff", True)]  # a real file of that name keeps it; the undecodable one is shown apart
    assert chosen[1].note == "over max_output_mb (0 MiB for the run)"
    assert chosen[3].note == "not a regular file"
    assert chosen[4].note == "its name is not UTF-8"
    assert chosen[5].note == "its name is too long or holds control characters"


def test_a_name_whose_object_would_not_fit_a_nats_subject_is_left_out():
    from irisfed.services.common.objects import output_object

    deep = "/".join(["é" * 127] * 8)  # 1,023 characters, each escaped to 6 bytes in the object's name
    chosen = choose_outputs([found(deep, 1), found("ok", 1)], max_bytes=10,
                            object_name=lambda task, name: output_object("alice:train-1", 1, task, name))
    assert [(o.stored, o.note) for o in chosen] == [(False, "its name is too long for the object store"),
                                                    (True, "")]
    assert len(chosen[0].name) <= 1024


def test_left_out_names_fit_a_row_and_never_collide():
    long_bad = "x" * 2000 + "\udcff"
    chosen = choose_outputs([found(long_bad, 1), found(long_bad[:-1] + "\udcfe", 1)], max_bytes=10)
    names = [o.name for o in chosen]
    assert all(len(n) <= 1024 for n in names) and len(set(names)) == 2


def test_scan_lists_files_and_links_below_each_tasks_folder_without_following(tmp_path):
    out = tmp_path / "out"
    (out / "deep").mkdir(parents=True)
    (out / "deep" / "f").write_text("12")
    (out / "up").symlink_to(tmp_path)
    (tmp_path / "secret").write_text("no")
    entries = scan_outputs([(0, out), (1, tmp_path / "absent")])
    assert [(e.task, e.name, e.size, e.regular) for e in entries] == [(0, "deep/f", 2, True),
                                                                      (0, "up", len(str(tmp_path)), False)]


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "a/..", "", "nul\x00", "..\\x"])
def test_an_output_name_never_leads_outside_the_folder(tmp_path, name):
    with pytest.raises(InvalidRequestError, match="is not a relative path"):
        local_path(tmp_path, Output(1, 0, name, 1, True, "", "p", None), by_task=False)


def test_a_gangs_outputs_land_under_their_task():
    output = Output(1, 3, "ckpt/model.pt", 1, True, "", "p", None)
    assert local_path(Path("/r"), output, by_task=True) == Path("/r/task-3/ckpt/model.pt")


def test_workspace_settings_default_and_refuse_nonsense():
    config = parse_config({"peers": [{"id": "home"}]})
    assert (config.max_workspace_mb, config.max_output_mb, config.output_retention_days) == (256, 1024, 7)
    assert parse_config({"peers": [{"id": "home"}], "max_workspace_mb": 8}).max_workspace_bytes == 8 * MIB
    for key, value in (("max_workspace_mb", 0), ("max_output_mb", "1"), ("max_workspace_files", True),
                       ("output_retention_days", -1)):
        with pytest.raises(ConfigError, match=key):
            parse_config({"peers": [{"id": "home"}], key: value})


def test_the_wire_field_is_strict_and_keeps_other_jobs_hashes():
    digest = "sha256:" + "a" * 64
    request = decode_request(SubmitRequest, msgspec.json.encode(
        {"command": ["python3", "train.py"], "workspace": {"digest": digest, "size": 10}}))
    assert request.workspace.digest == digest
    plain = SubmitRequest(command=["true"])
    assert b"workspace" not in plain.canonical_spec()
    for bad in ({"digest": "sha256:" + "A" * 64, "size": 1}, {"digest": digest, "size": -1},
                {"digest": digest, "size": 1, "extra": 1}, {"digest": digest + "\n", "size": 1}):
        with pytest.raises(InvalidRequest, match="workspace"):
            decode_request(SubmitRequest, msgspec.json.encode({"command": ["true"], "workspace": bad}))


def test_an_unusable_workspace_fails_the_job_for_good_or_kills_it_when_cancelled():
    move = unusable_workspace_move("p", "j", 3, "workspace refused: fifo", cancelled=False)
    assert (move.from_state, move.to_state, move.epoch, move.reason) == (
        JobState.RUNNING, JobState.FAILED, 3, "workspace refused: fifo")
    assert unusable_workspace_move("p", "j", 3, "x", cancelled=True).to_state is JobState.KILLED
    assert unusable_workspace_move("p", "j", 3, "x", cancelled=False, accepted=False).from_state is JobState.ASSIGNED


def test_a_workspace_deeper_than_the_limit_is_refused_both_ways(tmp_path):
    from irisfed.shared.workspace import (
        MAX_DEPTH,
        WorkspaceError,
        WorkspaceRefused,
        pack_workspace,
        unpack_workspace,
    )

    deep = tmp_path / "ws" / Path(*["d"] * (MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    with pytest.raises(WorkspaceError, match=f"deeper than {MAX_DEPTH} levels"):
        pack_workspace(tmp_path / "ws", MIB)
    data = archive(member("/".join(["d"] * 1500) + "/f", data=b"x"))
    with pytest.raises(WorkspaceRefused, match="deeper than"):
        unpack_workspace(data, tmp_path / "out", digest=digest_of(data), max_files=10_000, max_bytes=MIB)
    assert not (tmp_path / "out").exists()


async def test_a_peer_disk_error_is_not_a_refusal_of_the_workspace(tmp_path):
    data = tree("a", 10)
    cache = await cache_of(tmp_path / "cache", {digest_of(data): data}).open()
    (tmp_path / "cache").rmdir()
    (tmp_path / "cache").write_text("not a folder any more")  # the peer's disk in trouble
    with pytest.raises(NotADirectoryError):  # a launch error for the agent (retried), not "refused"
        await cache.acquire(digest_of(data))


def _leftovers(root: Path) -> list[str]:
    """What lies under ``root`` but the user's folder (a folder removed while walked: read again)."""
    while True:
        try:
            return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != "default")
        except FileNotFoundError:
            continue


async def test_a_tree_is_unpacked_while_its_bytes_arrive_and_named_only_once_verified(tmp_path):
    """The first member is on disk (in the partial folder) before the last bytes are
    sent; the tree gets its final name only after the fetch ended."""
    data = archive(member("first.bin", data=b"a" * 300_000), member("last.bin", data=b"b" * 300_000))
    digest = digest_of(data)
    final = tmp_path / "default" / digest.removeprefix("sha256:")

    async def fetch(digest: str, user: str, job, sink) -> None:
        sink(data[:len(data) // 2])
        half = await wait_for(lambda: returns(_partial_with(tmp_path, "first.bin")), "the first member to be unpacked")
        assert not final.exists()  # not named before the rest came and was checked
        assert (half / "first.bin").stat().st_size > 0
        sink(data[len(data) // 2:])
    cache = await WorkspaceCache(tmp_path, fetch, max_bytes=MIB, max_files=10, max_unpacked_bytes=MIB).open()
    path = await cache.acquire(digest)
    assert path == final and (path / "last.bin").read_bytes() == b"b" * 300_000
    assert _leftovers(tmp_path) == [f"default/{final.name}", f"default/{final.name}/first.bin",
                                    f"default/{final.name}/last.bin"]


def _partial_with(root: Path, name: str) -> Path | None:
    return next((p.parent for p in root.glob(f"default/.*.partial-*/{name}")), None)


async def test_bytes_garbled_on_the_way_are_a_transfer_error_even_when_the_archive_looks_hostile(tmp_path):
    """What came is not the digest's: retried (StoreUnavailable), never "refused", and no
    tree is left, named or partial."""
    good = tree("a", 200_000)
    hostile = archive(member("../escape", data=b"x"))
    for sent in (good[:-1] + b"!", hostile, good[: len(good) // 2]):
        cache = await cache_of(tmp_path, {digest_of(good): sent}).open()
        with pytest.raises(StoreUnavailable, match="are not the workspace"):
            await cache.acquire(digest_of(good))
        assert _leftovers(tmp_path) == [] and cache.entries == {}


async def test_a_fetch_failing_midway_leaves_nothing_and_raises_its_own_error(tmp_path):
    data = tree("a", 500_000)

    async def broken(digest: str, user: str, job, sink) -> None:
        sink(data[:100_000])
        await asyncio.sleep(0.01)
        raise StoreUnavailable("the router went away")
    cache = await WorkspaceCache(tmp_path, broken, max_bytes=MIB, max_files=10, max_unpacked_bytes=MIB).open()
    with pytest.raises(StoreUnavailable, match="the router went away"):
        await cache.acquire(digest_of(data))
    await wait_for(lambda: returns(_leftovers(tmp_path) == []), "the unpacking thread to drop its partial folder")
    assert cache.fetches == 0 and cache.entries == {}


async def test_each_user_gets_its_tree_from_its_own_bucket(tmp_path):
    """A user writes its own bucket's metadata: a tree made from another user's bytes is
    never handed to it, whatever digest it names."""
    data = tree("a", 10)
    asked: list[str] = []

    async def fetch(digest: str, user: str, job, sink) -> None:
        asked.append(user)
        sink(data)
    cache = await WorkspaceCache(tmp_path, fetch, max_bytes=MIB, max_files=100, max_unpacked_bytes=MIB).open()
    bob = await cache.acquire(digest_of(data), "bob")
    alice = await cache.acquire(digest_of(data), "alice")
    assert await cache.acquire(digest_of(data), "bob") == bob
    assert asked == ["bob", "alice"] and bob != alice and bob.parent.name == "bob"
    with pytest.raises(WorkspaceUnusable, match="is not a user id"):
        await cache.acquire(digest_of(data), "../x")


def test_folders_a_path_makes_count_as_entries(tmp_path):
    from irisfed.shared.workspace import WorkspaceRefused, unpack_workspace

    data = archive(*(member(f"{i}/a/b/c/f", data=b"") for i in range(5)))  # 5 files, 20 folders unlisted
    with pytest.raises(WorkspaceRefused, match="too many entries: more than 10"):  # 5 members alone fit
        unpack_workspace(data, tmp_path / "out", digest=digest_of(data), max_files=10, max_bytes=MIB)
    assert not (tmp_path / "out").exists()
    unpack_workspace(data, tmp_path / "ok", digest=digest_of(data), max_files=25, max_bytes=MIB)


@pytest.mark.parametrize("target", [".", "..", "../.."])
def test_a_symlink_to_a_folder_holding_it_is_refused_both_ways(tmp_path, target):
    """``a -> .`` stays inside, but a walk following links (cp -r, Ray's packaging of a
    working_dir) never ends."""
    import tarfile

    from irisfed.shared.workspace import (
        WorkspaceError,
        WorkspaceRefused,
        pack_workspace,
        unpack_workspace,
    )

    ws = tmp_path / "ws" / "x" / "y"
    ws.mkdir(parents=True)
    (ws / "f").write_text("x")
    (ws / "loop").symlink_to(target)
    with pytest.raises(WorkspaceError, match="a folder that holds it"):
        pack_workspace(tmp_path / "ws", MIB)
    data = archive(member("x", tarfile.DIRTYPE), member("x/y", tarfile.DIRTYPE),
                   member("x/y/loop", tarfile.SYMTYPE, link=target))
    with pytest.raises(WorkspaceRefused, match="symlink loop"):
        unpack_workspace(data, tmp_path / "out", digest=digest_of(data), max_files=10, max_bytes=MIB)
    assert not (tmp_path / "out").exists()


def test_a_link_to_a_sibling_folder_is_no_loop(tmp_path):
    import tarfile

    from irisfed.shared.workspace import unpack_workspace

    data = archive(member("a", tarfile.DIRTYPE), member("a/f", data=b"x"), member("b", tarfile.SYMTYPE, link="a"))
    unpack_workspace(data, tmp_path / "out", digest=digest_of(data), max_files=10, max_bytes=MIB)
    assert (tmp_path / "out" / "b" / "f").read_bytes() == b"x"


@pytest.mark.parametrize("name", ["D:/x", "D:x", "//server/share/x"])
def test_an_output_name_never_leaves_the_folder_for_another_drive(name):
    with pytest.raises(InvalidRequestError, match="is not a relative path"):
        local_path(PureWindowsPath("C:/Users/me/dl"), Output(1, 0, name, 1, True, "", "p", None), by_task=False)
