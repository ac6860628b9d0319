"""Small helpers for the files the tiers write themselves (spill files, KV blocks, manifests): durable writes,
folder creation and folder locks, a few words for an OSError in a one-line message, and a disk budget checked
against the room its folder has.

A durable write here means: the bytes are fsynced before the file is renamed to its final name, and the folder is
fsynced after the rename, so a crash leaves either the old state or the new one, never a torn file under its name.

A write that finds no room (ENOSPC, EDQUOT, EFBIG) raises DiskFull: the tiers' files are caches of what the
checkpoint and the compute give again, so their callers survive it by writing no more, where a refused write of
another kind (a read-only filesystem, a permission) stays an error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

from offload.common.errors import OffloadError
from offload.common.sizes import format_size

FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # a write refused for want of room
_REASONS = {
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large",
    errno.ENOTDIR: "not a directory",
}


def os_error_reason(exc: OSError) -> str:
    """A few words for `exc` in a user-facing message ("permission denied", "no space left on device")."""
    return _REASONS.get(exc.errno, exc.strerror or str(exc))


class DiskFull(OffloadError):
    """A write of the tiers' files found no room: `where` (a folder, or the flag naming it) and `reason` ("no space
    left on device"), for the caller's own one line; str() is the whole message."""

    def __init__(self, where: str, reason: str, doing: str) -> None:
        super().__init__(f"{where}: {reason} ({doing})")
        self.where = where
        self.reason = reason


def write_error(exc: OSError, where: str, doing: str) -> OffloadError:
    """The one-line error for a write that failed with `exc`: DiskFull where it found no room."""
    if exc.errno in FULL:
        return DiskFull(where, os_error_reason(exc), doing)
    return OffloadError(f"{where}: {os_error_reason(exc)} ({doing})")


def free_space(folder: Path) -> int:
    """Bytes an unprivileged writer may still put on the filesystem that holds `folder` (or, where it does not exist
    yet, its nearest existing parent)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def check_disk_budget(flag: str, budget: int, folder: Path) -> None:
    """Refuse a budget given for a store in `folder` that its filesystem cannot hold: more than the free space plus
    what `folder` holds already (the store's own files, to reuse or evict: a rerun on the disk it filled fits)."""
    free, held = free_space(folder), _allocated(folder)
    if budget > free + held:
        kept = f" and {format_size(held)} held there already" if held else ""
        raise OffloadError(
            f"{flag} of {format_size(budget)} is more than {folder} can hold ({format_size(free)} free{kept})"
        )


def _allocated(folder: Path) -> int:
    """Bytes of disk `folder` and the files directly in it take (0 when it does not exist)."""
    try:
        entries = [os.stat(folder), *(e.stat(follow_symlinks=False) for e in os.scandir(folder) if e.is_file())]
    except FileNotFoundError:
        return 0
    return sum(st.st_blocks * 512 for st in entries)  # st_blocks: 512-byte units, whatever the filesystem's block


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
