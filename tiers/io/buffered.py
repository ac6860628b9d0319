"""Read byte extents of files with os.pread: files stay open, every byte read is counted.

This backend goes through the page cache; the O_DIRECT and libaio backends sit beside it behind the
same two verbs (`size`, `read_into`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from offload.common.errors import OffloadError


class BufferedReader:
    """Positional reads from files that stay open until `close()`."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0  # bytes
        self.read_seconds = 0.0

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise OffloadError(f"{path}: file not found") from None
            except OSError as exc:
                raise OffloadError(f"{path}: cannot open ({exc.strerror})") from None
            self._fds[path] = fd
        return fd

    def size(self, path: Path) -> int:
        """Current size of `path` in bytes."""
        return os.fstat(self._fd(path)).st_size

    def read_into(self, path: Path, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of `path` starting at `offset`; a short file is an error."""
        fd = self._fd(path)
        start = time.perf_counter()
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise OffloadError(
                    f"{path}: truncated: wanted bytes {offset}..{offset + len(out)}, file ends at {offset + done}"
                )
            done += n
        self.read_seconds += time.perf_counter() - start
        self.bytes_read += done

    def read(self, path: Path, offset: int, nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        self.read_into(path, offset, memoryview(buf))
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> BufferedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
