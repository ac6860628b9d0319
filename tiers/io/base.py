"""The NVMe read interface: asynchronous reads of byte extents into aligned buffers.

A backend reads the ALIGN-aligned superset of the requested extent into the start of the caller's aligned
buffer, with O_DIRECT wherever the filesystem accepts it, so the page cache holds none of the checkpoint and
the bandwidth measured is the device's. `ReadRequest.wait()` hands back exactly the requested bytes. The backends
subclass ReadBackend (tiers/io/direct.py, tiers/io/aio.py); tiers/io/backends.py picks one by name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from offload.common.errors import OffloadError

ALIGN = 4096  # bytes; O_DIRECT alignment of file offsets, lengths and buffer addresses (>= the logical block size)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has no O_DIRECT: every file then reads buffered


class Span(NamedTuple):
    """An ALIGN-aligned extent of a file."""

    start: int  # bytes, a multiple of ALIGN
    length: int  # bytes, a multiple of ALIGN


def aligned_span(offset: int, nbytes: int) -> Span:
    """The smallest aligned extent covering bytes [offset, offset + nbytes)."""
    start = offset - offset % ALIGN
    end = -(-(offset + nbytes) // ALIGN) * ALIGN
    return Span(start, end - start)


HUGE_FROM = 4 << 20  # bytes; an unpinned buffer this large is mapped on its own and asked for transparent huge pages


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` rounded up to ALIGN, starting on an ALIGN boundary.

    pin=True page-locks it when CUDA is available (what the copy engine reads from); elsewhere it is ignored. An
    unpinned buffer of HUGE_FROM bytes or more is an anonymous mapping of its own advised MADV_HUGEPAGE (where
    the kernel offers transparent huge pages only when asked, as Debian's does): the first touch of its memory,
    whether the CPU's or a read's, then faults 2 MiB at a time. On a 2-core AMD EPYC VM, O_DIRECT reads into
    fresh memory ran at 2.08 GB/s against 1.04 with 4 KiB pages, and first writes at 3.6 GB/s against 0.85: the
    slots of an expert cache and resident layers are filled that way at load and in the first prefill.
    """
    length = aligned_span(0, nbytes).length
    if length >= HUGE_FROM and not (pin and torch.cuda.is_available()):
        return _mapped(length)
    raw = torch.empty(length + ALIGN, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + length]


def _mapped(length: int) -> torch.Tensor:
    """`length` bytes of fresh anonymous memory (page-aligned; unmapped when the tensor and its views are gone),
    asked for huge pages where the platform takes the advice."""
    area = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages, as torch's
            area.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(area, dtype=torch.uint8)  # the tensor holds the mapping alive


@dataclass(slots=True)
class OpenFile:
    """A file a backend holds open, with the identity it had at first open."""

    path: Path
    fd: int
    ino: int
    size: int  # bytes
    mtime_ns: int
    direct: bool  # opened with O_DIRECT; False where the filesystem refused it (EINVAL)


class ReadRequest:
    """One read in flight. `wait()` blocks until the requested bytes are in the buffer and returns a view of them."""

    __slots__ = ("_path", "_offset", "_nbytes", "_start", "_view", "_reap", "_error")

    def __init__(self, path: Path, offset: int, nbytes: int, start: int, view: torch.Tensor, reap: Callable[[], int]):
        self._path = path
        self._offset = offset
        self._nbytes = nbytes
        self._start = start  # file offset of the buffer's first byte
        self._view = view  # [nbytes] uint8, inside the caller's buffer
        self._reap: Callable[[], int] | None = reap  # blocks; returns the bytes that landed from `start` on
        self._error: OffloadError | None = None  # once set, every wait() raises it

    def wait(self) -> torch.Tensor:
        """The requested bytes: a uint8 view into the buffer given to `submit`. Waiting twice is harmless."""
        if self._reap is not None:
            reap, self._reap = self._reap, None
            try:
                landed = reap()
            except OffloadError as exc:
                self._error = exc
            else:
                if self._nbytes and self._start + landed < self._offset + self._nbytes:
                    self._error = OffloadError(
                        f"{self._path}: truncated: wanted bytes {self._offset}..{self._offset + self._nbytes}, "
                        f"file ends at {self._start + landed}"
                    )
        if self._error is not None:
            raise self._error
        return self._view


class ReadBackend(ABC):
    """Asynchronous aligned reads from files that stay open until `close()`.

    Invariants: `submit` reads the aligned span of [offset, offset + nbytes) into buf[:span.length] and never
    writes past it; bytes outside the file's end are left as they were. `bytes_read` counts bytes transferred from
    storage (aligned lengths, short only at end of file); `read_seconds` is the wall time during which at least one
    read was in flight, so bytes_read / read_seconds is the achieved bandwidth. A file's inode, size and mtime are
    taken at its first open, and a later `submit` that finds them changed raises, so a checkpoint rewritten during
    a run is never read half old, half new.
    """

    name: str

    def __init__(self) -> None:
        self.bytes_read = 0  # bytes
        self.lock_note = ""  # why a buffer asked of locked_buffer was refused, said once; "" while none was
        self._read_seconds = 0.0  # closed busy intervals; see read_seconds
        self._files: dict[Path, OpenFile] = {}
        self._lock = threading.Lock()  # guards _files and the counters
        self._in_flight = 0  # reads begun and not yet ended (see _io_begin)
        self._busy_since = 0.0

    @abstractmethod
    def _start(self, file: OpenFile, start: int, region: torch.Tensor) -> Callable[[], int]:
        """Begin reading file bytes from `start` into `region` ([aligned length] uint8, aligned, not past the span).

        Returns a function that blocks until the read is done and returns how many bytes landed from `start` on
        (fewer than len(region) only at end of file).
        """

    def submit(self, path: Path, offset: int, nbytes: int, buf: torch.Tensor) -> ReadRequest:
        """Start reading bytes [offset, offset + nbytes) of `path`; `buf` receives their aligned span at its start."""
        if offset < 0 or nbytes < 0:
            raise ValueError(f"offset and nbytes must be >= 0, got offset={offset} nbytes={nbytes}")
        span = aligned_span(offset, nbytes)
        _check_buffer(buf, span.length)
        file = self._open(path)
        self._check_unchanged(file)
        if offset + nbytes > file.size:
            raise OffloadError(f"{path}: truncated: wanted bytes {offset}..{offset + nbytes}, file ends at {file.size}")
        region = buf[: span.length]
        view = buf[offset - span.start : offset - span.start + nbytes]
        reap = self._start(file, span.start, region) if nbytes else lambda: 0
        return ReadRequest(path, offset, nbytes, span.start, view, reap)

    def locked_buffer(self, nbytes: int) -> torch.Tensor | None:
        """An ALIGN-aligned uint8 buffer of `nbytes` rounded up to ALIGN, page-locked by this backend, that its reads
        fill faster than other memory; None where it has none to give (this one reads as fast into any aligned
        buffer). Each goes back through `free_locked` once the last read into it has been waited for."""
        return None

    def free_locked(self, buf: torch.Tensor) -> None:
        """Give back a buffer from `locked_buffer`; nothing may read into it any more."""
        raise ValueError(f"{self.name}: buffer {buf.data_ptr():#x} was not locked here")

    def file_size(self, path: Path) -> int:
        """Size of `path` in bytes, as at its first open."""
        return self._open(path).size

    def is_direct(self, path: Path) -> bool:
        """Whether reads of `path` bypass the page cache (its descriptor really carries O_DIRECT)."""
        return bool(O_DIRECT) and bool(fcntl.fcntl(self._open(path).fd, fcntl.F_GETFL) & O_DIRECT)

    def close(self) -> None:
        """Close every file; subclasses first wait for their reads in flight. The backend stays usable."""
        with self._lock:
            for file in self._files.values():
                os.close(file.fd)
            self._files.clear()

    def __enter__(self) -> ReadBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, path: Path) -> OpenFile:
        path = Path(path)
        with self._lock:
            file = self._files.get(path)
            if file is None:
                file = self._files[path] = _open_file(path)
            return file

    @staticmethod
    def _check_unchanged(file: OpenFile) -> None:
        """Raise if the file at `file.path` is no longer the one first opened (stat by name: a rename counts)."""
        try:
            st = os.stat(file.path)
        except FileNotFoundError:
            raise OffloadError(f"{file.path}: removed during the run") from None
        if st.st_ino != file.ino:
            raise OffloadError(f"{file.path}: replaced by another file during the run")
        if st.st_size != file.size:
            raise OffloadError(f"{file.path}: changed size during the run (was {file.size}, now {st.st_size})")
        if st.st_mtime_ns != file.mtime_ns:
            raise OffloadError(
                f"{file.path}: modified during the run (mtime was {file.mtime_ns} ns, now {st.st_mtime_ns})"
            )

    @property
    def read_seconds(self) -> float:
        """Wall time with at least one read in flight, up to now: a busy interval still open counts so far (the
        ring keeps reads in flight across steps, so intervals may rarely close)."""
        with self._lock:
            open_interval = time.perf_counter() - self._busy_since if self._in_flight else 0.0
            return self._read_seconds + open_interval

    def _io_begin(self) -> None:
        """A read starts: the busy clock runs while at least one read is in flight."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def _io_end(self, nbytes: int) -> None:
        """A read that began with `_io_begin` ended, having transferred `nbytes` from storage."""
        with self._lock:
            self.bytes_read += nbytes
            self._in_flight -= 1
            if self._in_flight == 0:
                self._read_seconds += time.perf_counter() - self._busy_since


def evict_page_cache(path: Path) -> None:
    """Write back and drop `path`'s pages from the page cache, so the next buffered read comes from storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open_file(path: Path) -> OpenFile:
    try:
        try:
            fd = os.open(path, os.O_RDONLY | O_DIRECT)
            direct = bool(O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem does not do O_DIRECT (e.g. some FUSE mounts)
                raise
            fd = os.open(path, os.O_RDONLY)
            direct = False
    except FileNotFoundError:
        raise OffloadError(f"{path}: file not found") from None
    except OSError as exc:
        raise OffloadError(f"{path}: cannot open ({exc.strerror})") from None
    st = os.fstat(fd)
    return OpenFile(path, fd, st.st_ino, st.st_size, st.st_mtime_ns, direct)


def _check_buffer(buf: torch.Tensor, length: int) -> None:
    if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(f"read buffer must be a contiguous uint8 CPU tensor, got {buf.dtype} on {buf.device}")
    if buf.data_ptr() % ALIGN:
        raise ValueError(f"read buffer must start on a {ALIGN}-byte boundary (address {buf.data_ptr():#x})")
    if buf.numel() < length:
        raise ValueError(f"read buffer holds {buf.numel()} bytes, the aligned span needs {length}")
