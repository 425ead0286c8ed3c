"""Workspaces pack into one digest per tree and unpack only inside their directory.

Packing: what travels (.git and .irisfedignore rules), what is refused before any
byte is returned. Unpacking: every refusal checked with a hand-built hostile
archive, and after each one nothing exists outside the sandbox and no dest.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from irisfed.shared.workspace import (
    DIGEST_RE,
    PackedWorkspace,
    WorkspaceError,
    WorkspaceRefused,
    copy_tree,
    digest_of,
    pack_workspace,
    unpack_workspace,
)
from tests.infra.archives import archive, member

BIG = 64 * 1024 * 1024


def write(path: Path, text: str = "", mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mode is not None:
        os.chmod(path, mode)
    return path


def names_in(packed: PackedWorkspace) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:") as tar:
        return [member.name for member in tar]


def packed_names(root: Path) -> set[str]:
    return set(names_in(pack_workspace(root, BIG)))


def make_tree(root: Path) -> Path:
    write(root / "run.sh", "#!/bin/sh\necho hi\n", 0o755)
    write(root / "data" / "nested" / "deep" / "input.txt", "payload\n", 0o640)
    write(root / "data" / "empty.bin", "")
    write(root / "data" / ("long-name-" * 15) / "café.txt", "unicode and a >100 character path\n")
    os.symlink("../run.sh", root / "data" / "run-link")
    os.symlink("data/nested", root / "nested-link")
    return root


def test_digest_of_is_sha256_with_prefix():
    assert digest_of(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert DIGEST_RE.fullmatch(digest_of(b"x"))
    assert not DIGEST_RE.fullmatch("sha256:" + "A" * 64)


def test_round_trip_keeps_files_modes_links_and_nested_directories(tmp_path):
    root = make_tree(tmp_path / "ws")
    packed = pack_workspace(root, BIG)
    assert packed.size == len(packed.data) and packed.digest == digest_of(packed.data)
    assert packed.files == len(names_in(packed)) == 10  # 4 directories, 4 files, 2 links
    dest = tmp_path / "out"
    stats = unpack_workspace(packed.data, dest, digest=packed.digest, max_files=100, max_bytes=BIG)
    assert stats.files == packed.files
    assert stats.bytes == sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    assert (dest / "run.sh").read_text() == "#!/bin/sh\necho hi\n"
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "data/nested/deep/input.txt").stat().st_mode) == 0o640
    assert (dest / "data/empty.bin").read_bytes() == b""
    assert (dest / "data" / ("long-name-" * 15) / "café.txt").read_text().startswith("unicode")
    assert os.readlink(dest / "data/run-link") == "../run.sh"
    assert os.readlink(dest / "nested-link") == "data/nested"
    assert (dest / "nested-link" / "deep" / "input.txt").read_text() == "payload\n"
    assert sorted(os.listdir(tmp_path)) == ["out", "ws"]  # no partial directory left beside dest


def test_archive_is_sorted_with_zero_times_and_owners(tmp_path):
    packed = pack_workspace(make_tree(tmp_path / "ws"), BIG)
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    assert {m.type for m in members} <= {tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE}


def test_same_tree_gives_the_same_digest_after_touching_mtimes_and_elsewhere(tmp_path):
    first = pack_workspace(make_tree(tmp_path / "a"), BIG)
    assert pack_workspace(tmp_path / "a", BIG).digest == first.digest
    for path in (tmp_path / "a").rglob("*"):
        os.utime(path, (1_000_000, 1_000_000), follow_symlinks=False)
    assert pack_workspace(tmp_path / "a", BIG).digest == first.digest
    assert pack_workspace(make_tree(tmp_path / "b"), BIG).digest == first.digest
    os.chmod(tmp_path / "b" / "run.sh", 0o700)
    assert pack_workspace(tmp_path / "b", BIG).digest != first.digest  # modes are content


def test_hard_links_are_packed_as_separate_regular_files(tmp_path):
    root = tmp_path / "ws"
    write(root / "one", "same bytes")
    os.link(root / "one", root / "two")
    packed = pack_workspace(root, BIG)
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:") as tar:
        assert [(m.name, m.type, m.size) for m in tar] == [("one", tarfile.REGTYPE, 10), ("two", tarfile.REGTYPE, 10)]
    unpack_workspace(packed.data, tmp_path / "out", digest=packed.digest, max_files=10, max_bytes=100)
    assert (tmp_path / "out/one").stat().st_ino != (tmp_path / "out/two").stat().st_ino


def test_git_is_left_out_anywhere(tmp_path):
    root = tmp_path / "ws"
    write(root / ".git" / "config", "[core]")
    write(root / "vendor" / "lib" / ".git", "gitdir: /elsewhere")  # a worktree's gitlink file
    write(root / "vendor" / "lib" / "code.py", "x = 1")
    write(root / ".gitignore", "*.o")
    assert packed_names(root) == {".gitignore", "vendor", "vendor/lib", "vendor/lib/code.py"}


def test_irisfedignore_rules(tmp_path):
    root = tmp_path / "ws"
    write(root / ".irisfedignore", "\n".join([
        "# comments and blank lines are not patterns",
        "",
        "*.log",
        "!keep.log",           # negation: re-included
        "build/",              # directories only, at any depth
        "/top.txt",            # anchored: only at the root
        "docs/*.tmp",          # a slash in the middle anchors too
        "**/cache/**",         # everything inside any cache directory
        "data-?.csv",
        "img[0-9].png",
        "deep/**/x.bin",
    ]) + "\n")
    for name in ["a.log", "keep.log", "sub/b.log", "sub/keep.log", "build/out.o", "src/build/out.o", "notes/build",
                 "top.txt", "sub/top.txt", "docs/a.tmp", "sub/docs/a.tmp", "cache/c1", "sub/cache/c2",
                 "data-1.csv", "data-12.csv", "img7.png", "imgx.png", "deep/x.bin", "deep/a/b/x.bin", "main.py"]:
        write(root / name, "x")
    assert packed_names(root) == {
        ".irisfedignore", "keep.log", "sub", "sub/keep.log", "src", "notes", "notes/build",  # build/ is dirs only
        "sub/top.txt", "docs", "sub/docs", "sub/docs/a.tmp", "cache", "sub/cache",  # cache dirs stay, empty
        "data-12.csv", "imgx.png", "deep", "deep/a", "deep/a/b", "main.py"}


def test_an_ignored_directory_cannot_be_re_included_and_its_contents_are_not_read(tmp_path):
    root = tmp_path / "ws"
    write(root / ".irisfedignore", "private/\n!private/wanted\n")
    write(root / "private" / "wanted", "x")
    os.mkfifo(root / "private" / "pipe")  # would be refused if the walk went in
    assert packed_names(root) == {".irisfedignore"}


def test_an_ignored_fifo_is_fine(tmp_path):
    root = tmp_path / "ws"
    write(root / ".irisfedignore", "*.sock\n")
    os.mkfifo(root / "agent.sock")
    assert packed_names(root) == {".irisfedignore"}


def test_dangling_link_staying_inside_is_packed_as_is(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    os.symlink("not-yet/made.txt", root / "later")
    packed = pack_workspace(root, BIG)
    unpack_workspace(packed.data, tmp_path / "out", digest=packed.digest, max_files=10, max_bytes=10)
    assert os.readlink(tmp_path / "out/later") == "not-yet/made.txt"
    assert not (tmp_path / "out/later").exists()


@pytest.mark.parametrize("target", ["/etc/passwd", "{outside}", "../../outside", "../sub/../../outside",
                                    "dangling/../../../nowhere"])
def test_packing_refuses_a_link_leaving_the_root(tmp_path, target):
    (tmp_path / "outside").write_text("secret")
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    os.symlink(target.format(outside=tmp_path / "outside"), root / "sub" / "escape")
    with pytest.raises(WorkspaceError, match=r"^sub/escape is a symlink to .* leaves the workspace") as error:
        pack_workspace(root, BIG)
    assert "only symlinks with a relative target staying inside" in str(error.value)


def test_packing_refuses_a_chain_of_links_that_resolves_outside(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a").mkdir()
    (root / "c").mkdir()
    os.symlink("../c", root / "a" / "l")    # inside: a sibling folder, one level up
    os.symlink("a/l/../..", root / "up")    # lexically ".", really the root's parent
    with pytest.raises(WorkspaceError, match=r"^up is a symlink to 'a/l/\.\./\.\.' .*other links"):
        pack_workspace(root, BIG)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode, so nothing is unreadable")
def test_packing_refuses_an_unreadable_file(tmp_path):
    root = tmp_path / "ws"
    write(root / "secret.key", "k", 0o000)
    with pytest.raises(WorkspaceError, match=r"^secret\.key cannot be read"):
        pack_workspace(root, BIG)


def test_packing_refuses_what_the_system_will_not_let_it_read(tmp_path, monkeypatch):
    """The same refusals as above, reached whoever runs the test: the system says no."""
    root = tmp_path / "ws"
    write(root / "secret.key", "k")
    write(root / "locked" / "inside", "k")
    real_open, real_scandir = os.open, os.scandir

    def refusing_open(path, *args, **kwargs):
        if str(path).endswith("secret.key"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    def refusing_scandir(path="."):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(WorkspaceError, match=r"^secret\.key cannot be read .*readable, or listed in"):
        pack_workspace(root, BIG)
    monkeypatch.setattr(os, "scandir", refusing_scandir)
    with pytest.raises(WorkspaceError, match=r"^locked cannot be read"):
        pack_workspace(root, BIG)


def test_packing_refuses_a_fifo(tmp_path):
    root = tmp_path / "ws"
    (root / "run").mkdir(parents=True)
    os.mkfifo(root / "run" / "pipe")
    with pytest.raises(WorkspaceError, match=r"^run/pipe is a fifo; only directories, regular files and symlinks"):
        pack_workspace(root, BIG)


def test_packing_refuses_a_pack_over_the_cap_and_fits_exactly_at_it(tmp_path):
    root = tmp_path / "ws"
    write(root / "a.txt", "a" * 100)
    write(root / "big.bin", "b" * 30_000)
    size = pack_workspace(root, BIG).size
    assert pack_workspace(root, size).size == size
    with pytest.raises(WorkspaceError) as error:
        pack_workspace(root, size - 1)
    message = str(error.value)
    assert "max_workspace_mb" in message and "MiB" in message and f"({size} bytes) at big.bin" in message


def test_packing_stops_at_the_file_that_passes_the_cap(tmp_path):
    root = tmp_path / "ws"
    write(root / "a.txt", "small")
    with open(root / "b-huge.bin", "wb") as huge:
        huge.truncate(8 * 1024 * 1024 * 1024)  # sparse: reading it would take a while
    with pytest.raises(WorkspaceError, match=r"over max_workspace_mb \(1 MiB\).* at b-huge\.bin"):
        pack_workspace(root, 1024 * 1024)


def test_packing_refuses_a_root_that_is_not_a_directory(tmp_path):
    write(tmp_path / "file", "x")
    with pytest.raises(WorkspaceError, match="is not a directory"):
        pack_workspace(tmp_path / "file", BIG)
    with pytest.raises(WorkspaceError, match="is not a directory"):
        pack_workspace(tmp_path / "missing", BIG)


def test_packing_refuses_a_backslash_in_a_name(tmp_path):
    write(tmp_path / "ws" / "dir\\file", "x")
    with pytest.raises(WorkspaceError, match=r"^dir\\file has a backslash"):
        pack_workspace(tmp_path / "ws", BIG)


# --- unpacking hostile archives ----------------------------------------------------

@pytest.fixture
def sandbox(tmp_path):
    """``sandbox/`` holds dest's parent; ``outside/`` is what attacks aim at."""
    (tmp_path / "sandbox").mkdir()
    (tmp_path / "outside").mkdir()
    return tmp_path


def refused(sandbox: Path, data: bytes, *, max_files: int = 100, max_bytes: int = 10_000,
            digest: str | None = None) -> str:
    """Unpack, expect a refusal, check that nothing was written anywhere; the message."""
    dest = sandbox / "sandbox" / "ws"
    with pytest.raises(WorkspaceRefused) as error:
        unpack_workspace(data, dest, digest=digest or digest_of(data), max_files=max_files, max_bytes=max_bytes)
    assert sorted(os.listdir(sandbox)) == ["outside", "sandbox"]
    assert os.listdir(sandbox / "sandbox") == []  # neither dest nor a partial directory
    assert os.listdir(sandbox / "outside") == []
    return str(error.value)


def test_refuses_an_absolute_path(sandbox):
    target = sandbox / "outside" / "planted"
    assert refused(sandbox, archive(member(str(target), data=b"x"))).startswith(f"absolute path: '{target}'")


@pytest.mark.parametrize("name", ["../planted", "../../outside/planted", "a/../../planted", "a/b/../../../x"])
def test_refuses_dot_dot_components(sandbox, name):
    assert refused(sandbox, archive(member("a", tarfile.DIRTYPE), member(name, data=b"x"))) == f"'..' in path: {name!r}"


@pytest.mark.parametrize("name", ["", ".", "./", "./."])
def test_refuses_an_empty_name(sandbox, name):
    assert refused(sandbox, archive(member(name, data=b"x"))).startswith("empty member name")


def test_refuses_a_backslash_in_a_name(sandbox):
    assert refused(sandbox, archive(member("..\\..\\planted", data=b"x"))).startswith("backslash in the name")


@pytest.mark.parametrize("link", ["/etc/passwd", "inside.txt"])
def test_refuses_hard_links(sandbox, link):
    data = archive(member("inside.txt", data=b"x"), member("hard", tarfile.LNKTYPE, link=link))
    assert refused(sandbox, data) == f"hard link entry: 'hard' -> {link!r}"


@pytest.mark.parametrize(("kind", "what"), [(tarfile.CHRTYPE, "character device"), (tarfile.BLKTYPE, "block device"),
                                            (tarfile.FIFOTYPE, "fifo"), (tarfile.CONTTYPE, "contiguous file")])
def test_refuses_devices_fifos_and_contiguous_files(sandbox, kind, what):
    assert refused(sandbox, archive(member("dev/thing", kind))) == f"{what} entry: 'dev/thing'"


def test_refuses_an_unknown_entry_type(sandbox):
    assert refused(sandbox, archive(member("odd", b"Q"))).startswith("unknown entry type b'Q': 'odd'")


@pytest.mark.parametrize("target", ["/tmp", "{outside}", "../..", "../../outside", "../sub/../../..", "x/../../.."])
def test_refuses_a_symlink_leaving_the_tree(sandbox, target):
    target = target.format(outside=sandbox / "outside")
    data = archive(member("sub", tarfile.DIRTYPE), member("sub/link", tarfile.SYMTYPE, link=target))
    assert refused(sandbox, data).startswith(f"symlink leaving the tree: 'sub/link' -> {target!r}")


def test_refuses_a_chain_of_links_that_resolves_outside(sandbox):
    data = archive(member("a", tarfile.DIRTYPE), member("c", tarfile.DIRTYPE),
                   member("a/l", tarfile.SYMTYPE, link="../c"), member("up", tarfile.SYMTYPE, link="a/l/../.."))
    message = refused(sandbox, data)
    assert message.startswith("symlink leaving the tree: 'up' -> 'a/l/../..'") and "other links" in message


@pytest.mark.parametrize("target", ["{outside}", "..", "sub", "."])
def test_refuses_writing_through_a_symlink_already_extracted(sandbox, target):
    data = archive(member("sub", tarfile.DIRTYPE),
                   member("a", tarfile.SYMTYPE, link=target.format(outside=sandbox / "outside")),
                   member("a/planted", data=b"x"))
    message = refused(sandbox, data)
    assert message.startswith("symlink leaving the tree: 'a'") or message.startswith(
        "path through a symlink: 'a/planted' ('a' is a symlink)")
    if target in ("sub", "."):  # links that stay inside: the second member is what is refused
        assert message.startswith("path through a symlink")


def test_refuses_a_directory_entry_through_a_symlink(sandbox):
    data = archive(member("sub", tarfile.DIRTYPE), member("a", tarfile.SYMTYPE, link="sub"),
                   member("a/deeper", tarfile.DIRTYPE))
    assert refused(sandbox, data).startswith("path through a symlink: 'a/deeper'")


def test_refuses_a_path_through_a_file(sandbox):
    data = archive(member("a", data=b"x"), member("a/b", data=b"y"))
    assert refused(sandbox, data).startswith("path through a file: 'a/b'")


@pytest.mark.parametrize(("first", "second"), [
    (member("same", data=b"1"), member("same", data=b"2")),
    (member("same", data=b"1"), member("./same", tarfile.SYMTYPE, link="other")),
    (member("d", tarfile.DIRTYPE), member("d/", tarfile.DIRTYPE)),
    (member("d/f", data=b"1"), member("d", tarfile.SYMTYPE, link="e")),  # d made implicitly, then a link
])
def test_refuses_duplicate_members(sandbox, first, second):
    assert refused(sandbox, archive(first, second)).startswith("duplicate member")


def test_refuses_more_entries_than_allowed_and_accepts_exactly_that_many(sandbox):
    data = archive(member("d", tarfile.DIRTYPE), member("d/1", data=b"1"), member("d/2", data=b"2"))
    assert refused(sandbox, data, max_files=2) == "too many entries: more than 2 at 'd/2'"
    stats = unpack_workspace(data, sandbox / "sandbox" / "ws", digest=digest_of(data), max_files=3, max_bytes=2)
    assert (stats.files, stats.bytes) == (3, 2)


def test_refuses_more_bytes_than_allowed(sandbox):
    data = archive(member("a", data=b"x" * 600), member("b", data=b"y" * 600))
    assert refused(sandbox, data, max_bytes=1000).startswith("too many bytes: 'b' (600 bytes)")


def test_refuses_a_declared_size_the_archive_does_not_hold(sandbox):
    whole = archive(member("big", data=b"z" * 10_000))
    truncated = whole[:tarfile.BLOCKSIZE + 1000]  # the header says 10,000 bytes; 1,000 follow
    message = refused(sandbox, truncated, max_bytes=20_000)
    assert message == "truncated archive: 'big' declares 10000 bytes, the archive ends before them"


def test_refuses_bytes_that_are_not_a_tar(sandbox):
    assert refused(sandbox, b"this is not a tar archive" * 40).startswith("not a valid tar archive")


def test_refuses_a_digest_mismatch_before_writing_anything(sandbox):
    data = archive(member("fine", data=b"x"))
    message = refused(sandbox, data, digest=digest_of(b"other bytes"))
    assert message == f"digest mismatch: expected {digest_of(b'other bytes')}, the archive is {digest_of(data)}"


def test_strips_setuid_setgid_and_sticky_bits(sandbox):
    data = archive(member("shared", tarfile.DIRTYPE, mode=0o1777), member("shared/tool", data=b"#!", mode=0o6755),
                   member("plain", data=b"x", mode=0o2640))
    dest = sandbox / "sandbox" / "ws"
    unpack_workspace(data, dest, digest=digest_of(data), max_files=10, max_bytes=100)
    assert stat.S_IMODE((dest / "shared").stat().st_mode) == 0o777
    assert stat.S_IMODE((dest / "shared/tool").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "plain").stat().st_mode) == 0o640


def test_unpacks_from_a_file_and_makes_parents_the_archive_did_not_list(sandbox):
    data = archive(member("./a/b/c.txt", data=b"deep"))
    path = sandbox / "outside" / "ws.tar"
    path.write_bytes(data)
    dest = sandbox / "sandbox" / "ws"
    stats = unpack_workspace(path, dest, digest=digest_of(data), max_files=10, max_bytes=100)
    assert (stats.files, (dest / "a/b/c.txt").read_text()) == (3, "deep")  # entries: a and a/b made too
    assert stat.S_IMODE((dest / "a").stat().st_mode) == 0o755


def test_refuses_an_existing_dest(sandbox):
    data = archive(member("x", data=b"1"))
    (sandbox / "sandbox" / "ws").mkdir()
    with pytest.raises(FileExistsError):
        unpack_workspace(data, sandbox / "sandbox" / "ws", digest=digest_of(data), max_files=10, max_bytes=10)
    assert os.listdir(sandbox / "sandbox" / "ws") == []


def test_copy_tree_is_an_independent_copy_with_links_and_modes(tmp_path):
    root = make_tree(tmp_path / "ws")
    packed = pack_workspace(root, BIG)
    unpack_workspace(packed.data, tmp_path / "unpacked", digest=packed.digest, max_files=100, max_bytes=BIG)
    copy_tree(tmp_path / "unpacked", tmp_path / "run1")
    assert os.readlink(tmp_path / "run1" / "nested-link") == "data/nested"
    assert stat.S_IMODE((tmp_path / "run1" / "run.sh").stat().st_mode) == 0o755
    assert (tmp_path / "run1/run.sh").stat().st_ino != (tmp_path / "unpacked/run.sh").stat().st_ino
    (tmp_path / "run1" / "run.sh").write_text("changed by the run")
    assert (tmp_path / "unpacked" / "run.sh").read_text() == "#!/bin/sh\necho hi\n"
    assert pack_workspace(tmp_path / "run1", BIG).digest != packed.digest
    assert pack_workspace(tmp_path / "unpacked", BIG).digest == packed.digest
