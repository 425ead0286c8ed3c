"""Workspaces (DESIGN 3.5): a directory packed into deterministic bytes, and back.

It owns which entries of a directory travel (``pack_workspace``), their layout,
how a peer turns verified bytes back into a tree without writing outside it
(``unpack_workspace``, ``unpack_stream``), and each run's fresh copy (``copy_tree``). Pure filesystem
and bytes, no network, no asyncio: storing, fetching and caching are the callers'.

The format: an uncompressed PAX tar of directories, regular files and symlinks
only (a hard link in the source becomes a separate file), sorted by path, mtime 0,
uid/gid 0, no owner names: one tree, one digest ("sha256:<64 hex>" of the bytes).

Packing, for each entry below the root (walked without following links):
1. an entry named ``.git`` (directory, or a worktree's gitlink file) is left out;
2. what ``root/.irisfedignore`` lists is left out (gitignore subset: ``#`` comments,
   ``!`` negation, a trailing ``/`` for directories only, a leading or inner ``/``
   anchors to the root, ``*``, ``?``, ``**``, ``[...]``; the last matching line
   wins; an ignored directory is not walked, so nothing under it comes back); the
   ignore file itself (read only if a regular file) is packed like any other;
3. directories and regular files are packed with their permission bits (& 0o777);
4. a symlink is packed as its link text when the text is relative, stays inside
   lexically, and what it resolves to (as far as it resolves) is inside too; a
   dangling link passing both checks is packed as it is (the run sees it dangle);
   a link to a folder that holds it (``a -> .``: a loop) is refused, packing and
   unpacking;
5. anything else is a ``WorkspaceError`` before anything is returned: a link
   leaving, an unreadable entry, a fifo/socket/device, a backslash in a name, a path
   deeper than ``MAX_DEPTH``, a pack over ``max_bytes`` (checked before each file is
   read). Unpacking refuses a path deeper than ``MAX_DEPTH`` too.

Unpacking writes each member itself (no ``extractall``) into
``.<dest>.partial-<random>`` beside ``dest``, through directory descriptors opened
with ``O_NOFOLLOW``, and renames it to ``dest`` only when complete and verified:
``unpack_workspace`` checks bytes in hand against the digest first;
``unpack_stream`` unpacks bytes as they arrive and renames only once its ``check``
(the digest of all that was read) passes, so a tree under its final name is always
the digest's. Any refusal (``WorkspaceRefused``) or error removes the partial
tree. Setuid/setgid/sticky bits are dropped; files keep at least u+r and
directories u+rwx so the agent can always copy and remove what it unpacked.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import re
import secrets
import shutil
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
MIB = 1024 * 1024
IGNORE_FILE = ".irisfedignore"
# Linux's NAME_MAX and PATH_MAX: longer names could not be created on a peer anyway.
NAME_MAX, PATH_MAX = 255, 4095
# The deepest path a workspace may hold (components): deeper trees break recursive
# walks and copies (Python's recursion limit) on every peer that takes them.
MAX_DEPTH = 128
CHUNK = 1024 * 1024  # unpack writes a member this much at a time
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_REFUSED_TYPES = {tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device",
                  tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "fifo",
                  tarfile.CONTTYPE: "contiguous file", tarfile.GNUTYPE_SPARSE: "sparse file"}
_KEPT_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE)
_SPECIAL = {"p": "fifo", "s": "socket", "c": "character device", "b": "block device"}  # stat.filemode's letter


class WorkspaceError(ValueError):
    """A directory that cannot be packed; the message names the entry (relative to
    the root) and says what is allowed."""


class WorkspaceRefused(Exception):
    """An archive a peer will not unpack; the job fails "workspace refused: <message>".
    The message starts with what was wrong and names the member."""


@dataclass(frozen=True)
class PackedWorkspace:
    """A packed workspace: the archive, its digest, its length, and its entry count
    (directories, files and links: what ``max_workspace_files`` counts)."""

    data: bytes
    digest: str
    size: int
    files: int


@dataclass(frozen=True)
class UnpackedStats:
    """What an unpack wrote: entries (as ``PackedWorkspace.files``) and file bytes."""

    files: int
    bytes: int


def digest_of(data: bytes) -> str:
    """The content digest of archive bytes: "sha256:<64 lowercase hex>"."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- rules both directions share -------------------------------------------------

def _name_problem(path: str) -> str | None:
    """Why a relative "/"-joined path may not name a workspace entry, or None."""
    if "\x00" in path:
        return "NUL byte in the name"
    if "\\" in path:
        return "backslash in the name"
    if (len(path.encode("utf-8", "surrogateescape")) > PATH_MAX
            or any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX for part in path.split("/"))):
        return "name too long"
    return None


def _link_problem(link_path: str, target: str) -> str | None:
    """Why a link at ``link_path`` with text ``target`` leaves the tree, judged
    lexically from the link's directory, or None."""
    if not target or "\x00" in target:
        return "empty or NUL target"
    if target.startswith("/"):
        return "absolute target"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link_path), target))
    if resolved == ".." or resolved.startswith("../"):
        return "target climbs out through '..'"
    return None


def _inside(root_real: str, path: str) -> bool:
    return os.path.commonpath([root_real, path]) == root_real


def _loops(root_real: str, path: str) -> bool:
    """Whether the symlink at ``path`` resolves to a folder holding it (``a -> .``,
    ``b -> ..``): a walk that follows links (``cp -r``, Ray's packaging) never ends."""
    resolved = os.path.realpath(os.path.join(root_real, path))
    holder = os.path.realpath(os.path.dirname(os.path.join(root_real, path)))
    return os.path.isdir(resolved) and _inside(resolved, holder)


# --- .irisfedignore ----------------------------------------------------------------

class _Rule(NamedTuple):
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _glob_regex(pattern: str) -> str:
    """A gitignore glob as a regex over "/"-joined relative paths."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        after = pattern[i + 2:i + 3]
        if pattern.startswith("**", i) and (i == 0 or pattern[i - 1] == "/") and after in ("/", ""):
            out.append("(?:.*/)?" if after else ".*")  # "**/": any leading directories; a last "**": all inside
            i += 3
            continue
        if c == "*":
            while pattern.startswith("*", i):  # other runs of stars are one star
                i += 1
            out.append("[^/]*")
            continue
        if c == "?":
            out.append("[^/]")
        elif c == "[":
            start = i + 2 if pattern[i + 1:i + 2] in ("!", "^") else i + 1
            end = pattern.find("]", start + 1)  # a "]" first in the class is a member
            if end < 0:
                out.append(re.escape(c))
            else:
                body = "".join("\\" + ch if ch in "\\[]^" else ch for ch in pattern[start:end])
                out.append("(?!/)[" + ("^" if start == i + 2 else "") + body + "]")
                i = end
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _parse_ignore(text: str) -> list[_Rule]:
    rules = []
    for line in text.splitlines():
        while line.endswith(" ") and not line.endswith("\\ "):
            line = line[:-1]
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:] if negate else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        body = _glob_regex(line.removeprefix("/"))
        rules.append(_Rule(re.compile(body if anchored else "(?:.*/)?" + body, re.S), negate, dir_only))
    return rules


def _ignored(rules: list[_Rule], path: str, is_dir: bool) -> bool:
    ignored = False
    for rule in rules:
        if (is_dir or not rule.dir_only) and rule.regex.fullmatch(path):
            ignored = not rule.negate
    return ignored


# --- packing -------------------------------------------------------------------------

def _unreadable(path: str) -> WorkspaceError:
    return WorkspaceError(f"{path} cannot be read (permission denied); every file and directory in a "
                          f"workspace must be readable, or listed in {IGNORE_FILE} to leave it out.")


def _header(path: str, kind: bytes, mode: int, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.type, info.mode, info.linkname = kind, mode, target
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # the same bytes anywhere
    return info


def _scan(root_real: str, rules: list[_Rule]) -> list[tarfile.TarInfo]:
    """A header for every entry that travels, checked, sorted by path; no file content is read."""
    entries: list[tarfile.TarInfo] = []
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            with os.scandir(os.path.join(root_real, rel)) as listing:
                children = [(child.name, child.stat(follow_symlinks=False)) for child in listing]
        except PermissionError:
            raise _unreadable(rel or ".") from None
        for name, st in children:
            path = f"{rel}/{name}" if rel else name
            is_dir = stat.S_ISDIR(st.st_mode)
            if name == ".git" or _ignored(rules, path, is_dir):
                continue
            problem = _name_problem(path)
            if problem:
                raise WorkspaceError(f"{path} has a {problem}; workspace names may not hold backslashes "
                                     f"or NUL bytes, nor pass {NAME_MAX} bytes per name.")
            if path.count("/") >= MAX_DEPTH:
                raise WorkspaceError(f"{path[:200]} is deeper than {MAX_DEPTH} levels; a workspace may not "
                                     f"nest deeper (list it in {IGNORE_FILE}).")
            mode = stat.S_IMODE(st.st_mode) & 0o777
            if is_dir:
                entries.append(_header(path, tarfile.DIRTYPE, mode))
                pending.append(path)
            elif stat.S_ISREG(st.st_mode):
                entries.append(_header(path, tarfile.REGTYPE, mode))
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(os.path.join(root_real, path))
                problem = _link_problem(path, target)
                if problem is None and not _inside(root_real, os.path.realpath(os.path.join(root_real, path))):
                    problem = "it resolves outside through other links"
                if problem is None and _loops(root_real, path):
                    raise WorkspaceError(f"{path} is a symlink to {target!r}, a folder that holds it: a loop that "
                                         f"tools following links never finish (list it in {IGNORE_FILE}).")
                if problem:
                    raise WorkspaceError(f"{path} is a symlink to {target!r} that leaves the workspace ({problem}); "
                                         f"only symlinks with a relative target staying inside can be packed.")
                entries.append(_header(path, tarfile.SYMTYPE, 0o777, target))
            else:
                kind = _SPECIAL.get(stat.filemode(st.st_mode)[0], "special file")
                raise WorkspaceError(f"{path} is a {kind}; only directories, regular files and symlinks "
                                     f"staying inside can be packed (list it in {IGNORE_FILE}).")
    return sorted(entries, key=lambda entry: entry.name)


def _check_cap(tar: tarfile.TarFile, info: tarfile.TarInfo | None, max_bytes: int, path: str) -> None:
    """Refuse when the archive, closed right after ``info`` (None: now), would pass
    the cap; closing adds two zero blocks and pads to tarfile's record size."""
    block, record = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
    end = tar.offset
    if info is not None:
        end += len(info.tobuf(tar.format, tar.encoding, tar.errors)) + -(-info.size // block) * block
    final = -(-(end + 2 * block) // record) * record
    if final > max_bytes:
        raise WorkspaceError(f"the workspace is over max_workspace_mb ({max_bytes / MIB:g} MiB): the pack reached "
                             f"{final / MIB:.2f} MiB ({final} bytes) at {path}; list what need not travel "
                             f"in {IGNORE_FILE} or raise max_workspace_mb.")


def _add_file(tar: tarfile.TarFile, root_real: str, info: tarfile.TarInfo, max_bytes: int) -> None:
    """Add one regular file, streamed, once its size is known to keep the pack under the cap."""
    changed = f"{info.name} changed while it was packed; pack a workspace nothing else is writing to."
    try:
        fd = os.open(os.path.join(root_real, info.name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except PermissionError:
        raise _unreadable(info.name) from None
    with open(fd, "rb") as source:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WorkspaceError(changed)
        info.size = st.st_size
        _check_cap(tar, info, max_bytes, info.name)
        try:
            tar.addfile(info, source)
        except OSError:  # the file shrank under us
            raise WorkspaceError(changed) from None


def pack_workspace(root: Path, max_bytes: int) -> PackedWorkspace:
    """Pack the directory ``root`` (rules in the module docstring) into at most
    ``max_bytes`` archive bytes, reading one file at a time.

    Raises ``WorkspaceError`` naming the first entry that cannot travel.
    """
    if not os.path.isdir(root):
        raise WorkspaceError(f"{root} is not a directory; a workspace must be a directory.")
    root_real = os.path.realpath(root)
    rules: list[_Rule] = []
    ignore_path = os.path.join(root_real, IGNORE_FILE)
    if os.path.isfile(ignore_path) and not os.path.islink(ignore_path):
        try:
            with open(ignore_path, "rb") as ignore_file:
                rules = _parse_ignore(ignore_file.read().decode("utf-8", "surrogateescape"))
        except PermissionError:
            raise _unreadable(IGNORE_FILE) from None
    entries = _scan(root_real, rules)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
        for info in entries:
            if info.isreg():
                _add_file(tar, root_real, info, max_bytes)
            else:
                _check_cap(tar, info, max_bytes, info.name)
                tar.addfile(info)
        _check_cap(tar, None, max_bytes, entries[-1].name if entries else ".")
    data = buffer.getvalue()
    return PackedWorkspace(data=data, digest=digest_of(data), size=len(data), files=len(entries))


# --- unpacking -------------------------------------------------------------------------

def _member_path(name: str) -> str:
    """The member's path with "." and empty components dropped, or a refusal."""
    if name.startswith("/"):
        raise WorkspaceRefused(f"absolute path: {name!r}")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise WorkspaceRefused(f"'..' in path: {name!r}")
    if not parts:
        raise WorkspaceRefused(f"empty member name: {name!r}")
    path = "/".join(parts)
    problem = _name_problem(path)
    if problem:
        raise WorkspaceRefused(f"{problem}: {name!r}")
    if len(parts) > MAX_DEPTH:
        raise WorkspaceRefused(f"path deeper than {MAX_DEPTH} levels: {name[:200]!r}")
    return path


def _check_member(member: tarfile.TarInfo, path: str, kinds: dict[str, str], members: set[str]) -> None:
    if member.type in _REFUSED_TYPES or member.sparse is not None:
        kind = _REFUSED_TYPES.get(member.type, "sparse file")
        raise WorkspaceRefused(f"{kind} entry: {path!r}" + (f" -> {member.linkname!r}" if member.islnk() else ""))
    if member.type not in _KEPT_TYPES:
        raise WorkspaceRefused(f"unknown entry type {member.type!r}: {path!r}")
    if path in members or (path in kinds and not (member.isdir() and kinds[path] == "dir")):
        raise WorkspaceRefused(f"duplicate member: {path!r}")
    parts = path.split("/")
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        if kinds.get(prefix) == "link":
            raise WorkspaceRefused(f"path through a symlink: {path!r} ({prefix!r} is a symlink)")
        if kinds.get(prefix) == "file":
            raise WorkspaceRefused(f"path through a file: {path!r} ({prefix!r} is a file)")
    if member.issym():
        problem = _link_problem(path, member.linkname)
        if problem:
            raise WorkspaceRefused(f"symlink leaving the tree: {path!r} -> {member.linkname!r} ({problem})")


def _dir_fd(parent: int, name: str, mode: int | None, create: bool) -> int:
    """Open (made first if ``create``) the directory ``name`` under ``parent``,
    never through a link, setting its mode when one is given."""
    if create:
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    if mode is not None:
        os.fchmod(fd, mode)
    return fd


def _parent_fd(root_fd: int, parts: list[str], kinds: dict[str, str]) -> int:
    """A descriptor on the member's parent, each step opened with O_NOFOLLOW;
    parents the archive did not list are made (0o755)."""
    fd = root_fd
    try:
        for i, name in enumerate(parts[:-1]):
            prefix = "/".join(parts[:i + 1])
            made = prefix not in kinds
            step = _dir_fd(fd, name, 0o755 if made else None, made)
            kinds[prefix] = "dir"
            if fd != root_fd:
                os.close(fd)
            fd = step
    except BaseException:
        if fd != root_fd:
            os.close(fd)
        raise
    return fd


def _write_file(tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, path: str, budget: int,
                max_bytes: int) -> int:
    """Write one regular member; returns the bytes actually read and written."""
    if member.size > budget:
        raise WorkspaceRefused(f"too many bytes: {path!r} ({member.size} bytes) passes the cap of "
                               f"{max_bytes} unpacked bytes")
    written = 0
    with open(os.open(path.rsplit("/", 1)[-1], _NEW_FILE_FLAGS, 0o600, dir_fd=parent), "wb") as out:
        source = tar.extractfile(member)
        try:
            while written < member.size:
                chunk = source.read(min(CHUNK, member.size - written))
                if not chunk:
                    break
                written += len(chunk)
                if written > budget:
                    raise WorkspaceRefused(f"too many bytes: {path!r} passes the cap of {max_bytes} unpacked bytes")
                out.write(chunk)
        except tarfile.TarError:
            pass  # the archive ended inside this member: reported just below
        os.fchmod(out.fileno(), (member.mode & 0o777) | 0o400)
    if written != member.size:
        raise WorkspaceRefused(f"truncated archive: {path!r} declares {member.size} bytes, the archive ends "
                               f"before them")
    return written


def _extract(source: BinaryIO, root: Path, max_files: int, max_bytes: int) -> UnpackedStats:
    kinds: dict[str, str] = {}  # path -> "dir" | "file" | "link", implicit parents included
    members: set[str] = set()
    links: list[tuple[str, str]] = []
    count = total = 0
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        with tarfile.open(fileobj=source, mode="r|") as tar:
            for member in tar:
                count += 1
                if count > max_files:
                    raise WorkspaceRefused(f"too many entries: more than {max_files} at {member.name!r}")
                path = _member_path(member.name)
                _check_member(member, path, kinds, members)
                members.add(path)
                parts = path.split("/")
                # Folders a member's path makes without listing them count as entries too.
                count += sum(1 for i in range(1, len(parts)) if "/".join(parts[:i]) not in kinds)
                if count > max_files:
                    raise WorkspaceRefused(f"too many entries: more than {max_files}, folders its paths make "
                                           f"included, at {member.name!r}")
                parent = _parent_fd(root_fd, parts, kinds)
                try:
                    if member.isdir():
                        os.close(_dir_fd(parent, parts[-1], (member.mode & 0o777) | 0o700, path not in kinds))
                        kinds[path] = "dir"
                    elif member.issym():
                        os.symlink(member.linkname, parts[-1], dir_fd=parent)
                        kinds[path] = "link"
                        links.append((path, member.linkname))
                    else:
                        kinds[path] = "file"
                        total += _write_file(tar, member, parent, path, max_bytes - total, max_bytes)
                finally:
                    if parent != root_fd:
                        os.close(parent)
    except tarfile.TarError as error:
        raise WorkspaceRefused(f"not a valid tar archive: {error}") from None
    finally:
        os.close(root_fd)
    root_real = os.path.realpath(root)
    for path, target in links:  # a chain (b -> ., a -> b/..) passes each lexical check alone
        if not _inside(root_real, os.path.realpath(os.path.join(root_real, path))):
            raise WorkspaceRefused(f"symlink leaving the tree: {path!r} -> {target!r} (resolves outside through "
                                   f"other links)")
        if _loops(root_real, path):
            raise WorkspaceRefused(f"symlink loop: {path!r} -> {target!r} points at a folder that holds it")
    return UnpackedStats(files=count, bytes=total)


def unpack_workspace(data: bytes | Path, dest: Path, *, digest: str, max_files: int,
                     max_bytes: int) -> UnpackedStats:
    """Unpack archive bytes (or the archive file at a path, read once) into
    ``dest``, which must not exist, after checking they are ``digest``; at most
    ``max_files`` entries and ``max_bytes`` file bytes.

    Raises ``WorkspaceRefused`` for a digest mismatch or any member it will not
    write (module docstring); then nothing is left at ``dest`` or beside it.
    """
    dest = Path(dest)
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} already exists; a workspace unpacks into a new directory")
    if not isinstance(data, (bytes, bytearray)):
        data = Path(data).read_bytes()  # once: the bytes checked are the bytes unpacked
    actual = digest_of(data)
    if actual != digest:
        raise WorkspaceRefused(f"digest mismatch: expected {digest}, the archive is {actual}")
    return _into(dest, lambda partial: _extract(io.BytesIO(data), partial, max_files, max_bytes))


def unpack_stream(source: BinaryIO, dest: Path, *, check: Callable[[], None], max_files: int,
                  max_bytes: int) -> UnpackedStats:
    """Unpack an archive read from ``source`` while it arrives (``source.read`` blocks
    for the next bytes and raises when their transfer failed) into ``dest``, which must
    not exist; limits as ``unpack_workspace``. ``source`` is read to its end, then
    ``check()`` raises unless every byte read is the digest's (the caller hashes them as
    they are read); only then is the tree renamed to ``dest``.

    A member refused is raised (``WorkspaceRefused``) only after the source ended and
    passed ``check``: bytes garbled on the way are the transfer's error, not the archive's.
    """
    dest = Path(dest)
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} already exists; a workspace unpacks into a new directory")

    def unpack(partial: Path) -> UnpackedStats:
        try:
            stats = _extract(source, partial, max_files, max_bytes)
        except WorkspaceRefused:
            _read_to_end(source)
            check()
            raise
        _read_to_end(source)  # what follows the archive's end (tar padding) is checked too
        check()
        return stats
    return _into(dest, unpack)


def _read_to_end(source: BinaryIO) -> None:
    while source.read(CHUNK):
        pass


def _into(dest: Path, unpack: Callable[[Path], UnpackedStats]) -> UnpackedStats:
    """``unpack(partial)`` into a new partial folder beside ``dest``, renamed to ``dest``
    when it returns; removed when it raises."""
    partial = dest.parent / f".{dest.name}.partial-{secrets.token_hex(8)}"
    os.mkdir(partial, 0o700)
    try:
        stats = unpack(partial)
        os.rename(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return stats


def copy_tree(src: Path, dst: Path) -> None:
    """A fresh, independent copy of an unpacked workspace for one run: real file
    copies (no hard links), symlinks copied as links, modes kept; ``dst`` must not exist."""
    shutil.copytree(src, dst, symlinks=True)
