"""Small helpers for the files the tiers write themselves (spill files, KV blocks, manifests): durable writes,
folder creation and folder locks, and a few words for an OSError in a one-line message.

A durable write here means: the bytes are fsynced before the file is renamed to its final name, and the folder is
fsynced after the rename, so a crash leaves either the old state or the new one, never a torn file under its name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

_REASONS = {
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOTDIR: "not a directory",
}


def os_error_reason(exc: OSError) -> str:
    """A few words for `exc` in a user-facing message ("permission denied", "no space left on device")."""
    return _REASONS.get(exc.errno, exc.strerror or str(exc))


def pwrite_all(fd: int, data: memoryview, offset: int, crc: int) -> int:
    """Write all of `data` at `offset` (pwrite may write less than asked); returns the CRC-32 continued over it."""
    crc = zlib.crc32(data, crc)
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
    return crc


def write_bytes(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pwrite_all(fd, memoryview(data), 0, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; the ones created, outermost first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    created = []
    for p in missing:
        p.mkdir()
        created.append(p)
    return created


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (flock on the directory itself, so no lock file is left behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def try_lock(folder: Path) -> int | None:
    """Take an exclusive lock on `folder` without waiting: the descriptor that holds it (closing it releases the
    lock, and so does the holder's death), or None when another open of the folder holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(folder: Path) -> None:
    """Make the renames inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
