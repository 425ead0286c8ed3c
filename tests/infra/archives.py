"""Hand-built tar archives for the workspace tests: what irisfed's own packing would
never make (hostile members), so each unpack refusal can be tested."""

from __future__ import annotations

import io
import tarfile


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", *, link: str = "",
           mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    """One archive member: a file of ``data``, a directory, a link to ``link``, a device..."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.size = kind, link, mode, len(data)
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, data


def archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    """The PAX tar of ``members``, in the order given."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()
